"""A walk of one thread's path through a kernel's SASS, for a concrete launch.

The walk is how the issue model counts instructions: it starts at the
kernel's first instruction with the launch's kernel arguments in constant
bank 0, the thread's and block's indices in the special registers, and
follows the code, evaluating the integer part of the machine state (the
index arithmetic, the bounds tests, the loop counters) exactly. So a loop
runs as many times as it does on the GPU for that thread, and a bounds test
goes the way it goes for that thread. Data from memory is unknown; a branch
that depends on it (a math routine's fast-path test, a NaN test) follows a
fixed policy, spelled out in :func:`_policy`. Every instruction on the path
counts once, predicated or not (a predicated-off instruction still issues).

What it does not model: latency, dual issue, the warp's other lanes taking
another path (the walk is one lane of a converged warp), caches.
"""
from __future__ import annotations

import math
import struct
from collections import Counter
from dataclasses import dataclass, field

from .sass import PT, RZ, URZ, Instruction, SassError, SassFunction

M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1


class WalkError(SassError):
    pass


@dataclass(frozen=True)
class Thread:
    """Which thread the walk follows, in which launch."""
    block_dim: tuple[int, int, int]
    grid_dim: tuple[int, int, int]
    thread_idx: tuple[int, int, int]
    block_idx: tuple[int, int, int]

    @property
    def lane(self) -> int:
        bx, by, _ = self.block_dim
        tx, ty, tz = self.thread_idx
        return (tx + bx * (ty + by * tz)) % 32


@dataclass(frozen=True)
class Access:
    """One executed memory instruction of the walk."""
    pc: int                 # its address in the function
    opcode: str             # "LDG.E.128"
    width: int              # bytes per thread
    address: int | None     # the thread's byte address (None: not known to the walk)


@dataclass
class Trace:
    """What one thread's walk executed."""
    counts: Counter = field(default_factory=Counter)     # address -> times executed (kernel's own code)
    opcodes: Counter = field(default_factory=Counter)    # opcode -> times executed
    accesses: list[Access] = field(default_factory=list)  # global memory instructions, in order
    policy_branches: Counter = field(default_factory=Counter)  # address -> times the policy chose
    unmodelled: Counter = field(default_factory=Counter)  # opcodes whose result the walk does not compute
    calls: int = 0
    path: list | None = None    # (function, address) of every step, when asked for

    @property
    def instructions(self) -> int:
        return sum(self.opcodes.values())

    def count(self, *opcodes: str) -> int:
        return sum(n for op, n in self.opcodes.items() if op in opcodes)


# Where the driver puts blockDim (ntid) and gridDim (nctaid) in constant bank 0,
# and the initial stack pointer, by SASS generation (read off cuobjdump of
# NVRTC 13 cubins: sm_80 and sm_90 at the start of the bank; sm_100 in front
# of the parameters at 0x380). Unknown archs leave them unknown.
_DRIVER_CONSTANTS = {8: (0x0, 0xC, 0x28), 9: (0x0, 0xC, 0x28), 10: (0x360, 0x370, 0x37C),
                     12: (0x360, 0x370, 0x37C)}


def arch_major(arch: str) -> int:
    digits = "".join(ch for ch in arch.split("_")[1] if ch.isdigit())
    return int(digits[:-1]) if digits else 0


def constant_bank(arch: str, thread: Thread, param_base: int, params: bytes) -> dict[int, int]:
    """Constant bank 0 as 32-bit words: the driver's launch constants and the
    kernel arguments (``params``: the argument bytes, laid out by the cubin)."""
    bank: dict[int, int] = {}
    layout = _DRIVER_CONSTANTS.get(arch_major(arch))
    if layout is not None:
        ntid, nctaid, stack = layout
        for i in range(3):
            bank[ntid + 4 * i] = thread.block_dim[i]
            bank[nctaid + 4 * i] = thread.grid_dim[i]
        bank[stack] = 0x00FFFFF0
    padded = params + bytes(-len(params) % 4)
    for i in range(0, len(padded), 4):
        bank[param_base + i] = int.from_bytes(padded[i:i + 4], "little")
    return bank


# ---- float helpers (known values only: data from memory stays unknown) ---------------------

def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & M32))[0]


def _bits(value: float) -> int:
    try:
        return struct.unpack("<I", struct.pack("<f", value))[0]
    except OverflowError:
        return struct.unpack("<I", struct.pack("<f", math.copysign(math.inf, value)))[0]


def _half_bits(value: float) -> int:
    return struct.unpack("<H", struct.pack("<e", value))[0]


def _signed(value: int, bits: int = 32) -> int:
    return value - (1 << bits) if value >> (bits - 1) else value


class _Machine:
    def __init__(self, fn: SassFunction, functions: dict[str, SassFunction], bank: dict[int, int],
                 thread: Thread, trace: Trace):
        self.fn, self.functions, self.bank, self.thread, self.trace = fn, functions, bank, thread, trace
        self.r: list[int | None] = [None] * 256
        self.u: list[int | None] = [None] * 256
        self.p: list[bool | None] = [None] * 8
        self.up: list[bool | None] = [None] * 8
        self.r[RZ], self.u[URZ], self.p[PT], self.up[PT] = 0, 0, True, True
        self.log: list | None = None  # while an instruction's guard is unknown: (file, index, old value)

    # -- reading operands --
    def reg(self, op: tuple) -> int | None:
        kind, index = op[0], op[1]
        return (self.r if kind == "r" else self.u)[index]

    def pair(self, op: tuple) -> int | None:
        """A 64-bit register pair (RZ: 0)."""
        kind, index = op[0], op[1]
        file = self.r if kind == "r" else self.u
        if index == (RZ if kind == "r" else URZ):
            return 0
        lo, hi = file[index], file[index + 1] if index + 1 < len(file) else None
        return None if lo is None or hi is None else lo | hi << 32

    def const(self, op: tuple, words: int = 1) -> int | None:
        _, bank, reg, offset, *_ = op
        if bank != 0:
            return None
        if reg is not None:
            base = self.reg((reg[0], reg[1]))
            if base is None:
                return None
            offset += base
        value = 0
        for i in range(words):
            word = self.bank.get((offset + 4 * i) & M32)
            if word is None:
                return None
            value |= word << (32 * i)
        return value

    def raw(self, op: tuple) -> int | None:
        """The operand's 32-bit value, before its negation/inversion."""
        kind = op[0]
        if kind in ("r", "u"):
            return self.reg(op)
        if kind == "i":
            return op[1]
        if kind == "c":
            return self.const(op)
        if kind == "f":
            return _bits(op[1])
        if kind == "s":
            return self.special(op[1])
        return None

    def val(self, op: tuple) -> int | None:
        """An integer operand's value with '-' as two's complement and '~' as NOT."""
        v = self.raw(op)
        if v is None:
            return None
        if op[0] in ("r", "u", "c"):
            neg, inv = (op[2], op[3]) if op[0] != "c" else (op[4], op[5])
            if neg:
                v = -v & M32
            elif inv:
                v = ~v & M32
        return v

    def addend(self, op: tuple, extended: bool) -> tuple[int | None, int]:
        """(value, +1) of an adder input: a negated register adds NOT x, plus
        one in the plain form (the extended form gets it from the carry)."""
        v = self.raw(op)
        if v is None:
            return None, 0
        if op[0] in ("r", "u", "c"):
            neg, inv = (op[2], op[3]) if op[0] != "c" else (op[4], op[5])
            if neg or inv:
                return ~v & M32, (0 if extended or inv else 1)
        return v, 0

    def pred(self, op: tuple) -> bool | None:
        kind, index, negated = op
        value = (self.p if kind == "p" else self.up)[index]
        return None if value is None else value != negated

    def special(self, name: str) -> int | None:
        t = self.thread
        table = {"SR_TID.X": t.thread_idx[0], "SR_TID.Y": t.thread_idx[1], "SR_TID.Z": t.thread_idx[2],
                 "SR_CTAID.X": t.block_idx[0], "SR_CTAID.Y": t.block_idx[1], "SR_CTAID.Z": t.block_idx[2],
                 "SR_LANEID": t.lane, "SRZ": 0}
        return table.get(name)

    # -- writing --
    def set(self, op: tuple, value: int | None, words: int = 1) -> None:
        kind, index = op[0], op[1]
        if kind not in ("r", "u"):
            if kind in ("p", "up"):
                self.setp(op, None if value is None else bool(value))
            return
        file, zero = (self.r, RZ) if kind == "r" else (self.u, URZ)
        if index == zero:
            return
        for i in range(words):
            if index + i < len(file) and index + i != zero:
                if self.log is not None:
                    self.log.append((file, index + i, file[index + i]))
                file[index + i] = None if value is None else (value >> (32 * i)) & M32

    def setp(self, op: tuple, value: bool | None) -> None:
        kind, index = op[0], op[1]
        if kind not in ("p", "up") or index == PT:
            return
        file = self.p if kind == "p" else self.up
        if self.log is not None:
            self.log.append((file, index, file[index]))
        file[index] = value


def _words(ins: Instruction) -> int:
    for mod in ins.modifiers:
        if mod == "64" or mod == "WIDE":
            return 2
        if mod == "128":
            return 4
    return 1


def _lut(lut: int, a: int, b: int, c: int) -> int:
    result = 0
    for i in range(8):
        if lut >> i & 1:
            result |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return result & M32


def _plut(lut: int, a: bool | None, b: bool | None, c: bool | None) -> bool | None:
    options = {bool(_lut(lut, int(x) * M32, int(y) * M32, int(z) * M32) & 1)
               for x in ((a,) if a is not None else (False, True))
               for y in ((b,) if b is not None else (False, True))
               for z in ((c,) if c is not None else (False, True))}
    return options.pop() if len(options) == 1 else None


def _compare(cmp: str, a: int, b: int) -> bool:
    return {"EQ": a == b, "NE": a != b, "LT": a < b, "LE": a <= b, "GT": a > b, "GE": a >= b}[cmp]


def _combine(op: str, x: bool | None, y: bool | None) -> bool | None:
    if op == "AND":
        if x is False or y is False:
            return False
        return None if x is None or y is None else True
    if op == "OR":
        if x is True or y is True:
            return True
        return None if x is None or y is None else False
    return None if x is None or y is None else x != y


# ---- instruction semantics: each returns nothing; unknown inputs give unknown outputs ------

def _mov(m: _Machine, ins: Instruction):
    d, a = ins.decoded[0], ins.decoded[1]
    m.set(d, m.val(a))


def _imad(m: _Machine, ins: Instruction):
    ops = ins.decoded
    mods = set(ins.modifiers)
    d, k = ops[0], 1
    carry_out = None
    if ops[1][0] in ("p", "up"):
        carry_out, k = ops[1], 2
    a, b, c = ops[k], ops[k + 1], ops[k + 2]
    tail = ops[k + 3:]
    signed = "U32" not in mods
    va, vb = m.val(a), m.val(b)
    if "WIDE" in mods:
        vc = m.pair(c) if c[0] in ("r", "u") else m.val(c)
        if None in (va, vb, vc):
            return m.set(d, None, 2)
        pa, pb = (_signed(va), _signed(vb)) if signed else (va, vb)
        return m.set(d, (pa * pb + vc) & M64, 2)
    if "HI" in mods:
        # The high word of a * b + c, c a 64-bit pair: the carry of a
        # 64-bit multiply-add's low half (c = x:0), or q + mulhi(q, e) (c = q:0).
        vc = m.pair(c) if c[0] in ("r", "u") else m.val(c)
        if None in (va, vb, vc):
            return m.set(d, None)
        pa, pb = (_signed(va), _signed(vb)) if signed else (va, vb)
        return m.set(d, ((pa * pb + vc) >> 32) & M32)
    vc = m.val(c)
    cin = m.pred(tail[0]) if "X" in mods and tail else False
    if None in (va, vb, vc, cin):
        m.set(d, None)
        if carry_out is not None:
            m.setp(carry_out, None)
        return
    total = va * vb + vc + int(cin)
    m.set(d, total & M32)
    if carry_out is not None:
        m.setp(carry_out, total >> 32 & 1 == 1)


def _iadd3(m: _Machine, ins: Instruction):
    extended = "X" in ins.modifiers
    ops = list(ins.decoded)
    d = ops.pop(0)
    outs = []
    while ops and ops[0][0] in ("p", "up"):
        outs.append(ops.pop(0))
    srcs, ins_preds = ops[:3], ops[3:]
    total = 0
    for s in srcs:
        v, plus = m.addend(s, extended)
        if v is None:
            m.set(d, None)
            for o in outs:
                m.setp(o, None)
            return
        total += v + plus
    for p in ins_preds if extended else ():
        c = m.pred(p)
        if c is None:
            m.set(d, None)
            for o in outs:
                m.setp(o, None)
            return
        total += int(c)
    m.set(d, total & M32)
    carries = total >> 32
    for i, o in enumerate(outs):
        m.setp(o, carries > i)


def _viadd(m: _Machine, ins: Instruction):
    d, a, b = ins.decoded[:3]
    va, vb = m.val(a), m.val(b)
    m.set(d, None if None in (va, vb) else (va + vb) & M32)


def _lea(m: _Machine, ins: Instruction):
    mods = set(ins.modifiers)
    ops = list(ins.decoded)
    d = ops.pop(0)
    carry_out = ops.pop(0) if ops and ops[0][0] in ("p", "up") else None
    cin_op = ops.pop() if ops and ops[-1][0] in ("p", "up") else None
    shift_op = ops.pop()
    a, b = ops[0], ops[1]
    hi_op = ops[2] if len(ops) > 2 else None
    va, vb, shift = m.val(a), m.val(b), m.val(shift_op)
    cin = m.pred(cin_op) if cin_op is not None and "X" in mods else False
    if "HI" in mods:
        if hi_op is not None:
            vh = m.val(hi_op)
        elif "SX32" in mods and va is not None:
            vh = M32 if va >> 31 else 0
        else:
            vh = 0
        if None in (va, vb, vh, shift, cin):
            return m.set(d, None)
        wide = (vh << 32 | va) << (shift & 63)
        total = (wide >> 32 & M32) + vb + int(cin)
    else:
        if None in (va, vb, shift, cin):
            m.set(d, None)
            if carry_out is not None:
                m.setp(carry_out, None)
            return
        total = ((va << (shift & 31)) & M32) + vb + int(cin)
    m.set(d, total & M32)
    if carry_out is not None:
        m.setp(carry_out, total >> 32 & 1 == 1)


def _shf(m: _Machine, ins: Instruction):
    mods = ins.modifiers
    d, a, s, c = ins.decoded[:4]
    lo, shift, hi = m.val(a), m.val(s), m.val(c)
    if None in (lo, shift, hi):
        return m.set(d, None)
    shift = min(shift & 0xFF, 64) if "W" not in mods else shift & 31
    wide = hi << 32 | lo
    if "L" in mods:
        result = (wide << shift) >> (32 if "HI" in mods else 0)
    else:
        if "S32" in mods or "S64" in mods:
            wide = _signed(wide, 64)
        result = wide >> shift
        if "HI" in mods:
            result >>= 32
    m.set(d, result & M32)


def _lop3(m: _Machine, ins: Instruction):
    ops = list(ins.decoded)
    pout = ops.pop(0) if ops[0][0] in ("p", "up") else None
    d = ops.pop(0)
    a, b, c, lut = ops[0], ops[1], ops[2], ops[3]
    va, vb, vc, vl = m.val(a), m.val(b), m.val(c), m.val(lut)
    if None in (va, vb, vc, vl):
        m.set(d, None)
        if pout is not None:
            m.setp(pout, None)
        return
    result = _lut(vl, va, vb, vc)
    m.set(d, result)
    if pout is not None:
        m.setp(pout, result != 0)


def _isetp(m: _Machine, ins: Instruction):
    mods = ins.modifiers
    cmp = mods[0]
    unsigned = "U32" in mods
    logic = next((x for x in mods if x in ("AND", "OR", "XOR")), "AND")
    ops = ins.decoded
    d1, d2, a, b, c = ops[0], ops[1], ops[2], ops[3], ops[4]
    va, vb, vc = m.val(a), m.val(b), m.pred(c)
    result = None
    if va is not None and vb is not None:
        if not unsigned:
            va, vb = _signed(va), _signed(vb)
        if "EX" in mods:
            low = m.pred(ops[5]) if len(ops) > 5 else None
            if va != vb:
                result = _compare(cmp, va, vb)
            elif cmp in ("EQ", "NE"):
                result = None if low is None else (low if cmp == "EQ" else low)
            else:
                result = low
        else:
            result = _compare(cmp, va, vb)
    m.setp(d1, _combine(logic, result, vc))
    m.setp(d2, _combine(logic, None if result is None else not result, vc))


def _plop3(m: _Machine, ins: Instruction):
    ops = ins.decoded
    d1, d2, a, b, c, l1, l2 = ops[:7]
    pa, pb, pc = m.pred(a), m.pred(b), m.pred(c)
    m.setp(d1, _plut(l1[1], pa, pb, pc))
    m.setp(d2, _plut(l2[1], pa, pb, pc))


def _sel(m: _Machine, ins: Instruction):
    d, a, b, p = ins.decoded[:4]
    cond = m.pred(p)
    va, vb = m.val(a), m.val(b)
    if ins.opcode == "FSEL":
        va, vb = m.raw(a), m.raw(b)
        if va is not None and (a[0] in ("r", "u") and (a[4] or a[2])):
            va = None  # |x| or -x of a float: not followed
        if vb is not None and (b[0] in ("r", "u") and (b[4] or b[2])):
            vb = None
    if cond is None:
        return m.set(d, va if va == vb else None)
    m.set(d, va if cond else vb)


def _imnmx(m: _Machine, ins: Instruction):
    d, a, b, p = ins.decoded[:4]
    va, vb, take_min = m.val(a), m.val(b), m.pred(p)
    if None in (va, vb, take_min):
        return m.set(d, None)
    if "U32" not in ins.modifiers:
        sa, sb = _signed(va), _signed(vb)
        pick = min(sa, sb) if take_min else max(sa, sb)
        return m.set(d, pick & M32)
    m.set(d, min(va, vb) if take_min else max(va, vb))


def _ldc(m: _Machine, ins: Instruction):
    d, a = ins.decoded[0], ins.decoded[1]
    words = _words(ins)
    m.set(d, m.const(a, words) if a[0] == "c" else m.val(a), words)


def _s2r(m: _Machine, ins: Instruction):
    d, a = ins.decoded[0], ins.decoded[1]
    m.set(d, m.special(a[1]) if a[0] == "s" else None)


def _cs2r(m: _Machine, ins: Instruction):
    d, a = ins.decoded[0], ins.decoded[1]
    words = 2 if "32" not in ins.modifiers else 1
    m.set(d, 0 if a == ("s", "SRZ") else None, words)


def _r2ur(m: _Machine, ins: Instruction):
    ops = [o for o in ins.decoded if o[0] not in ("p", "up")]
    m.set(ops[0], m.val(ops[1]))


def _hfma2(m: _Machine, ins: Instruction):
    ops = ins.decoded
    d, a, b = ops[0], ops[1], ops[2]
    zero = all(o[0] in ("r", "u") and o[1] in (RZ, URZ) for o in (a, b))
    if not zero:
        return m.set(d, None)
    rest = ops[3:]
    if len(rest) == 2 and all(o[0] in ("f", "i") for o in rest):
        halves = [_half_bits(o[1]) if o[0] == "f" else o[1] & 0xFFFF for o in rest]
        return m.set(d, halves[0] << 16 | halves[1])
    m.set(d, m.val(rest[0]) if len(rest) == 1 else None)


def _prmt(m: _Machine, ins: Instruction):
    d, a, s, b = ins.decoded[:4]
    va, vs, vb = m.val(a), m.val(s), m.val(b)
    if None in (va, vs, vb) or any(x in ins.modifiers for x in ("F4E", "B4E", "RC8", "ECL", "ECR", "RC16")):
        return m.set(d, None)
    source = vb << 32 | va
    result = 0
    for i in range(4):
        nib = vs >> (4 * i) & 0xF
        byte = source >> (8 * (nib & 7)) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        result |= byte << (8 * i)
    m.set(d, result)


def _iabs(m: _Machine, ins: Instruction):
    d, a = ins.decoded[:2]
    v = m.val(a)
    m.set(d, None if v is None else abs(_signed(v)) & M32)


def _popc(m: _Machine, ins: Instruction):
    d, a = ins.decoded[:2]
    v = m.val(a)
    m.set(d, None if v is None else bin(v).count("1"))


def _flo(m: _Machine, ins: Instruction):
    d, a = ins.decoded[:2]
    v = m.val(a)
    if v is None:
        return m.set(d, None)
    if "U32" not in ins.modifiers and v >> 31:
        v = ~v & M32
    m.set(d, M32 if v == 0 else v.bit_length() - 1)


def _sgxt(m: _Machine, ins: Instruction):
    d, a, b = ins.decoded[:3]
    va, vb = m.val(a), m.val(b)
    if None in (va, vb):
        return m.set(d, None)
    bits = min(vb & 0xFF, 32)
    if bits == 0:
        return m.set(d, 0)
    value = va & ((1 << bits) - 1)
    if "U32" not in ins.modifiers and value >> (bits - 1):
        value -= 1 << bits
    m.set(d, value & M32)


def _i2f(m: _Machine, ins: Instruction):
    d, a = ins.decoded[:2]
    v = m.val(a)
    if v is None or "F64" in ins.modifiers or "F16" in ins.modifiers:
        return m.set(d, None, 2 if "F64" in ins.modifiers else 1)
    if "U32" not in ins.modifiers:
        v = _signed(v)
    m.set(d, _bits(float(v)))


def _f2i(m: _Machine, ins: Instruction):
    d, a = ins.decoded[:2]
    v = m.raw(a)
    if v is None or "F64" in ins.modifiers:
        return m.set(d, None)
    x = _f32(v)
    if math.isnan(x):
        return m.set(d, 0)
    x = math.floor(x) if "FLOOR" in ins.modifiers else math.ceil(x) if "CEIL" in ins.modifiers else math.trunc(x)
    if "U32" in ins.modifiers:
        return m.set(d, min(max(x, 0), M32))
    m.set(d, min(max(x, -(1 << 31)), (1 << 31) - 1) & M32)


def _float_inputs(m: _Machine, ops) -> list[float] | None:
    values = []
    for o in ops:
        v = m.raw(o)
        if v is None:
            return None
        x = _f32(v)
        if o[0] in ("r", "u", "c"):
            neg, absolute = (o[2], o[4]) if o[0] != "c" else (o[4], o[6])
            x = abs(x) if absolute else x
            x = -x if neg else x
        values.append(x)
    return values


def _fop(m: _Machine, ins: Instruction):
    ops = ins.decoded
    d = ops[0]
    n = {"FADD": 2, "FMUL": 2, "FFMA": 3}[ins.opcode]
    xs = _float_inputs(m, ops[1:1 + n])
    if xs is None or any(mod in ins.modifiers for mod in ("SAT", "RM", "RP", "RZ")):
        return m.set(d, None)
    try:
        if ins.opcode == "FADD":
            r = xs[0] + xs[1]
        elif ins.opcode == "FMUL":
            r = xs[0] * xs[1]
        else:
            r = xs[0] * xs[1] + xs[2]
    except (OverflowError, ValueError):
        return m.set(d, None)
    m.set(d, _bits(r))


def _mufu(m: _Machine, ins: Instruction):
    d, a = ins.decoded[:2]
    xs = _float_inputs(m, [a])
    if xs is None or ins.modifiers[:1] != ("RCP",) or xs[0] == 0:
        return m.set(d, None)
    m.set(d, _bits(1.0 / xs[0]))


def _unknown_dest(m: _Machine, ins: Instruction):
    """An instruction the walk does not evaluate: its destinations become unknown."""
    words = _words(ins)
    for o in ins.decoded[:1]:
        m.set(o, None, words)
    for o in ins.decoded[1:3]:
        if o[0] in ("p", "up") and o[1] != PT and ins.opcode not in ("STG", "ST", "STS", "STL"):
            m.setp(o, None)
    if ins.opcode not in _NO_RESULT and ins.opcode[0] not in "FHD":  # float data is unknown anyway
        m.trace.unmodelled[ins.opcode] += 1


def _load(m: _Machine, ins: Instruction):
    ops = ins.decoded
    dest = next((o for o in ops if o[0] in ("r", "u")), None)
    if dest is not None:
        m.set(dest, None, max(1, (ins.access_width or 4) // 4))


def _fsetp(m: _Machine, ins: Instruction):
    mods = ins.modifiers
    ops = ins.decoded
    d1, d2, a, b, c = ops[:5]
    xs = _float_inputs(m, [a, b])
    logic = next((x for x in mods if x in ("AND", "OR", "XOR")), "AND")
    vc = m.pred(c)
    result = None
    if xs is not None:
        x, y = xs
        cmp = mods[0]
        unordered = cmp.endswith("U") and cmp not in ("NUM", "NAN")
        base = cmp[:-1] if unordered else cmp
        if base in ("EQ", "NE", "LT", "LE", "GT", "GE"):
            result = _compare(base, x, y) if not (math.isnan(x) or math.isnan(y)) else (unordered or base == "NE")
        elif cmp == "NAN":
            result = math.isnan(x) or math.isnan(y)
        elif cmp == "NUM":
            result = not (math.isnan(x) or math.isnan(y))
    m.setp(d1, _combine(logic, result, vc))
    m.setp(d2, _combine(logic, None if result is None else not result, vc))


_NO_RESULT = frozenset({"NOP", "BSSY", "BSYNC", "WARPSYNC", "BMOV", "YIELD", "DEPBAR", "BAR", "MEMBAR",
                        "ERRBAR", "CCTL", "FENCE", "BREAK", "STG", "ST", "STS", "STL", "RED", "REDG",
                        "CCTLL", "NANOSLEEP", "ACQBULK", "PREEXIT", "BPT"})

_SEMANTICS = {
    "MOV": _mov, "UMOV": _mov, "IMAD": _imad, "UIMAD": _imad, "IADD3": _iadd3, "UIADD3": _iadd3,
    "VIADD": _viadd, "UVIADD": _viadd, "IADD": _viadd, "LEA": _lea, "ULEA": _lea, "SHF": _shf, "USHF": _shf,
    "LOP3": _lop3, "ULOP3": _lop3, "ISETP": _isetp, "UISETP": _isetp, "PLOP3": _plop3, "UPLOP3": _plop3,
    "SEL": _sel, "USEL": _sel, "FSEL": _sel, "IMNMX": _imnmx, "VIMNMX": _imnmx, "UIMNMX": _imnmx,
    "LDC": _ldc, "ULDC": _ldc, "LDCU": _ldc, "S2R": _s2r, "S2UR": _s2r, "CS2R": _cs2r, "R2UR": _r2ur,
    "HFMA2": _hfma2, "PRMT": _prmt, "UPRMT": _prmt, "IABS": _iabs, "POPC": _popc, "UPOPC": _popc,
    "FLO": _flo, "UFLO": _flo, "SGXT": _sgxt, "USGXT": _sgxt, "I2F": _i2f, "I2FP": _i2f, "F2I": _f2i,
    "FADD": _fop, "FMUL": _fop, "FFMA": _fop, "MUFU": _mufu, "FSETP": _fsetp,
    "LDG": _load, "LD": _load, "LDS": _load, "LDL": _load, "ATOMG": _load, "ATOM": _load, "LDSM": _load,
}


# ---- control ------------------------------------------------------------------------------

def _straight_run(fn: SassFunction, start: int, stop: int | None = None) -> list[Instruction]:
    """Instructions from ``start`` up to ``stop`` (exclusive), or else to the
    first unconditional jump, exit, return or reconvergence point."""
    out = []
    i = fn.index(start)
    while i < len(fn.instructions):
        ins = fn.instructions[i]
        if stop is not None and ins.address >= stop:
            break
        out.append(ins)
        if stop is None and (ins.opcode in ("EXIT", "RET", "BSYNC") or (ins.opcode == "BRA" and ins.predicate is None)):
            break
        i += 1
    return out


def _policy(fn: SassFunction, ins: Instruction) -> bool:
    """Whether a branch whose condition depends on data is taken.

    - EXIT: not taken (the thread is in bounds).
    - A backward branch: not taken (a loop whose trip count the walk cannot
      know runs once).
    - A forward branch: the side that does not CALL a subroutine (the math
      library's fast path; its slow path handles denormal, huge or special
      operands); when neither or both sides call, not taken (the fall-through
      path, which for an ``if`` executes its body).
    """
    if ins.opcode == "EXIT":
        return False
    target = ins.target
    if not isinstance(target, int) or target <= ins.address:
        return False
    following = fn.index(ins.address) + 1
    if following >= len(fn.instructions):
        return False
    skipped = _straight_run(fn, fn.instructions[following].address, target)
    jumped = _straight_run(fn, target)
    skipped_calls = any(fn.is_subroutine_call(i) for i in skipped)
    jumped_calls = any(fn.is_subroutine_call(i) for i in jumped)
    if skipped_calls and not jumped_calls:
        return True
    return False


MAX_STEPS = 2_000_000
_CONTROL = frozenset({"BRA", "JMP", "EXIT", "CALL", "RET", "BRX", "JMX", "KILL"})


def _plan(fn: SassFunction) -> list[tuple]:
    """Per instruction, what the walk reads at every step (computed once per function)."""
    plan = getattr(fn, "_walk_plan", None)
    if plan is None:
        plan = [(ins, ins.opcode, ins.guard, ins.opcode in _CONTROL, ins.is_global_access,
                 _SEMANTICS.get(ins.opcode, _unknown_dest)) for ins in fn.instructions]
        fn._walk_plan = plan
    return plan


def walk(fn: SassFunction, functions: dict[str, SassFunction], bank: dict[int, int], thread: Thread,
         max_steps: int = MAX_STEPS, record_path: bool = False) -> Trace:
    """Follow one thread from the kernel's first instruction to its EXIT."""
    trace = Trace(path=[] if record_path else None)
    m = _Machine(fn, functions, bank, thread, trace)
    hits: dict[str, list[int]] = {}
    try:
        _run(fn, functions, m, trace, hits, max_steps)
    finally:
        for name, counts in hits.items():
            owner = fn if name == fn.name else functions[name]
            for k, n in enumerate(counts):
                if n:
                    trace.opcodes[owner.instructions[k].opcode] += n
                    if owner is fn:
                        trace.counts[owner.instructions[k].address] = n
    return trace


def _run(fn, functions, m: _Machine, trace: Trace, hits: dict, max_steps: int) -> None:
    current = fn
    plan = _plan(fn)
    counts = hits.setdefault(fn.name, [0] * len(plan))
    i = 0
    stack: list[tuple[SassFunction, int]] = []
    steps = 0
    policy: dict = {}
    path = trace.path
    while True:
        if i >= len(plan):
            raise WalkError(f"{fn.name}: ran past the end of {current.name}")
        ins, opcode, guard, control, global_access, semantics = plan[i]
        counts[i] += 1
        steps += 1
        if steps > max_steps:
            raise WalkError(f"{fn.name}: no EXIT within {max_steps} instructions (a loop the walk cannot end?)")
        if path is not None:
            path.append((current.name, ins.address))
        active = True if guard is None else m.pred(guard)
        if control:
            if opcode == "BRA" and "DIV" in ins.modifiers:
                active = False  # the warp is converged: a divergence test does not branch
            elif opcode == "BRA" and len(ins.decoded) > 1 and ins.decoded[0][0] in ("p", "up") and active is not False:
                active = _combine("AND", active, m.pred(ins.decoded[0]))
            if active is None:
                key = (current.name, ins.address)
                if key not in policy:
                    policy[key] = _policy(current, ins)
                active = policy[key]
                trace.policy_branches[key] += 1
            if not active:
                i += 1
                continue
            if opcode in ("EXIT", "KILL"):
                return
            if opcode in ("BRX", "JMX"):
                raise WalkError(f"{fn.name}: indirect branch at {ins.address:#x} is not modelled")
            if opcode == "RET":
                # RET.REL.NODEC Rn off: back to the address the caller left in Rn
                # (CALL.REL.NOINC keeps no return stack; ours is the fallback).
                back = None
                if ins.decoded and ins.decoded[0][0] in ("r", "u"):
                    value = m.reg(ins.decoded[0])
                    offset = ins.decoded[1][1] if len(ins.decoded) > 1 and ins.decoded[1][0] == "i" else 0
                    back = None if value is None else value + offset
                caller = stack.pop() if stack else None
                if back is not None and current is fn and back in fn.by_address:
                    i = fn.index(back)
                    continue
                if caller is None:
                    raise WalkError(f"{fn.name}: RET with no CALL at {ins.address:#x}")
                current, i = caller
                plan = _plan(current)
                counts = hits.setdefault(current.name, [0] * len(plan))
                continue
            target = ins.target
            if opcode == "CALL":
                if current.is_subroutine_call(ins):
                    trace.calls += 1
                    stack.append((current, i + 1))
                if isinstance(target, str):
                    if target not in functions:
                        raise WalkError(f"{fn.name}: CALL to {target}, not in this cubin")
                    current, i = functions[target], 0
                    plan = _plan(current)
                    counts = hits.setdefault(current.name, [0] * len(plan))
                    continue
            if not isinstance(target, int):
                raise WalkError(f"{fn.name}: branch without a target at {ins.address:#x}: {ins.text}")
            i = current.index(target)
            continue
        if active is False:
            i += 1
            continue
        if global_access:
            address = None
            mem = next((o for o in ins.decoded if o[0] == "m"), None)
            if mem is not None:
                _, base, base64, ureg, offset = mem
                b = m.pair(("r", base)) if base64 else m.r[base]
                uoff = 0 if ureg is None else m.u[ureg]
                if b is not None and uoff is not None:
                    address = (b + uoff + offset) & M64
            trace.accesses.append(Access(ins.address if current is fn else -1, ins.name, ins.access_width, address))
        if active is None:
            # Either outcome: what it writes becomes unknown unless both agree.
            m.log = []
            semantics(m, ins)
            for file, k, old in m.log:
                if file[k] != old:
                    file[k] = None
            m.log = None
        else:
            semantics(m, ins)
        i += 1
