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


# ---- swiglu_unpacked: the one-pass check of the common call, and the precise errors past it ----

def _unpacked(D=6, H=4, O=5, bias=True):
    w1, w2, w3 = torch.randn(H, D), torch.randn(H, D), torch.randn(O, H)
    b1, b2, b3 = (torch.randn(H), torch.randn(H), torch.randn(O)) if bias else (None, None, None)
    return torch.randn(3, D), w1, b1, w2, b2, w3, b3


UNPACKED_SHAPE_FAULTS = [  # (argument index, replacement, the error's words)
    (1, torch.randn(4, 7), "w1 must be 2-D \\[H, D\\] with D = x.shape\\[-1\\] = 6"),
    (1, torch.randn(4, 6, 1), "w1 must be 2-D"),
    (3, torch.randn(3, 6), "w2 must have the shape of w1"),
    (2, torch.randn(3), "b1 must have shape \\(4,\\)"),
    (4, torch.randn(5), "b2 must have shape \\(4,\\)"),
    (5, torch.randn(5, 3), "w3 must be 2-D \\[O, H\\] with H = 4"),
    (6, torch.randn(4), "b3 must have shape \\(5,\\)"),
    (0, torch.tensor(1.0), "x must have shape \\[..., D\\], got a 0-d tensor"),
]


@pytest.mark.parametrize("index,bad,match", UNPACKED_SHAPE_FAULTS)
def test_unpacked_shape_faults_leave_the_common_case_and_name_the_argument(index, bad, match):
    from swiglu_cupy import _validation as check

    args = list(_unpacked())
    assert check.common_case(*args, False)
    args[index] = bad
    assert not check.common_case(*args, False)
    with pytest.raises(ValueError, match=match):
        sc.swiglu_unpacked(*args)


PACKED_SHAPE_FAULTS = [  # (index in (x, w12, b12, w3, b3), replacement, the error's words)
    (1, torch.randn(8, 7), "w12 must be \\[2H, D\\] with D = x.shape\\[-1\\] = 6"),
    (1, torch.randn(7, 6), "w12 must have 2H rows"),
    (1, torch.randn(8, 6, 1), "w12 must be 2-D"),
    (2, torch.randn(7), "b12 must have shape \\(8,\\)"),
    (3, torch.randn(5, 3), "w3 must be 2-D \\[O, H\\] with H = 4"),
    (4, torch.randn(4), "b3 must have shape \\(5,\\)"),
    (0, torch.tensor(1.0), "x must have shape \\[..., D\\], got a 0-d tensor"),
]


@pytest.mark.parametrize("index,bad,match", PACKED_SHAPE_FAULTS)
def test_packed_shape_faults_leave_the_common_case_and_name_the_argument(index, bad, match):
    from swiglu_cupy import _validation as check

    x, w1, b1, w2, b2, w3, b3 = _unpacked()
    args = [x, torch.cat([w1, w2]), torch.cat([b1, b2]), w3, b3]
    assert check.common_case(args[0], args[1], args[2], None, None, args[3], args[4], True)
    args[index] = bad
    assert not check.common_case(args[0], args[1], args[2], None, None, args[3], args[4], True)
    with pytest.raises(ValueError, match=match):
        sc.swiglu(*args)


def test_a_missing_up_weight_is_never_taken_for_packed_weights():
    """swiglu_unpacked with w2=None and a w1 of packed shape [2H, D] leaves the
    common case (which is told the layout) and is refused, naming w2."""
    from swiglu_cupy import _validation as check

    x, w1, b1, w2, b2, w3, b3 = _unpacked()
    w12 = torch.cat([w1, w2])
    assert check.common_case(x, w12, None, None, None, w3, b3, True)
    assert not check.common_case(x, w12, None, None, None, w3, b3, False)
    assert not check.common_case(x, w12, None, None, b2, w3, b3, True)  # a packed call has no b2
    with pytest.raises(TypeError, match="w2 must be a torch.Tensor"):
        sc.swiglu_unpacked(x, w12, None, None, None, w3, b3)


def test_unpacked_common_case_without_biases_matches_the_reference():
    x, w1, b1, w2, b2, w3, b3 = _unpacked(bias=False)
    x, w1, w2, w3 = (t.double() for t in (x, w1, w2, w3))
    x.requires_grad_(True)
    y = sc.swiglu_unpacked(x, w1, None, w2, None, w3, None)
    ref = w3.matmul((torch.nn.functional.silu(x @ w1.T) * (x @ w2.T)).T).T
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    y.sum().backward()
    assert x.grad.abs().sum() > 0


# ---- the common case's device comparison (index, meta) -------------------------------------------

@pytest.mark.parametrize("index", range(7))
def test_a_meta_tensor_anywhere_leaves_the_common_case_and_is_named(index):
    """Meta and the CPU share index -1: the common case tells them apart by
    is_meta, so a meta argument reaches the full checks and their error."""
    from swiglu_cupy import _validation as check

    args = list(_unpacked())
    names = ["x", "w1", "b1", "w2", "b2", "w3", "b3"]
    args[index] = args[index].to("meta")
    assert not check.common_case(*args, False)
    with pytest.raises(ValueError, match=f"{names[index]} is a meta tensor"):
        sc.swiglu_unpacked(*args)


def test_the_common_case_compares_devices_like_torch_device_equality():
    """(get_device(), is_meta) tells apart every pair of the devices a CPU
    process can hold (cpu, meta) as torch.device equality does. Meta must be
    asked: torch itself computes a CPU x with a meta weight, into zeros."""
    from swiglu_cupy import _validation as check

    x, w12, w3 = torch.randn(3, 6), torch.randn(8, 6), torch.randn(5, 4)
    for dx in ("cpu", "meta"):
        for dw in ("cpu", "meta"):
            same = torch.device(dx) == torch.device(dw) and dx != "meta"  # meta never takes the common case
            assert check.common_case(x.to(dx), w12.to(dw), None, None, None, w3.to(dw), None, True) is same, (dx, dw)
    assert not torch.nn.functional.linear(x, w12.to("meta")).is_meta  # no error from torch: ours is needed
