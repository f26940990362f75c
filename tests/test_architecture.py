"""The package's layers: every import inside ``swiglu_cupy`` (module level or
inside a function) points down or sideways within its own subpackage, and no
chain of imports comes back to where it started.

    leaves (activations, reference, _validation, _torch_compat, ...)
      -> kernels -> primitives -> dense | moe -> integrations -> tools -> the package face

Each layer holds only its own knowledge: private torch APIs only in the two
compat modules, no other engine named below the integrations, and no module
replacing itself in ``sys.modules`` (a public path re-exports its target).
"""
import ast
import re
from pathlib import Path

import pytest

import swiglu_cupy

PACKAGE = Path(swiglu_cupy.__file__).resolve().parent
LEAVES = {"_version", "_dtypes", "activations", "reference", "_validation", "_torch_compat",
          "_distributed_compat", "_autograd", "_tile_size"}
SUBPACKAGE_RANK = {"kernels": 1, "primitives": 2, "dense": 3, "moe": 3, "integrations": 4, "tools": 5}
FACE_RANK = 6  # __init__, __main__, subcommands, the public re-export paths (hf, hf_experts, xformers, parallel, ops)


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _rank(name: str) -> int:
    top = name.split(".")[0]
    if name in LEAVES:
        return 0
    return SUBPACKAGE_RANK.get(top, FACE_RANK)


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports (as dotted names below swiglu_cupy; "" is the package itself)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if name else []
    package = here if is_package else here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name.split(".")[0] == "swiglu_cupy"]
            out |= {t.split(".", 1)[1] if "." in t else "" for t in targets}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "swiglu_cupy":
                mod = node.module.split(".", 1)[1] if "." in node.module else ""
            else:
                continue
            subs = [f"{mod}.{a.name}" if mod else a.name for a in node.names]
            modules = [s for s in subs if s in MODULES]
            out |= set(modules) if modules else {mod}
    out.discard(name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_walk_sees_every_subpackage():
    assert {n.split(".")[0] for n in MODULES if "." in n} == set(SUBPACKAGE_RANK)
    assert LEAVES <= set(MODULES)
    assert "dense.functions" in GRAPH["dense.api"], "the import parser lost the relative imports"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    upward = []
    for target in sorted(GRAPH[name]):
        if target == "" and name:
            upward.append(f"{target or 'swiglu_cupy'} (the package face)")
            continue
        top = name.split(".")[0]
        same_subpackage = top in SUBPACKAGE_RANK and top == target.split(".")[0]
        if same_subpackage or _rank(target) < _rank(name):
            continue
        if _rank(target) == _rank(name) == 0 or _rank(name) == FACE_RANK:
            continue  # leaves import leaves (no cycle: below); the face imports anything
        upward.append(target)
    assert not upward, f"swiglu_cupy.{name} imports upward or sideways: {upward}"


def test_no_import_cycles():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH.get(node, ())):
            if nxt not in MODULES:
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(c or "swiglu_cupy" for c in cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name)


def test_a_planted_cycle_and_upward_import_are_caught(tmp_path, monkeypatch):
    """The checks above are not vacuous: a leaf importing the dense API is an
    upward import, and two leaves importing each other are a cycle."""
    leaf = tmp_path / "activations.py"
    leaf.write_text("from .dense.api import swiglu\nfrom .reference import glu_reference\n")
    assert {"dense.api", "reference"} <= _imports("activations", leaf)
    monkeypatch.setitem(GRAPH, "activations", _imports("activations", leaf))
    with pytest.raises(AssertionError, match="upward"):
        test_imports_point_down("activations")
    monkeypatch.setitem(GRAPH, "reference", GRAPH["reference"] | {"activations"})
    with pytest.raises(AssertionError, match="cycle"):
        test_no_import_cycles()


# ---- private torch APIs live in the two compat modules only -----------------------------

_COMPAT = {"_torch_compat.py", "_distributed_compat.py"}
_TORCH_ROOTS = {"torch", "nn", "F", "dist"}


def _private_torch_uses(source: str) -> list[str]:
    """``torch._x`` / ``nn.modules.x._Y`` attribute chains and ``from torch._x``
    / ``from torch.a._b`` imports in ``source`` (dunders are not private)."""
    found, inner = [], set()
    for node in ast.walk(ast.parse(source)):  # outer attributes come before the chains inside them
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain, n = [], node
            while isinstance(n, ast.Attribute):
                chain.append(n.attr)
                n = n.value
            if isinstance(n, ast.Name) and n.id in _TORCH_ROOTS and any(
                    c.startswith("_") and not c.startswith("__") for c in chain):
                found.append(".".join([n.id, *reversed(chain)]))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch" \
                and any(p.startswith("_") for p in node.module.split(".")):
            found.append(f"from {node.module}")
    return found


def test_private_torch_apis_only_in_the_compat_modules():
    offenders = {str(p.relative_to(PACKAGE)): uses for p in sorted(PACKAGE.rglob("*.py")) if p.name not in _COMPAT
                 and (uses := _private_torch_uses(p.read_text()))}
    assert not offenders, offenders


def test_the_private_api_scan_is_not_vacuous():
    assert _private_torch_uses("import torch\nx = torch._C._nn.silu\n") == ["torch._C._nn.silu"]
    assert _private_torch_uses("from torch.utils._pytree import tree_leaves\n") == ["from torch.utils._pytree"]
    assert _private_torch_uses("from torch import nn\nok = nn.modules.dropout._DropoutNd\n")
    assert _private_torch_uses("import torch\ny = torch.nn.functional.silu\nz = t.__class__\n") == []


# ---- no module replaces another in sys.modules ------------------------------------------

_SYS_MODULES_MUTATORS = {"update", "setdefault", "__setitem__", "__delitem__", "pop", "popitem", "clear"}


def _sys_modules_writes(source: str) -> list[str]:
    """Each place ``source`` writes into ``sys.modules`` (an item assigned or
    deleted, the name rebound, or a mutating method called), as ``line N``.
    Reads (``sys.modules.get``, ``in sys.modules``) are fine."""
    tree = ast.parse(source)
    sys_names = {"sys"} | {a.asname for n in ast.walk(tree) if isinstance(n, ast.Import)
                           for a in n.names if a.name == "sys" and a.asname}
    bare_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "sys"
                  for a in n.names if a.name == "modules"}  # from sys import modules

    def is_sys_modules(node) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "modules" and isinstance(node.value, ast.Name) and node.value.id in sys_names
        return isinstance(node, ast.Name) and node.id in bare_names

    def flat(targets):
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)):
                yield from flat(t.elts)
            else:
                yield t.value if isinstance(t, ast.Starred) else t

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            targets = []
        if any(is_sys_modules(t.value if isinstance(t, ast.Subscript) else t) for t in flat(targets)):
            found.append(f"line {node.lineno}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in _SYS_MODULES_MUTATORS and is_sys_modules(node.func.value)):
            found.append(f"line {node.lineno}")
    return found


def test_no_module_writes_into_sys_modules():
    """A public path is a plain module that re-exports its target's ``__all__``:
    none replaces itself (or anything else) in ``sys.modules``."""
    offenders = {f"swiglu_cupy/{p.relative_to(PACKAGE)}": lines for p in sorted(MODULES.values())
                 if (lines := _sys_modules_writes(p.read_text()))}
    assert not offenders, offenders


def test_the_sys_modules_scan_is_not_vacuous():
    assert _sys_modules_writes("import sys\nfrom .integrations import hf as _m\nsys.modules[__name__] = _m\n") \
        == ["line 3"]
    assert _sys_modules_writes("import sys as _s\n_s.modules.update(hf=None)\n") == ["line 2"]
    assert _sys_modules_writes("from sys import modules\na, modules['x'] = 1, 2\ndel modules['x']\n") \
        == ["line 2", "line 3"]
    assert _sys_modules_writes("import sys\nm = sys.modules.get('x')\nok = 'deepspeed' in sys.modules\n"
                               "y = sys.modules[__name__]\n") == []


# ---- engine knowledge lives in the integrations -----------------------------------------

# The non-torch training engines whose internals an integration reads (DeepSpeed
# ZeRO-3, megatron-core, OLMo-core), in code, strings and comments alike.
_ENGINE_NAMES = re.compile(r"deep[-_ ]?speed|megatron|olmo[-_ ]?core"
                           r"|(?<![a-z0-9])zero[-_]?3(?![0-9])|(?<![a-z0-9])z3_", re.IGNORECASE)


def _engine_mentions(source: str) -> list[str]:
    """The lines of ``source`` that name a non-torch training engine, as ``N: text``."""
    return [f"{n}: {line.strip()}" for n, line in enumerate(source.splitlines(), 1) if _ENGINE_NAMES.search(line)]


def test_no_engine_knowledge_below_the_integrations():
    """The leaves (``_distributed_compat`` holds torch's private APIs only),
    kernels, primitives, dense and moe name no other engine: what the package
    knows of DeepSpeed, megatron-core or OLMo-core is in that engine's
    module under ``integrations/``."""
    below = {name: path for name, path in MODULES.items() if _rank(name) < SUBPACKAGE_RANK["integrations"]}
    assert LEAVES <= set(below) and "primitives.ops" in below and "moe.grouped" in below
    offenders = {f"swiglu_cupy/{p.relative_to(PACKAGE)}": lines for _, p in sorted(below.items())
                 if (lines := _engine_mentions(p.read_text()))}
    assert not offenders, offenders


def test_the_engine_scan_is_not_vacuous():
    assert _engine_mentions("import torch\n# gathered by ZeRO-3's hooks\nx = 1\n") == [
        "2: # gathered by ZeRO-3's hooks"]
    assert len(_engine_mentions("import sys\nok = 'deepspeed' in sys.modules\n")) == 1
    assert len(_engine_mentions("def zero3_param(t):\n    return hasattr(t, 'ds_id')\n")) == 1
    assert len(_engine_mentions("def leaf(m):\n    return bool(m._z3_leaf)\n")) == 1
    assert len(_engine_mentions("from megatron.core import mpu\n")) == 1
    assert len(_engine_mentions("import olmo_core\n")) == 1
    assert _engine_mentions("import torch\ny = torch.zeros(3)\nnonzero = 3\nz = torch.zeros_like(y)\n") == []
