"""The host cost of the CUDA route, measured without a GPU.

A CUDA tensor's call runs every line of the package down to the launcher's
``launch``; only CuPy's own launch is GPU work. :func:`cuda_route` forces that
route on CPU tensors with a launcher that does nothing (:class:`NullLauncher`,
its module self-check recorded as skipped), so what is left is the host path
a CUDA call takes, measured here in Python frames (deterministic:
:func:`package_frames`, the frame-budget test) and in time (``bench
--host-cost``). The entry points (:data:`ENTRY_POINTS`) build at any size
(``bench --host-cost`` uses a decode and a small training shape), each
compared with its eager reference (:data:`REFERENCES`); :data:`MODES` and
:func:`mode_step` are the calls timed per entry point.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from ..kernels.launch_config import using_launcher
from ..primitives import first_use_check

__all__ = ["NullLauncher", "cuda_route", "package_frames", "FrameCount", "ENTRY_POINTS", "REFERENCES", "MODES",
           "build_entry", "mode_step", "EagerGLUMLP", "Unavailable"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_THIS_FILE = os.path.abspath(__file__)  # the harness's own frames (the calls it builds) are not the package's


class Unavailable(RuntimeError):
    """An entry point needs a package that is not installed."""


class NullLauncher:
    """A kernel launcher that launches nothing (counts its calls): the host
    path of a CUDA call without the GPU work."""

    def __init__(self) -> None:
        self.launches = 0

    def launch(self, name, dtype, device, grid, block, args) -> None:
        self.launches += 1


@contextlib.contextmanager
def cuda_route(launcher: NullLauncher | None = None) -> Iterator[NullLauncher]:
    """Every primitive call inside runs the kernel path through ``launcher``
    (a new :class:`NullLauncher` by default), CPU tensors included. Its
    self-check is recorded as skipped: a launcher that computes nothing
    would fail it, and the CUDA route would fall back to torch."""
    launcher = NullLauncher() if launcher is None else launcher
    saved = os.environ.get(first_use_check.ENV)
    os.environ[first_use_check.ENV] = "0"
    try:
        with using_launcher(launcher):
            yield launcher
    finally:
        if saved is None:
            del os.environ[first_use_check.ENV]
        else:
            os.environ[first_use_check.ENV] = saved


@dataclass(frozen=True)
class FrameCount:
    total: int       # Python frames entered during the call
    package: int     # of them, in swiglu_cupy's own files (this harness's excluded)
    by_function: dict  # (file, function) -> count, the package's frames


def package_frames(fn: Callable[[], object]) -> FrameCount:
    """The Python frames ``fn()`` enters (``sys.setprofile`` "call" events;
    C functions are not frames), in all and inside this package."""
    counts: dict[tuple[str, str], int] = {}
    total = 0

    def profile(frame, event, arg):
        nonlocal total
        if event == "call":
            total += 1
            filename = frame.f_code.co_filename
            if filename.startswith(_PACKAGE_DIR) and filename != _THIS_FILE:
                key = (os.path.relpath(filename, _PACKAGE_DIR), frame.f_code.co_name)
                counts[key] = counts.get(key, 0) + 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return FrameCount(total, sum(counts.values()), counts)


class EagerGLUMLP(nn.Module):
    """The eager reference: ``down(silu(gate(x)) * up(x))`` in three ``nn.Linear``."""

    def __init__(self, D: int, H: int, dtype=torch.float32) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(D, H, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(D, H, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(H, D, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _swiglu_module(D, H, dtype):
    from ..dense.module import SwiGLU

    module = SwiGLU(D, H, bias=False, dtype=dtype)
    return module, lambda x: module(x)


def _swiglu_functional(D, H, dtype):
    from ..dense.api import swiglu

    module = _swiglu_module(D, H, dtype)[0]
    w12, w3 = module.w12.weight, module.w3.weight
    return module, lambda x: swiglu(x, w12, None, w3, None)


def _llama_config(D, H, dtype, **extra):
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise Unavailable(f"transformers is not installed ({exc})") from exc
    return AutoConfig.for_model("llama", hidden_size=D, intermediate_size=H, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=4, vocab_size=128, pad_token_id=0,
                                bos_token_id=1, eos_token_id=1, torch_dtype=dtype, **extra)


def _patched_llama_mlp(D, H, dtype):
    config = _llama_config(D, H, dtype)  # first: Unavailable without transformers
    from transformers.models.llama.modeling_llama import LlamaMLP

    from ..integrations.patching import patch

    holder = nn.Sequential(LlamaMLP(config)).to(dtype)
    report = patch(holder)
    if list(report.fused) != ["0"]:
        raise RuntimeError(f"LlamaMLP was not fused whole:\n{report}")
    mlp = holder[0]  # the holder only gives patch() a parent; the call is the MLP's alone
    return mlp, lambda x: mlp(x)


def _mixtral_experts(D, H, dtype, patched, experts=8, top_k=2):
    """transformers' own MixtralExperts (random weights, seeded by
    :func:`build_entry`), switched to the fused op by ``patch_experts`` when
    ``patched``, else on transformers' "eager" implementation (its own loop
    over the experts hit); the call routes each token to ``top_k`` random
    experts from a generator of its own, seeded alike for both. An N-D x
    goes in flat, as an MoE block hands its experts the tokens, and its
    output comes back in x's shape."""
    try:
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
        from transformers import AutoConfig
    except ImportError as exc:
        raise Unavailable(f"transformers is not installed ({exc})") from exc

    config = AutoConfig.for_model("mixtral", hidden_size=D, intermediate_size=H, num_local_experts=experts,
                                  num_experts_per_tok=top_k, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=4, vocab_size=128, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=1)
    holder = nn.Sequential(MixtralExperts(config)).to(dtype)
    with torch.no_grad():
        for p in holder.parameters():
            p.normal_(0, 0.05)
    if patched:
        from ..integrations.hf_experts import patch_experts

        if patch_experts(holder) != 1:
            raise RuntimeError("the Mixtral experts module was not patched")
    else:
        config._experts_implementation = "eager"  # what a standalone module runs, named (transformers warns on None)
    module = holder[0]
    generator = torch.Generator().manual_seed(0)

    def call(x):
        tokens = x.reshape(-1, x.shape[-1])
        ids = torch.randint(0, experts, (tokens.shape[0], top_k), generator=generator)
        weights = torch.full((tokens.shape[0], top_k), 1.0 / top_k, dtype=x.dtype)
        out = module(tokens, ids, weights)  # an MoE block hands its experts the tokens flat, [T, D]
        return out if x.dim() == 2 else out.view(x.shape)

    return module, call


def _patched_experts(D, H, dtype):
    return _mixtral_experts(D, H, dtype, patched=True)


def _eager_experts(D, H, dtype):
    return _mixtral_experts(D, H, dtype, patched=False)


def _eager(D, H, dtype):
    module = EagerGLUMLP(D, H, dtype)
    return module, lambda x: module(x)


#: name -> builder ``(D, H, dtype) -> (module, call(x))``; ``x`` is ``[tokens, D]``.
ENTRY_POINTS: dict[str, Callable] = {
    "SwiGLU": _swiglu_module,
    "swiglu": _swiglu_functional,
    "patched LlamaMLP": _patched_llama_mlp,
    "patched experts": _patched_experts,
    "eager MLP": _eager,
    "eager experts": _eager_experts,
}

#: Each of the package's entry points -> the eager entry point it is compared with.
REFERENCES: dict[str, str] = {
    "SwiGLU": "eager MLP",
    "swiglu": "eager MLP",
    "patched LlamaMLP": "eager MLP",
    "patched experts": "eager experts",
}

#: The calls timed per entry point -> the grad mode they run under: a forward
#: with grad (input and weights require grad, the graph is dropped), a forward
#: and backward, and a forward under no_grad.
MODES: dict[str, Callable] = {
    "forward": torch.enable_grad,
    "forward+backward": torch.enable_grad,
    "no_grad forward": torch.no_grad,
}


def _forward_backward(module, call, x, dy) -> None:
    x.grad = None
    module.zero_grad(set_to_none=True)  # as zero_grad() before a step
    call(x).backward(dy)


def mode_step(mode: str, module: nn.Module, call: Callable, x: torch.Tensor,
              dy: torch.Tensor) -> Callable[[], object]:
    """One call of ``mode`` (a key of :data:`MODES`; run it under that grad
    mode) of an entry point built by :func:`build_entry`, on input ``x`` (set
    ``requires_grad`` for the modes with grad) and output gradient ``dy``.
    Its own frames are this file's, which :func:`package_frames` leaves out."""
    if mode == "forward+backward":
        return functools.partial(_forward_backward, module, call, x, dy)
    if mode in MODES:
        return functools.partial(call, x)
    raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")


def build_entry(name: str, D: int, H: int, dtype=torch.float32):
    """``(module, call)`` for an entry point of :data:`ENTRY_POINTS`."""
    if name not in ENTRY_POINTS:
        raise ValueError(f"name must be one of {sorted(ENTRY_POINTS)}, got {name!r}")
    torch.manual_seed(0)
    return ENTRY_POINTS[name](D, H, dtype)
