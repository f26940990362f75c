"""pytest plugin (`-p hf_common.hook`): patch every model the transformers tests build, per SWIGLU_HF_MODE.

SWIGLU_HF_MODE
    off    nothing is patched (the baseline run).
    build  `swiglu_cupy.patch(model)` right after the `post_init` of every OUTERMOST model under construction,
           the skeleton `from_pretrained` builds on the meta device before it loads the weights included: what
           class-level patching (replacing the MLP class before loading) has to survive.
    after  models built directly (`Model(config)`, `from_config`) are patched right after their `post_init` too,
           but inside `from_pretrained` the skeleton is left alone and the loaded model is patched after
           `from_pretrained` returns (patching after loading).
SWIGLU_HF_LOG  path prefix: one JSON line per patch call is appended to `<prefix>.<pid>.jsonl` (the test, where,
           the class, the device, and what `patch` did: fused / partial / skipped / pending / experts counts;
           on the meta device dense MLPs are pending: decided by the probe at their first real forward).

Outermost: `PreTrainedModel.__init__` pushes the model on a per-thread stack and our `post_init` pops it, so a
model built inside another's `__init__` (`LlamaModel` inside `LlamaForCausalLM`) is not patched on its own (its
parent is, as a whole, when its own `post_init` runs).
"""
import json
import os
import threading

MODES = ("off", "build", "after")
_local = threading.local()
_installed = []


def _mode():
    mode = os.environ.get("SWIGLU_HF_MODE", "off")
    if mode not in MODES:
        raise ValueError(f"SWIGLU_HF_MODE={mode!r}: expected one of {MODES}")
    return mode


def _stack():
    if not hasattr(_local, "stack"):
        _local.stack, _local.loading = [], 0
    return _local.stack


def _patch(model, where):
    import swiglu_cupy

    report = swiglu_cupy.patch(model)
    prefix = os.environ.get("SWIGLU_HF_LOG")
    if prefix:
        param = next(model.parameters(), None)
        record = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0], "where": where,
                  "cls": type(model).__name__, "device": None if param is None else param.device.type,
                  "patched": len(report), "fused": len(report.fused), "partial": len(report.partial),
                  "skipped": len(report.skipped), "pending": len(report.pending), "experts": report.experts}
        with open(f"{prefix}.{os.getpid()}.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
    return report


def install(mode):
    """Wrap PreTrainedModel.__init__ / post_init / from_pretrained for `mode` (idempotent)."""
    if mode == "off" or _installed:
        return
    from transformers import PreTrainedModel

    orig_init = PreTrainedModel.__init__
    orig_post_init = PreTrainedModel.post_init
    orig_from_pretrained = PreTrainedModel.from_pretrained.__func__

    def __init__(self, *args, **kwargs):
        _stack().append(self)
        orig_init(self, *args, **kwargs)

    def post_init(self, *args, **kwargs):
        out = orig_post_init(self, *args, **kwargs)
        stack = _stack()
        if any(m is self for m in stack):
            while stack and stack.pop() is not self:
                pass
        if stack:
            return out  # built inside another model's __init__: patched with it
        if _local.loading:
            if mode == "build":
                _patch(self, "from_pretrained_skeleton")
        else:
            _patch(self, "post_init")
        return out

    def from_pretrained(cls, *args, **kwargs):
        _stack()
        _local.loading += 1
        try:
            out = orig_from_pretrained(cls, *args, **kwargs)
        finally:
            _local.loading -= 1
        if mode == "after" and not _local.loading:
            model = out[0] if isinstance(out, tuple) else out
            if isinstance(model, PreTrainedModel):
                _patch(model, "after_from_pretrained")
        return out

    PreTrainedModel.__init__ = __init__
    PreTrainedModel.post_init = post_init
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    _installed.append(mode)


def install_from_env():
    install(_mode())


def pytest_configure(config):
    install_from_env()


def pytest_report_header(config):
    return f"swiglu_cupy hf_common hook: SWIGLU_HF_MODE={_mode()}"
