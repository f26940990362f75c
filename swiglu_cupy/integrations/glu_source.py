"""Whether a function computes a gated unit, read from its source: the
walk's safety net (issue 39). A feed-forward or experts module whose
structure swiglu_cupy does not recognise, but whose forward multiplies an
activation's output by another tensor, is named in ``report.skipped``
instead of passing unreported (:func:`glu_form_reason`).

The rule, on the function's syntax tree: a product ``a * b`` (or ``a *= b``)
where ``a`` calls an activation (a callee with a word of its name, in
snake_case or CamelCase, such as act, activation, silu, gelu, sigmoid, relu
or glu; or a local assigned from such a call) and ``b`` does not
and is a computed tensor (a call, a name or a subscript; not a constant or
a ``self.`` attribute such as a scale), or a call of ``glu``/``swiglu``.
Code the forward calls elsewhere (helper functions) is not read."""
from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap

from torch import nn

__all__ = ["function_computes_glu", "gated_products", "forward_gated_products", "forward_computes_glu",
           "feed_forward_shaped", "live_gated_products", "glu_form_reason"]

# A word of a callee's name that names an activation: act_fn, hidden_act, act1, activation_fn, F.silu,
# gelu_new, quick_gelu, torch.sigmoid, x.sigmoid(), _relu2, GELUActivation, chunk_and_activate, ... (not extract
# or factor).
_ACTIVATION_WORD = re.compile(r"act|activate|activation|silu|gelu|swish|sigmoid|relu|glu|swiglu|geglu|reglu|hardswish|"
                              r"hardsigmoid|mish")
_GLU_CALLEES = ("glu", "swiglu")


def _callee(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


def _names_activation(callee: str) -> bool:
    # the whole name (SiLU), and its snake_case and CamelCase words, digits dropped
    words = [callee.strip("_0123456789"), *re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+", callee)]
    return any(_ACTIVATION_WORD.fullmatch(word.lower()) for word in words)


def _calls_activation(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and _names_activation(_callee(n.func)) for n in ast.walk(node))


def _computed(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return False
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return False
    return any(isinstance(n, (ast.Call, ast.Name, ast.Subscript)) for n in ast.walk(node))


def _self_attributes(node: ast.AST) -> frozenset[str]:
    return frozenset(n.attr for n in ast.walk(node)
                     if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self")


def gated_products(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[frozenset[str]]:
    """The gated units the rule of this module finds in one function's
    syntax tree, each as the ``self.`` attributes it depends on: those its
    factors read (through the locals they name), and those the ``if``
    statements around it test (a module whose such child is None never
    computes that product: torchtune's ``FeedForward`` without ``w3``,
    OLMo-core's and timm's attention without a gate)."""
    # locals assigned from an expression that calls an activation -> the self. attributes that expression reads
    activated: dict[str, frozenset[str]] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and _calls_activation(node.value):
            for target in node.targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        activated[n.id] = activated.get(n.id, frozenset()) | _self_attributes(node.value)

    def is_activation(e: ast.expr) -> bool:
        return _calls_activation(e) or (isinstance(e, ast.Name) and e.id in activated)

    def reads(e: ast.expr) -> frozenset[str]:
        names = (n.id for n in ast.walk(e) if isinstance(n, ast.Name) and n.id in activated)
        return _self_attributes(e).union(*(activated[n] for n in names))

    products = []

    def visit(node: ast.AST, guards: frozenset[str]) -> None:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            for a, b in ((node.left, node.right), (node.right, node.left)):
                if is_activation(a) and not is_activation(b) and _computed(b):
                    products.append(guards | reads(a) | reads(b))
                    break
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Mult) and isinstance(node.target, ast.Name) \
                and node.target.id in activated and not _calls_activation(node.value) and _computed(node.value):
            products.append(guards | activated[node.target.id] | reads(node.value))
        elif isinstance(node, ast.Call) and _callee(node.func) in _GLU_CALLEES:
            products.append(guards)
        if isinstance(node, ast.If):
            visit(node.test, guards)
            for child in node.body:
                visit(child, guards | _self_attributes(node.test))
            for child in node.orelse:
                visit(child, guards)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, guards)

    visit(function, frozenset())
    return products


def function_computes_glu(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """The rule of this module on one function's syntax tree."""
    return bool(gated_products(function))


@functools.lru_cache(maxsize=None)
def forward_gated_products(cls: type) -> tuple[frozenset[str], ...]:
    """:func:`gated_products` of ``cls.forward``'s own source (none where it
    has no readable source)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return ()
    return tuple(p for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for p in gated_products(n))


def forward_computes_glu(cls: type) -> bool:
    """Whether ``cls.forward``'s own source computes a gated unit."""
    return bool(forward_gated_products(cls))


def _holds_weights(module: nn.Module) -> bool:
    return any(p.dim() >= 2 for p in module.parameters())


def feed_forward_shaped(module: nn.Module, takes_one_input) -> bool:
    """Weights of its own (a stacked experts parameter of three or more
    dimensions, or two matrices), whatever its inputs; or a one-tensor
    forward (``takes_one_input(module)``: a feed-forward's signature;
    attention and gated norms take several inputs) over any matrix in it or
    its children."""
    own = [p.dim() for p in module.parameters(recurse=False) if p.dim() >= 2]
    return max(own, default=0) >= 3 or len(own) >= 2 or (takes_one_input(module) and _holds_weights(module))


def live_gated_products(module: nn.Module) -> bool:
    """Whether ``module``'s forward has a gated product this instance can
    compute: none of the children it depends on is None."""
    return any(not any(getattr(module, name, True) is None for name in reads)
               for reads in forward_gated_products(type(module)))


def glu_form_reason(module: nn.Module, takes_one_input) -> str | None:
    """The report's reason for a module the walk did not recognise that is
    shaped like a feed-forward (:func:`feed_forward_shaped`) and computes a
    gated unit in its forward; else None."""
    if not forward_gated_products(type(module)):  # read once per class: most modules stop here
        return None
    if not feed_forward_shaped(module, takes_one_input) or not live_gated_products(module):
        return None
    return ("its forward computes a gated unit (read from its source: an activation's output times another "
            "tensor) in a form swiglu_cupy does not recognise: left as is")
