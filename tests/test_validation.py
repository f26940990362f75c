"""_validation: checks by role, errors naming the argument, and no
distributed imports on the core path."""
import subprocess
import sys

import pytest
import torch

import swiglu_cupy as sc
from swiglu_cupy._validation import Role, check_tensor


def test_weights_reject_expanded_views_but_inputs_accept_them():
    expanded = torch.randn(1, 8).expand(4, 8)
    check_tensor("x", expanded, Role.INPUT)
    with pytest.raises(ValueError, match="w3 is an expanded view"):
        check_tensor("w3", expanded, Role.WEIGHT)


def test_the_role_not_the_name_decides():
    expanded = torch.randn(1, 8).expand(4, 8)
    check_tensor("w3", expanded, Role.INPUT)  # a name alone changes nothing
    with pytest.raises(ValueError, match="x is an expanded view"):
        check_tensor("x", expanded, Role.WEIGHT)


def test_tensor_subclass_weight_does_not_import_torch_distributed():
    """A tensor-subclass weight takes the full checks; detecting a DTensor
    there must not load the TP module or DCP (~1 s, and a break in their
    private imports would break the core op)."""
    code = """
import sys, torch
import swiglu_cupy as sc

class Tagged(torch.Tensor):
    pass

x = torch.randn(3, 8)
w12 = torch.randn(12, 8).as_subclass(Tagged)
w3 = torch.randn(8, 6).as_subclass(Tagged)
y = sc.swiglu(x, w12, None, w3, None)
assert torch.allclose(y, sc.swiglu_reference(x, w12.as_subclass(torch.Tensor), None,
                                             w3.as_subclass(torch.Tensor), None), atol=1e-5)
loaded = [m for m in ("torch.distributed.checkpoint", "swiglu_cupy.parallel") if m in sys.modules]
assert not loaded, loaded
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
