"""The GLU activation family: one immutable, hashable spec.

``h = act(gate) * up`` for the plain forms, with optional clamps and the
OAI (GPT-OSS) form; the spec also names the layout of the packed x12:

- ``kind``: ``"silu"`` (SwiGLU, the default), ``"gelu_tanh"`` (GeGLU as
  Gemma computes it, ``F.gelu(approximate="tanh")``), ``"gelu"`` (erf),
  ``"relu"`` (ReGLU), ``"sigmoid"`` (the original GLU), ``"identity"``
  (bilinear), or ``"oai"``: ``gate * sigmoid(alpha * gate) * (up + up_offset)``.
- ``limit``: clamp before the activation, ``gate = min(gate, limit)`` and
  ``up = clamp(up, -limit, limit)`` (DeepSeek-V4, GPT-OSS); None: no clamp.
  Gradients pass where the installed torch's ``clamp`` passes them: at
  exactly the limit up to torch 2.13 (``min <= x <= max``), not from 2.14 on
  (``min < x < max``); ``_torch_compat.CLAMP_GRADIENT_AT_BOUND`` holds the rule.
- ``interleaved``: x12 columns are ``[g0, u0, g1, u1, ...]`` (GPT-OSS,
  torchtitan's fused ``w13``) instead of the halves ``[gate | up]``.

Strings name the plain forms (``activation="gelu_tanh"``); ``GPT_OSS`` and
``deepseek_v4(limit)`` build the model-specific ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["GLUActivation", "SILU", "GPT_OSS", "KINDS", "resolve_activation", "resolve_halves_activation",
           "deepseek_v4"]

KINDS = ("silu", "gelu_tanh", "gelu", "relu", "sigmoid", "identity", "oai")


@dataclass(frozen=True)
class GLUActivation:
    kind: str = "silu"
    limit: float | None = None
    alpha: float = 1.0        # "oai" only
    up_offset: float = 0.0    # "oai" only
    interleaved: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"activation kind must be one of {KINDS}, got {self.kind!r}")
        if self.limit is not None:
            if isinstance(self.limit, bool) or not isinstance(self.limit, (int, float)) \
                    or not math.isfinite(self.limit) or self.limit <= 0:
                raise ValueError(f"activation limit must be a positive finite number or None, got {self.limit!r}")
            object.__setattr__(self, "limit", float(self.limit))
        for name in ("alpha", "up_offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"activation {name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.kind != "oai" and (self.alpha != 1.0 or self.up_offset != 0.0):
            raise ValueError(f"alpha and up_offset belong to the 'oai' form, got kind={self.kind!r} "
                             f"with alpha={self.alpha}, up_offset={self.up_offset}")
        if type(self.interleaved) is not bool:
            raise TypeError(f"activation interleaved must be a bool, got {type(self.interleaved).__name__}")

    def __str__(self) -> str:
        if self == SILU:
            return "silu"
        parts = [self.kind]
        if self.kind == "oai":
            parts += [f"alpha={self.alpha:g}", f"up_offset={self.up_offset:g}"]
        if self.limit is not None:
            parts.append(f"limit={self.limit:g}")
        if self.interleaved:
            parts.append("interleaved")
        return ", ".join(parts) if len(parts) > 1 else self.kind


SILU = GLUActivation()
GPT_OSS = GLUActivation("oai", limit=7.0, alpha=1.702, up_offset=1.0, interleaved=True)


def deepseek_v4(limit: float) -> GLUActivation:
    """DeepSeek-V4's clamped SwiGLU (``limit = config.swiglu_limit``)."""
    return GLUActivation("silu", limit=limit)


# One spec per name, built once: resolving sits on every call's host path.
_NAMED = {kind: SILU if kind == "silu" else GLUActivation(kind) for kind in KINDS}


def resolve_activation(activation) -> GLUActivation:
    """A ``GLUActivation`` from a spec or a plain form's name."""
    if activation.__class__ is GLUActivation:
        return activation
    if isinstance(activation, str):
        spec = _NAMED.get(activation)
        if spec is None:
            raise ValueError(f"activation must be one of {KINDS} or a GLUActivation, got {activation!r}")
        return spec
    if isinstance(activation, GLUActivation):
        return activation
    raise TypeError(f"activation must be a str or a GLUActivation, got {type(activation).__name__}")


def resolve_halves_activation(activation, what: str) -> GLUActivation:
    """``resolve_activation`` for an entry whose gate and up are separate tensors
    (``what`` names them): the interleaved layout describes a packed tensor."""
    spec = resolve_activation(activation)
    if spec.interleaved:
        raise ValueError(f"activation={spec} is interleaved, which describes a packed w12/x12; {what} are "
                         "separate tensors here. Pass the same spec with interleaved=False "
                         "(dataclasses.replace(activation, interleaved=False)).")
    return spec
