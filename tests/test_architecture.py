"""The package's layers: every import inside ``swiglu_cupy`` (module level or
inside a function) points down or sideways within its own subpackage, and no
chain of imports comes back to where it started.

    leaves (activations, reference, _validation, _torch_compat, ...)
      -> kernels -> primitives -> dense | moe -> integrations -> tools -> the package face
"""
import ast
from pathlib import Path

import pytest

import swiglu_cupy

PACKAGE = Path(swiglu_cupy.__file__).resolve().parent
LEAVES = {"_version", "_dtypes", "activations", "reference", "_validation", "_torch_compat",
          "_distributed_compat", "_autograd", "_tile_size"}
SUBPACKAGE_RANK = {"kernels": 1, "primitives": 2, "dense": 3, "moe": 3, "integrations": 4, "tools": 5}
FACE_RANK = 6  # __init__, __main__, subcommands and the public re-export paths (hf, hf_experts, xformers, parallel, ops)


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
