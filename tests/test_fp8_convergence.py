"""Training with saved_x12="fp8" converges as the default does
(``examples/fp8_convergence.py``: a tiny transformers Llama, a fixed synthetic
corpus, bf16 autocast on the CPU, 150 steps, seeds 0-2 for each mode).

About 50 s on 2 cores; marked ``training`` (the floor run of ``.ci/run``
leaves it out: it checks the same code on the same torch ops)."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fp8_convergence.py"


def _example():
    spec = importlib.util.spec_from_file_location("fp8_convergence", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.training
def test_fp8_saved_x12_ends_within_the_spread_of_the_default_seeds():
    ex = _example()
    runs = ex.compare()
    default = {s: ex.final_loss(l) for s, l in runs["default"].items()}
    fp8 = {s: ex.final_loss(l) for s, l in runs["fp8"].items()}
    low, high = min(default.values()), max(default.values())
    spread = high - low
    first = runs["default"][0][0]
    assert all(f < 0.4 * first for f in default.values()), (first, default)  # it learned something
    mean_fp8 = sum(fp8.values()) / len(fp8)
    assert low <= mean_fp8 <= high, (default, fp8)
    for seed in fp8:  # each 8-bit run stays closer to its own seed's default run than the seeds are apart
        assert abs(fp8[seed] - default[seed]) <= spread, (seed, default, fp8)
