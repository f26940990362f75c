"""Finds the gated-unit classes a library ships, by reading its source (for
tests/test_reach.py): every top-level class with a method (any method, not
only ``forward``) whose syntax tree computes a gated unit by the rule of
``swiglu_cupy.integrations.glu_source.function_computes_glu``, plus, to a
fixed point, every class of the library that subclasses one of them and
keeps its forward (a LoRA or adapter variant; one with a forward of its own
is found by its own source or not at all). Nothing is imported to
find them; :func:`module_classes` imports what was found."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import textwrap

from torch import nn

from swiglu_cupy.integrations.glu_source import function_computes_glu


def _package_root(package: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise ImportError(f"{package} is not installed")
    if spec.origin and spec.origin.endswith("__init__.py"):
        return os.path.dirname(spec.origin)
    return list(spec.submodule_search_locations)[0]


def _base_names(cls: ast.ClassDef) -> set[str]:
    names = set()
    for base in cls.bases:
        if isinstance(base, ast.Name):
            names.add(base.id)
        elif isinstance(base, ast.Attribute):
            names.add(base.attr)
    return names


_CLASS_LINE = re.compile(r"^class (\w+)(?:\(([^)]*)\))?\s*:", re.MULTILINE)
# A cheap filter before parsing a class: it names something activation-like and multiplies (or calls a glu).
_MAY_GATE = re.compile(r"(act|silu|gelu|swish|sigmoid|relu|glu|mish)\w*\s*\(", re.IGNORECASE)


def _class_chunks(text: str):
    """``(name, base simple names, source)`` of each top-level class, split
    at the ``class`` lines (a class body is the text up to the next one)."""
    heads = list(_CLASS_LINE.finditer(text))
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        bases = {b.strip().split(".")[-1].split("[")[0] for b in (head.group(2) or "").split(",") if b.strip()}
        yield head.group(1), bases, text[head.start():end]


def _computes_gated_unit(source: str) -> bool:
    if "*" not in source and "glu" not in source.lower() or not _MAY_GATE.search(source):
        return False
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a chunk cut short (a module-level statement after the class): parse what the class is
        try:
            tree = ast.parse(textwrap.dedent(source.split("\n\n\n")[0]))
        except SyntaxError:
            return False
    cls = tree.body[0] if tree.body and isinstance(tree.body[0], ast.ClassDef) else None
    return cls is not None and any(isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and function_computes_glu(m)
                                   for m in cls.body)


def gated_classes(package: str, file_pattern: str | None = None) -> list[str]:
    """``module.Class`` names of ``package``'s gated-unit classes (files
    whose name matches ``file_pattern``, default all), sorted."""
    root = _package_root(package)
    classes = {}  # dotted name -> (simple name, base simple names, computes a gated unit, defines forward)
    for folder, _, files in os.walk(root):
        for file in files:
            if not file.endswith(".py") or (file_pattern and not re.match(file_pattern, file)):
                continue
            path = os.path.join(folder, file)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except UnicodeDecodeError:
                continue
            module = package + "." + os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            module = module.removesuffix(".__init__")
            for name, bases, source in _class_chunks(text):
                own_forward = re.search(r"^\s+def forward\(", source, re.MULTILINE) is not None
                classes[f"{module}.{name}"] = (name, bases, _computes_gated_unit(source), own_forward)
    found = {name for name, (_, _, gated, _) in classes.items() if gated}
    while True:  # subclasses of found classes that keep their forward, by the simple name of a base
        simple = {classes[name][0] for name in found}
        more = {name for name, (_, bases, _, own_forward) in classes.items()
                if name not in found and bases & simple and not own_forward}
        if not more:
            return sorted(found)
        found |= more


def module_classes(names: list[str]) -> tuple[dict[str, type], dict[str, str]]:
    """The ``nn.Module`` subclasses among ``names`` (imported), and why the
    others were dropped (not a module class, or its module failed to import)."""
    classes, dropped = {}, {}
    for name in names:
        module_name, class_name = name.rsplit(".", 1)
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except Exception as error:  # an optional dependency of that module
            dropped[name] = f"import failed: {type(error).__name__}: {str(error).strip().splitlines()[0][:120]}"
            continue
        if inspect.isclass(cls) and issubclass(cls, nn.Module):
            classes[name] = cls
        else:
            dropped[name] = "not an nn.Module class"
    return classes, dropped
