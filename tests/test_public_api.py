"""The public import paths and names: what users import keeps working
whatever moves inside the package."""
import pickle
import subprocess
import sys

import pytest
import torch

import swiglu_cupy

FACE = {"__version__", "SwiGLU", "SwiGLUFunction", "SwiGLUOptions", "SiluMulFunction", "swiglu", "swiglu_unpacked",
        "swiglu_reference", "silu_mul", "silu_mul_reference", "glu_mul", "glu_reference", "glu_ffn_reference",
        "GLUActivation", "GPT_OSS", "deepseek_v4", "warmup", "info", "patch", "PatchReport", "cuda_kernels_available"}

PUBLIC_MODULES = {
    "swiglu_cupy.hf": ("swiglu_cupy.integrations.hf",
                       {"SwiGLUMLP", "patch_model", "apply_to", "unapply", "patch_mapping", "is_swiglu_mlp",
                        "ACTIVATIONS"}),
    "swiglu_cupy.hf_experts": ("swiglu_cupy.integrations.hf_experts",
                               {"NAME", "register", "patch_experts", "experts_forward", "experts_plan",
                                "is_hf_experts", "ExpertsPlan"}),
    "swiglu_cupy.xformers": ("swiglu_cupy.integrations.xformers",
                             {"SwiGLUPackedFusedOp", "SwiGLUFusedOp", "patch_xformers", "patch_xformers_module"}),
    "swiglu_cupy.parallel": ("swiglu_cupy.integrations.parallel",
                             {"SwiGLUTensorParallel", "fsdp_shard_placement", "reject_distributed_weights"}),
    "swiglu_cupy.moe": ("swiglu_cupy.moe",
                        {"grouped_experts", "routed_experts", "MoEExpertsFunction", "experts_reference",
                         "sort_by_expert"}),
    "swiglu_cupy.ops": ("swiglu_cupy.primitives.ops", {"aten_decompositions"}),
    "swiglu_cupy.primitives": ("swiglu_cupy.primitives",
                               {"swiglu_forward", "swiglu_backward", "silu_mul_forward", "silu_mul_backward"}),
    "swiglu_cupy.activations": ("swiglu_cupy.activations",
                                {"GLUActivation", "SILU", "GPT_OSS", "KINDS", "resolve_activation", "deepseek_v4"}),
    "swiglu_cupy.reference": ("swiglu_cupy.reference",
                              {"swiglu_reference", "silu_mul_reference", "glu_reference", "glu_ffn_reference",
                               "split_gate_up", "experts_reference"}),
}

OPS = ("swiglu_forward", "swiglu_forward_inplace", "swiglu_backward", "swiglu_backward_inplace",
       "silu_mul_forward", "silu_mul_backward", "moe_experts_forward", "moe_experts_backward")


def test_the_package_face_exports_exactly_the_pinned_names():
    assert set(swiglu_cupy.__all__) == FACE
    for name in FACE:
        assert getattr(swiglu_cupy, name) is not None, name


@pytest.mark.parametrize("public", sorted(PUBLIC_MODULES))
def test_public_module_paths_keep_their_names(public):
    import importlib

    where, names = PUBLIC_MODULES[public]
    module, target = importlib.import_module(public), importlib.import_module(where)
    assert names <= set(dir(module)), names - set(dir(module))
    if hasattr(module, "__all__"):
        assert names <= set(module.__all__)
    if module is not target:  # a public path that re-exports: exactly its target's __all__, the same objects
        assert list(module.__all__) == list(target.__all__), f"{public} re-exports other names than {where}"
        moved = [n for n in target.__all__ if getattr(module, n) is not getattr(target, n)]
        assert not moved, f"{public} holds other objects than {where} under {moved}"


def test_the_registered_op_names():
    import swiglu_cupy.moe  # noqa: F401  (the MoE ops register with the module)

    for name in OPS:
        assert hasattr(torch.ops.swiglu_cupy, name), name
    table = swiglu_cupy.ops.aten_decompositions()
    assert torch.ops.swiglu_cupy.swiglu_forward.default in table


def test_xformers_op_objects_pickle_by_name_under_the_public_path():
    from swiglu_cupy.xformers import SwiGLUFusedOp, SwiGLUPackedFusedOp

    for op in (SwiGLUPackedFusedOp, SwiGLUFusedOp):
        assert pickle.loads(pickle.dumps(op)) is op
    # A pickle written before the move names swiglu_cupy.xformers: it still loads.
    old = b"cswiglu_cupy.xformers\nSwiGLUPackedFusedOp\n."  # protocol 0: GLOBAL module name, STOP
    assert pickle.loads(old) is SwiGLUPackedFusedOp


def test_hf_experts_import_registers_the_experts_implementation():
    pytest.importorskip("transformers")
    import swiglu_cupy.hf_experts as hx
    from transformers.integrations.moe import ExpertsInterface

    assert hx.NAME in ExpertsInterface._global_mapping


def test_the_console_script_names_a_callable_main():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    import importlib
    from pathlib import Path

    pyproject = Path(swiglu_cupy.__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("an installed package without its pyproject.toml")
    target = tomllib.loads(pyproject.read_text())["project"]["scripts"]["swiglu-cupy"]
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), target


def test_the_cli_lists_its_commands():
    out = subprocess.run([sys.executable, "-m", "swiglu_cupy", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("compile", "info", "bench", "selftest"):
        assert command in out, command
