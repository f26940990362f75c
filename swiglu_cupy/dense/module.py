"""Layer 3: the ``SwiGLU`` module."""
from __future__ import annotations

import torch
from torch import nn

from .._validation import check_flags, check_saved_x12, check_tile_rows
from ..activations import resolve_activation
from .api import swiglu


def linear_params(linear: nn.Module) -> tuple:
    """``(linear.weight, linear.bias)`` read from its parameter registry in
    one call (a plain ``nn.Linear``'s; anything else the normal way, see
    :func:`_registered`)."""
    params = linear._parameters
    try:
        return params["weight"], params["bias"]
    except KeyError:
        return _registered(linear, "_parameters", "weight"), _registered(linear, "_parameters", "bias")


def _registered(module: nn.Module, registry: str, name: str):
    """``getattr(module, name)`` for a registered submodule or parameter, read
    from its registry: nn.Module.__getattr__ costs ~0.6 us a lookup, six per
    call, and decoding calls every MLP once per token. Anything not registered
    there (a parametrization's property, FSDP1's plain-tensor views, which
    both remove the registered entry) takes the normal attribute lookup."""
    try:
        return getattr(module, registry)[name]
    except KeyError:
        return getattr(module, name)


class SwiGLU(nn.Module):
    """SwiGLU feed-forward block: ``w3(silu(gate(x)) * up(x))``, or another
    GLU variant with ``activation=`` (a plain form's name such as
    ``"gelu_tanh"``, or a ``GLUActivation``; kept as the ``activation``
    attribute, shown by ``repr``, never a state_dict entry).

    Holds ``w12 = nn.Linear(in_features, 2 * hidden_features)`` (gate rows
    first, then up rows) and ``w3 = nn.Linear(hidden_features, out_features)``,
    so its state_dict keys are ``w12.weight``, ``w12.bias``, ``w3.weight`` and
    ``w3.bias``: the layout of xformers' packed ``SwiGLU``.

    With an interleaved activation (``GPT_OSS``) the rows of ``w12`` alternate
    gate/up: ``[g0, u0, g1, u1, ...]``.

    ``recompute_gate_up=True`` saves only x for backward (one extra GEMM);
    ``inplace_backward=True`` reuses the saved x12 for dx12 (single backward);
    ``saved_x12="fp8"`` saves x12 as float8 e4m3 with per-128-column scales;
    ``tile_rows`` (an int or ``"auto"``) runs long sequences in row tiles, so
    no ``[tokens, H]`` tensor exists, and ``tile_grads_fp32`` picks the tiles'
    gradient accumulation (see ``swiglu``). Each is kept as the attribute of
    its name.
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
                 bias: bool = True, device=None, dtype=None, *, activation="silu",
                 recompute_gate_up: bool = False, inplace_backward: bool = False, saved_x12=None,
                 tile_rows=None, tile_grads_fp32: bool = True) -> None:
        super().__init__()
        check_saved_x12(saved_x12, recompute_gate_up, inplace_backward)
        check_tile_rows(tile_rows)
        check_flags(tile_grads_fp32=tile_grads_fp32)
        for name, value in (("in_features", in_features), ("hidden_features", hidden_features),
                            ("out_features", out_features)):
            if value is None and name == "out_features":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        out_features = in_features if out_features is None else out_features
        self.activation = resolve_activation(activation)
        self.recompute_gate_up, self.inplace_backward = recompute_gate_up, inplace_backward
        self.saved_x12 = saved_x12
        self.tile_rows, self.tile_grads_fp32 = tile_rows, tile_grads_fp32
        self.in_features, self.hidden_features, self.out_features = in_features, hidden_features, out_features
        self.w12 = nn.Linear(in_features, 2 * hidden_features, bias=bias, device=device, dtype=dtype)
        self.w3 = nn.Linear(hidden_features, out_features, bias=bias, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        """Re-initialize ``w12`` and ``w3`` exactly as ``nn.Linear`` does (for
        meta-device init: ``to_empty(device=...)`` then ``reset_parameters()``)."""
        self.w12.reset_parameters()
        self.w3.reset_parameters()

    def __prepare_scriptable__(self):
        # torch.jit.script calls this first: fail with the supported path named,
        # instead of a compiler error deep inside swiglu().
        raise RuntimeError(
            "SwiGLU cannot be compiled by torch.jit.script (its kernels run from Python). "
            "Use torch.export.export (or torch.compile) instead.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:  # the registries directly: nn.Module.__getattr__ costs ~0.6 us a lookup
            w12, w3 = self._modules["w12"], self._modules["w3"]
            params12, params3 = w12._parameters, w3._parameters
            w12, b12, w3, b3 = params12["weight"], params12["bias"], params3["weight"], params3["bias"]
        except KeyError:  # a parametrization or FSDP1's views replaced a registered entry
            (w12, b12), (w3, b3) = linear_params(self.w12), linear_params(self.w3)
        return swiglu(x, w12, b12, w3, b3, activation=self.activation, recompute_gate_up=self.recompute_gate_up,
                      inplace_backward=self.inplace_backward, saved_x12=self.saved_x12, tile_rows=self.tile_rows,
                      tile_grads_fp32=self.tile_grads_fp32)

    @classmethod
    def from_gate_up_down(cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear, **kwargs) -> "SwiGLU":
        """Build the block from separate Hugging Face style projections.

        Computes ``down(silu(gate(x)) * up(x))``: ``w12.weight = cat([gate.weight,
        up.weight])`` (gate rows first; with an interleaved ``activation``
        the rows alternate gate/up), ``w12.bias`` likewise, ``w3 = down``.
        The new module holds copies (the sources are not modified) on the
        sources' device and dtype, with their ``requires_grad``. ``gate`` and
        ``up`` must both have a bias or neither; ``down`` may differ (then
        ``w3.bias`` is None). ``kwargs`` go to the constructor
        (``activation``, ``recompute_gate_up``, ``inplace_backward``).
        """
        for name, lin in (("gate", gate), ("up", up), ("down", down)):
            if not isinstance(lin, nn.Linear):
                raise TypeError(f"{name} must be an nn.Linear, got {type(lin).__name__}")
        gw, uw, dw = gate.weight, up.weight, down.weight
        if gw.dim() != 2 or gw.shape[0] < 1 or gw.shape[1] < 1:
            raise ValueError(f"gate.weight must be 2-D [H, D], got shape {tuple(gw.shape)}")
        H, D = gw.shape
        if tuple(uw.shape) != (H, D):
            raise ValueError(f"up.weight must have the shape of gate.weight [H, D] = {(H, D)}, "
                             f"got {tuple(uw.shape)}")
        if dw.dim() != 2 or dw.shape[1] != H or dw.shape[0] < 1:
            raise ValueError(f"down.weight must be 2-D [O, H] with H = {H} (gate.out_features), "
                             f"got shape {tuple(dw.shape)}")
        if (gate.bias is None) != (up.bias is None):
            raise ValueError("gate and up must both have a bias or both have none, got "
                             f"gate.bias={'set' if gate.bias is not None else None}, "
                             f"up.bias={'set' if up.bias is not None else None}")
        for name, t in (("up.weight", uw), ("down.weight", dw), ("gate.bias", gate.bias),
                        ("up.bias", up.bias), ("down.bias", down.bias)):
            if t is None:
                continue
            if t.dtype != gw.dtype:
                raise TypeError(f"{name} must have the dtype of gate.weight ({gw.dtype}), got {t.dtype}")
            if t.device != gw.device:
                raise ValueError(f"{name} must be on the device of gate.weight ({gw.device}), got {t.device}")
        if uw.requires_grad != gw.requires_grad:
            raise ValueError("gate.weight and up.weight become one parameter (w12.weight) and must agree "
                             f"on requires_grad, got {gw.requires_grad} and {uw.requires_grad}")
        if gate.bias is not None and up.bias.requires_grad != gate.bias.requires_grad:
            raise ValueError("gate.bias and up.bias become one parameter (w12.bias) and must agree "
                             f"on requires_grad, got {gate.bias.requires_grad} and {up.bias.requires_grad}")
        # Built on the meta device (no init cost), then given the real values.
        module = cls(D, H, dw.shape[0], bias=gate.bias is not None, device="meta", dtype=gw.dtype, **kwargs)
        pack = _interleave if module.activation.interleaved else torch.cat
        with torch.no_grad():
            module.w12.weight = nn.Parameter(pack([gw.detach(), uw.detach()]), gw.requires_grad)
            if gate.bias is not None:
                module.w12.bias = nn.Parameter(pack([gate.bias.detach(), up.bias.detach()]),
                                               gate.bias.requires_grad)
            module.w3.weight = nn.Parameter(dw.detach().clone(), dw.requires_grad)
            module.w3.bias = (None if down.bias is None
                              else nn.Parameter(down.bias.detach().clone(), down.bias.requires_grad))
        return module

    def to_gate_up_down(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """The inverse of :meth:`from_gate_up_down`: new ``(gate, up, down)``
        ``nn.Linear`` modules holding copies of the weights (gate = first H
        rows of ``w12``), on this module's device and dtype, with its
        ``requires_grad``."""
        H, D, O = self.hidden_features, self.in_features, self.out_features
        w12, b12, w3, b3 = self.w12.weight, self.w12.bias, self.w3.weight, self.w3.bias
        if self.activation.interleaved:  # gate rows first below
            w12, b12 = _deinterleave(w12), None if b12 is None else _deinterleave(b12)
        kw = {"device": "meta", "dtype": w12.dtype}
        gate = nn.Linear(D, H, bias=b12 is not None, **kw)
        up = nn.Linear(D, H, bias=b12 is not None, **kw)
        down = nn.Linear(H, O, bias=b3 is not None, **kw)
        with torch.no_grad():
            gate.weight = nn.Parameter(w12[:H].detach().clone(), requires_grad=w12.requires_grad)
            up.weight = nn.Parameter(w12[H:].detach().clone(), requires_grad=w12.requires_grad)
            if b12 is not None:
                gate.bias = nn.Parameter(b12[:H].detach().clone(), requires_grad=b12.requires_grad)
                up.bias = nn.Parameter(b12[H:].detach().clone(), requires_grad=b12.requires_grad)
            down.weight = nn.Parameter(w3.detach().clone(), requires_grad=w3.requires_grad)
            if b3 is not None:
                down.bias = nn.Parameter(b3.detach().clone(), requires_grad=b3.requires_grad)
        return gate, up, down

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, hidden_features={self.hidden_features}, "
                f"out_features={self.out_features}, bias={self.w12.bias is not None}, "
                f"activation={self.activation}" + ("" if self.saved_x12 is None else f", saved_x12={self.saved_x12!r}")
                + ("" if self.tile_rows is None else f", tile_rows={self.tile_rows!r}"))


def _interleave(halves: list[torch.Tensor]) -> torch.Tensor:
    """[gate, up] ([H, ...] each) as the interleaved [2H, ...] rows g0, u0, g1, u1, ..."""
    gate, up = halves
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Interleaved [2H, ...] rows back to [gate; up] halves."""
    return torch.cat([t[0::2], t[1::2]])
