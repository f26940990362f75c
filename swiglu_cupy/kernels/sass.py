"""Reading a cubin's machine code (SASS) without a GPU: disassembly with
``cuobjdump -sass`` (from the nvidia-cuda-cuobjdump wheel), the parsed
instruction list of every kernel function, and what can be read off it
statically: local memory, the width of every global access, CALLs, the
loops (backward branches) and the hot loop.

The model of what a kernel costs per element (a walk of one thread's path
through this code) is in ``sass_walk.py``; the per-kernel report and its
goals in ``machine_code.py``.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .cuda_headers import cuda_tool


class SassError(RuntimeError):
    pass


# ---- operands ------------------------------------------------------------------------------
# Each operand is decoded once into a small tuple, the walk reads these:
#   ("r", index, neg, inv, abs, mods)    R0..R254, RZ = 255 (reads 0, writes vanish)
#   ("u", index, neg, inv, abs, mods)    UR0..UR254, URZ = 255
#   ("p", index, negated)                P0..P6, PT = 7
#   ("up", index, negated)               UP0..UP6, UPT = 7
#   ("i", value)                         integer immediate, as a 32-bit pattern
#   ("f", value)                         floating-point immediate
#   ("c", bank, reg, offset, neg, inv, abs)  constant bank c[bank][reg + offset] (reg may be None)
#   ("m", base, base64, ureg, offset)    memory address [base(.64) + ureg + offset]
#   ("s", name)                          special register (SR_TID.X, ...)
#   ("b", index)                         convergence barrier B0..B15
#   ("?", text)                          anything else (kept, never evaluated)
RZ, URZ, PT = 255, 255, 7
_MASK = 0xFFFFFFFF

_REG = re.compile(r"^([-~!]?)(\|?)(U?R(?:\d+|Z))(\|?)((?:\.\w+)*)$")
_PRED = re.compile(r"^(!?)(U?P)(T|\d)$")
_HEX = re.compile(r"^([-+]?)0x([0-9a-fA-F]+)$")
_FLOAT = re.compile(r"^[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|INF|QNAN|NAN)$")
_CONST = re.compile(r"^([-~]?)(\|?)c\[0x([0-9a-f]+)\]\[([^\]]+)\](\|?)((?:\.\w+)*)$")
_MEM = re.compile(r"^(?:desc\[(UR\d+)\])?\[([^\]]*)\]$")
_SPECIAL = re.compile(r"^(SR_\w+(?:\.\w+)?|SRZ)$")
_BARRIER = re.compile(r"^B(\d+)$")


def _reg_index(name: str) -> tuple[str, int]:
    uniform = name.startswith("U")
    body = name[2:] if uniform else name[1:]
    if body == "Z":
        return ("u" if uniform else "r"), (URZ if uniform else RZ)
    return ("u" if uniform else "r"), int(body)


def _float_immediate(text: str) -> float:
    t = text.upper()
    if t.endswith("INF"):
        return float("-inf") if t.startswith("-") else float("inf")
    if t.endswith("NAN"):
        return float("nan")
    return float(text)


def _int_value(text: str) -> int | None:
    m = _HEX.match(text)
    if not m:
        return None
    value = int(m.group(2), 16)
    return (-value if m.group(1) == "-" else value) & ((1 << 64) - 1)


def _address(inner: str) -> tuple:
    base, base64, ureg, offset = RZ, False, None, 0
    for term in re.split(r"\+(?=[^+])", inner.replace(" ", "")):
        if not term:
            continue
        if m := _REG.match(term):
            kind, index = _reg_index(m.group(3))
            if kind == "u":
                ureg = index
            else:
                base, base64 = index, ".64" in m.group(5)
        elif (value := _int_value(term)) is not None:
            offset = value if value < (1 << 63) else value - (1 << 64)
        else:
            return ("?", inner)
    return ("m", base, base64, ureg, offset)


def decode_operand(text: str) -> tuple:
    text = text.strip()
    if m := _REG.match(text):
        kind, index = _reg_index(m.group(3))
        mods = tuple(x for x in m.group(5).split(".") if x and x != "reuse")
        return (kind, index, m.group(1) == "-", m.group(1) in ("~", "!"), bool(m.group(2)), mods)
    if m := _PRED.match(text):
        index = PT if m.group(3) == "T" else int(m.group(3))
        return ("up" if m.group(2) == "UP" else "p", index, m.group(1) == "!")
    if (value := _int_value(text)) is not None:
        return ("i", value & _MASK)
    if _FLOAT.match(text):
        return ("f", _float_immediate(text))
    if m := _CONST.match(text):
        inner = m.group(4).replace(" ", "")
        reg, offset = None, 0
        for term in inner.split("+"):
            if rm := _REG.match(term):
                kind, index = _reg_index(rm.group(3))
                reg = (kind, index)
            elif (value := _int_value(term)) is not None:
                offset = value
            else:
                return ("?", text)
        return ("c", int(m.group(3), 16), reg, offset, m.group(1) == "-", m.group(1) == "~", bool(m.group(2)))
    if m := _MEM.match(text):
        address = _address(m.group(2))
        return address
    if m := _SPECIAL.match(text):
        return ("s", m.group(1))
    if m := _BARRIER.match(text):
        return ("b", int(m.group(1)))
    return ("?", text)


def _split_operands(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


# ---- instructions --------------------------------------------------------------------------

_WIDTH_BY_MOD = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16, "256": 32}
GLOBAL_MEMORY_OPS = frozenset({"LDG", "STG", "LD", "ST", "ATOMG", "ATOM", "RED", "REDG", "LDGSTS"})
GLOBAL_STORE_OPS = frozenset({"STG", "ST", "ATOMG", "ATOM", "RED", "REDG"})
LOCAL_MEMORY_OPS = frozenset({"LDL", "STL"})
CALL_OPS = frozenset({"CALL"})
BRANCH_OPS = frozenset({"BRA", "JMP", "BRX", "JMX"})


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction as cuobjdump prints it."""
    address: int                 # byte offset in the function
    opcode: str                  # "LDG"
    modifiers: tuple[str, ...]   # ("E", "128")
    operands: tuple[str, ...]    # ("R4", "desc[UR6][R4.64]")
    predicate: str | None = None  # "P0", "!P3", "UP0" or None
    text: str = ""

    @cached_property
    def decoded(self) -> tuple[tuple, ...]:
        return tuple(decode_operand(o) for o in self.operands)

    @cached_property
    def guard(self) -> tuple | None:
        """The guard predicate decoded (None when unpredicated)."""
        return decode_operand(self.predicate) if self.predicate else None

    @property
    def name(self) -> str:
        return ".".join((self.opcode, *self.modifiers))

    @property
    def is_global_access(self) -> bool:
        return self.opcode in GLOBAL_MEMORY_OPS

    @property
    def is_global_store(self) -> bool:
        return self.opcode in GLOBAL_STORE_OPS

    @property
    def is_local_access(self) -> bool:
        return self.opcode in LOCAL_MEMORY_OPS

    @property
    def is_call(self) -> bool:
        return self.opcode in CALL_OPS

    @property
    def access_width(self) -> int | None:
        """Bytes per thread of a memory access (4 when no size modifier)."""
        if not (self.is_global_access or self.is_local_access or self.opcode in ("LDS", "STS")):
            return None
        for mod in self.modifiers:
            if mod in _WIDTH_BY_MOD:
                return _WIDTH_BY_MOD[mod]
        return 4

    @cached_property
    def target(self) -> int | str | None:
        """The branch, call or reconvergence target: an address in this
        function, a symbol name (a call to another function), or None."""
        if self.opcode not in BRANCH_OPS | CALL_OPS | {"BSSY", "SSY", "PBK", "PCNT"}:
            return None
        for operand in reversed(self.operands):
            if m := re.search(r"`\(([^)]+)\)", operand):
                return m.group(1)
            if (value := _int_value(operand.split()[-1])) is not None:
                return value
        return None

    @property
    def is_backward_branch(self) -> bool:
        return self.opcode in BRANCH_OPS and isinstance(self.target, int) and self.target <= self.address

    @property
    def is_divergence_test(self) -> bool:
        """``BRA.DIV``: taken only when the warp is not converged here (the
        out-of-line path ptxas emits for a ``.sync`` collective)."""
        return self.opcode == "BRA" and "DIV" in self.modifiers


_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*(?:/\*.*\*/)?\s*$")
_TEXT = re.compile(r"^(?:@(!?U?P(?:T|\d))\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)\s*(.*?)\s*;?$")
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_TARGET = re.compile(r"^\s*\.target\s+(sm_\w+)")


def parse_instruction(address: int, text: str) -> Instruction:
    m = _TEXT.match(text.strip())
    if not m:
        raise SassError(f"cannot parse SASS instruction at {address:#x}: {text!r}")
    predicate, opcode, mods, rest = m.groups()
    modifiers = tuple(x for x in mods.split(".") if x)
    if opcode == "RET" or (opcode in CALL_OPS and "`" not in rest):
        operands = tuple(rest.replace(",", " ").split())  # "RET.REL.NODEC R28 0x0"
    else:
        operands = tuple(_split_operands(rest))
    return Instruction(address, opcode, modifiers, operands, predicate, text.strip())


# ---- functions -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Loop:
    head: int    # address of the first instruction of the loop (the backward branch's target)
    latch: int   # address of the backward branch

    def contains(self, address: int) -> bool:
        return self.head <= address <= self.latch

    @property
    def span(self) -> int:
        return self.latch - self.head


@dataclass
class SassFunction:
    """One function of a cubin (a kernel, with the subroutines ptxas placed in it)."""
    name: str
    arch: str
    instructions: list[Instruction]
    by_address: dict[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.by_address = {ins.address: i for i, ins in enumerate(self.instructions)}

    def at(self, address: int) -> Instruction:
        return self.instructions[self.by_address[address]]

    def index(self, address: int) -> int:
        try:
            return self.by_address[address]
        except KeyError:
            raise SassError(f"{self.name}: no instruction at {address:#x}") from None

    # -- control structure --
    def _reachable(self, starts, jump_calls: frozenset = frozenset(), converged: bool = False) -> set[int]:
        """Addresses reachable from ``starts`` following branches; a CALL falls
        through, and also jumps when its target is in ``jump_calls``;
        ``converged``: a ``BRA.DIV`` is not followed (the warp is converged)."""
        seen: set[int] = set()
        work = [a for a in starts if a in self.by_address]
        while work:
            address = work.pop()
            if address in seen:
                continue
            seen.add(address)
            i = self.by_address[address]
            ins = self.instructions[i]
            unconditional = ins.predicate is None or ins.predicate == "PT"
            if (ins.opcode in BRANCH_OPS or (ins.is_call and ins.target in jump_calls)) \
                    and isinstance(ins.target, int) and not (converged and ins.is_divergence_test):
                work.append(ins.target)
                if ins.opcode in BRANCH_OPS and unconditional and len(ins.operands) == 1:
                    continue
            if ins.opcode in ("EXIT", "RET", "BRX", "JMX", "KILL") and unconditional:
                continue
            if i + 1 < len(self.instructions):
                work.append(self.instructions[i + 1].address)
        return seen

    @cached_property
    def subroutine_entries(self) -> frozenset[int]:
        """Targets of the CALLs that call a subroutine (code that RETurns).
        ptxas also writes a loop's exit as ``@P CALL.REL.NOINC <after the
        loop>`` on sm_80 (a jump that leaves the loop's convergence region):
        those CALLs are jumps, not calls."""
        targets = {i.target for i in self.instructions if i.is_call and isinstance(i.target, int)}
        return frozenset(t for t in targets
                         if any(self.instructions[self.by_address[a]].opcode == "RET" for a in self._reachable([t])))

    @cached_property
    def _loop_exit_calls(self) -> frozenset[int]:
        return frozenset(i.target for i in self.instructions
                         if i.is_call and isinstance(i.target, int) and i.target not in self.subroutine_entries)

    @cached_property
    def main_body(self) -> frozenset[int]:
        """Addresses reachable from the entry without entering a subroutine
        (those ptxas appends after the kernel's EXIT are not in it)."""
        return frozenset(self._reachable([0], self._loop_exit_calls))

    @cached_property
    def converged_body(self) -> frozenset[int]:
        """``main_body`` as a converged warp runs it: without the code reached
        only through ``BRA.DIV``, the out-of-line path of a warp that is not
        converged at a ``.sync`` collective (on sm_80 ptxas calls a
        WARPSYNC + SHFL subroutine there, and jumps back into the loop)."""
        return frozenset(self._reachable([0], self._loop_exit_calls, converged=True))

    @cached_property
    def subroutines(self) -> frozenset[int]:
        """Addresses reachable only through CALLs."""
        return frozenset(self._reachable(list(self.subroutine_entries))) - self.main_body

    def is_subroutine_call(self, ins: Instruction) -> bool:
        return ins.is_call and (isinstance(ins.target, str) or ins.target in self.subroutine_entries)

    @cached_property
    def loops(self) -> list[Loop]:
        """One loop per backward branch of the kernel's own code as a converged
        warp runs it, outermost first (a divergence path's jump back is no loop)."""
        found = {Loop(ins.target, ins.address) for ins in self.instructions
                 if ins.is_backward_branch and ins.address in self.converged_body}
        return sorted(found, key=lambda loop: (-loop.span, loop.head))

    @cached_property
    def hot_loops(self) -> list[Loop]:
        """The loops the kernel's elements are processed in: in each loop nest
        (an outermost loop and the loops inside it) that stores to global
        memory, the innermost loop holding every store of the nest (the body
        of a grid-stride loop; nests: ptxas may version a loop, e.g. on
        ``h != nullptr``, into copies)."""
        stores = [ins.address for ins in self.instructions if ins.is_global_store and ins.address in self.main_body]
        outermost = [loop for loop in self.loops
                     if not any(other != loop and other.head <= loop.head and loop.latch <= other.latch
                                for other in self.loops)]
        found = []
        for nest in outermost:
            mine = [a for a in stores if nest.contains(a)]
            if not mine:
                continue
            holding = [loop for loop in self.loops
                       if nest.head <= loop.head and loop.latch <= nest.latch and all(loop.contains(a) for a in mine)]
            found.append(min(holding, key=lambda loop: loop.span))
        return sorted(found, key=lambda loop: loop.head)

    def in_loops(self, loops: list[Loop]) -> list[Instruction]:
        return [ins for ins in self.instructions if any(loop.contains(ins.address) for loop in loops)]

    # -- what the checks read --
    @property
    def local_accesses(self) -> list[Instruction]:
        return [ins for ins in self.instructions if ins.is_local_access]

    @property
    def global_accesses(self) -> list[Instruction]:
        return [ins for ins in self.instructions if ins.is_global_access]

    @property
    def calls(self) -> list[Instruction]:
        """The CALLs of subroutines (not the CALLs ptxas uses as loop exits)."""
        return [ins for ins in self.instructions if self.is_subroutine_call(ins)]

    @property
    def hot_loop_calls(self) -> list[Instruction]:
        """Subroutine CALLs a converged warp makes in the hot loop."""
        return [ins for ins in self.in_loops(self.hot_loops)
                if self.is_subroutine_call(ins) and ins.address in self.converged_body]

    @property
    def hot_loop_accesses(self) -> list[Instruction]:
        return [ins for ins in self.in_loops(self.hot_loops) if ins.is_global_access]


def parse_sass(text: str) -> dict[str, SassFunction]:
    """Every function in ``cuobjdump -sass`` output, by name."""
    functions: dict[str, SassFunction] = {}
    name, arch, body = None, "", []

    def close():
        if name is not None:
            functions[name] = SassFunction(name, arch, body)

    for line in text.splitlines():
        if m := _TARGET.match(line):
            arch = m.group(1)
        elif m := _FUNCTION.match(line):
            close()
            name, body = m.group(1), []
        elif name is not None and (m := _LINE.match(line)):
            body.append(parse_instruction(int(m.group(1), 16), m.group(2)))
    close()
    return functions


# ---- running cuobjdump ---------------------------------------------------------------------

def _cuobjdump(cubin: bytes, *flags: str) -> str:
    tool = cuda_tool("cuobjdump")
    if tool is None:
        raise SassError("cuobjdump not found: pip install nvidia-cuda-cuobjdump (the test extra has it)")
    env = dict(os.environ)
    if "-sass" in flags:
        # cuobjdump -sass runs nvdisasm, found only on PATH or NVDISASM_PATH: hand it the wheel's.
        disassembler = cuda_tool("nvdisasm")
        if disassembler is None:
            raise SassError("nvdisasm not found (cuobjdump -sass runs it): "
                            "pip install nvidia-cuda-nvdisasm (the test extra has it)")
        env["PATH"] = os.pathsep.join([str(disassembler.parent), env.get("PATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "module.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([str(tool), *flags, str(path)], capture_output=True, text=True, env=env)
    if proc.returncode != 0 or ("Function" not in proc.stdout and "Function" not in proc.stderr
                                and ".nv.info" not in proc.stdout):
        raise SassError(f"cuobjdump {' '.join(flags)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def disassemble(cubin: bytes) -> dict[str, SassFunction]:
    """Every function of a cubin, parsed from ``cuobjdump -sass``."""
    return parse_sass(_cuobjdump(cubin, "-sass"))


@dataclass(frozen=True)
class ParamLayout:
    """Where a kernel's parameters sit in constant bank 0 (from the cubin's
    EIATTR_PARAM_CBANK and EIATTR_KPARAM_INFO)."""
    base: int
    size: int
    params: tuple[tuple[int, int], ...]  # (offset from base, size) in ordinal order


_INFO = re.compile(r"^\.nv\.info\.(\S+)")
_CBANK = re.compile(r"Value:\s+0x[0-9a-f]+\s+0x([0-9a-f]+)")
_KPARAM = re.compile(r"Ordinal\s*:\s*0x([0-9a-f]+)\s+Offset\s*:\s*0x([0-9a-f]+)\s+Size\s*:\s*0x([0-9a-f]+)")


def parse_param_layouts(elf_text: str) -> dict[str, ParamLayout]:
    layouts: dict[str, ParamLayout] = {}
    name, attribute, cbank, params = None, "", None, {}

    def close():
        if name is not None and cbank is not None:
            layouts[name] = ParamLayout(cbank & 0xFFFF, cbank >> 16,
                                        tuple(params[k] for k in sorted(params)))

    for line in elf_text.splitlines():
        if m := _INFO.match(line):
            close()
            name, cbank, params = m.group(1), None, {}
        elif line.startswith(".") and not line.startswith(".nv.info."):
            close()
            name = None
        elif name is not None:
            if "Attribute:" in line:
                attribute = line.split("Attribute:")[1].strip()
            elif attribute == "EIATTR_PARAM_CBANK" and (m := _CBANK.search(line)):
                cbank = int(m.group(1), 16)
            elif attribute == "EIATTR_KPARAM_INFO" and (m := _KPARAM.search(line)):
                params[int(m.group(1), 16)] = (int(m.group(2), 16), int(m.group(3), 16))
    close()
    return layouts


def param_layouts(cubin: bytes) -> dict[str, ParamLayout]:
    """Every kernel's parameter layout, from ``cuobjdump -elf``."""
    return parse_param_layouts(_cuobjdump(cubin, "-elf"))
