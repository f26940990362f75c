"""transformers' OWN common model tests (ModelTesterMixin, ConfigTester, TrainingTesterMixin, FSDPTesterMixin,
TensorParallelTesterMixin, ExpertParallelTesterMixin), run on models patched by swiglu_cupy and compared test by
test with the same tests run unpatched.

How (tests/hf_common/): the mixins come from the PyPI sdist of the INSTALLED transformers version, downloaded at
test time and cached (`~/.cache/swiglu_cupy/transformers-sdist/<version>/`); nothing of transformers' tests is in
this repository. Our own stand-ins replace the modules the sdist does not ship (generation/exporters mixins that
add no tests, a small config_common_kwargs, gloo/CPU rank spawning). One generic model tester of ours
(hf_common/tester.py) gives every family in hf_common/families.py a tiny config, its model classes and inputs.
The suite runs in pytest subprocesses (hf_common/runner.py), with the plugin hf_common/hook.py:

- off:   unpatched (the baseline);
- build: `swiglu_cupy.patch(model)` right after the post_init of every outermost model, the meta-device skeleton
         `from_pretrained` builds before loading weights included (what class-level patching must survive);
- after: models built directly are patched after construction, `from_pretrained` results after it returns.

Each (family, mode) test asserts: 0 tests that pass unpatched but do not pass patched; the baseline passed tests;
and the patched run really fused: `patch` fused modules (dense MLPs, or MoE experts modules switched to the
swiglu_cupy experts implementation) in that family's tests, on the meta skeleton for `build`, on the loaded
model for `after`.

Selection:
- default (`python -m pytest -q`): every family in `build` mode, plus `after` for llama (dense) and mixtral (MoE),
  each with its baseline; left out: the tests that spawn gloo ranks (FSDP/HSDP, TP/EP forward/backward/
  generation: 30-80 s each on 2 cores) and the three heaviest single-process tests (runner.HEAVY). The cheap
  FSDP/TP/EP plan tests (test_fsdp_plan_declared, test_tp_plan_*) and the training tests still run.
- `SWIGLU_HF_COMMON=all python -m pytest -q tests/test_hf_common.py`: every family in both modes, every test
  (distributed ones included: ranks are 2 CPU processes on gloo, each rank patched the same way; the mixins'
  own allowlists and device checks skip what they skip unpatched too, e.g. HSDP needs 4 workers).
- `SWIGLU_HF_COMMON=both`: every family in both orders, the default's tests (about 7 minutes on 2 cores).
- `SWIGLU_HF_COMMON=off` skips it all. SWIGLU_HF_JOBS (default 2) sets how many pytest subprocesses run at once.

If the registry cannot be reached (no sdist), every test here skips, saying so.
"""
import os

import pytest

from hf_common.families import FAMILIES
from hf_common.runner import class_name, compare, run_matrix
from hf_common.sdist import Unavailable, assemble

SELECT = os.environ.get("SWIGLU_HF_COMMON", "default")
FULL = SELECT == "all"
if SELECT in ("all", "both"):
    MATRIX = [(f, m) for m in ("build", "after") for f in FAMILIES]
else:
    MATRIX = [(f, "build") for f in FAMILIES] + [("llama", "after"), ("mixtral", "after")]

pytestmark = pytest.mark.skipif(SELECT == "off", reason="SWIGLU_HF_COMMON=off")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tree = tmp_path_factory.mktemp("hf_common")
    try:
        assemble(tree)
    except Unavailable as exc:
        pytest.skip(f"transformers' common tests unavailable: {exc}")
    results, hooks, rcs = run_matrix(tree, MATRIX, FULL, jobs=int(os.environ.get("SWIGLU_HF_JOBS", "2")))
    return tree, results, hooks, rcs


def _fused_records(hooks, mode, family):
    prefix = f"test_family_suite.py::{class_name(family)}::"
    return [r for r in hooks.get(mode, []) if r["test"].startswith(prefix)]


@pytest.mark.parametrize("family,mode", MATRIX, ids=[f"{f}-{m}" for f, m in MATRIX])
def test_patched_matches_unpatched(runs, family, mode):
    tree, results, hooks, rcs = runs
    assert "off" in results and mode in results, f"a run left no junit xml: return codes {rcs}; logs in {tree}/logs"
    base, patched, both, newly = compare(results["off"], results[mode], family)
    assert sum(s == "passed" for s, _ in base.values()) > 0, f"{family}: the baseline passed nothing"
    assert set(patched) == set(base), f"{family}/{mode}: not the same tests ran: {sorted(set(base) ^ set(patched))}"
    assert not newly, f"{family}/{mode}: {len(newly)} tests pass unpatched but not patched (pass in both: " \
                      f"{len(both)}):\n" + "\n".join(f"  {t}: {m}" for t, m in sorted(newly.items()))
    records = _fused_records(hooks, mode, family)
    kind = FAMILIES[family][0]

    def fused(r):  # pending: switched on the meta skeleton, decided at the first real forward
        return r["fused"] + r.get("pending", 0) + (r["experts"] if kind == "moe" else 0)

    assert any(fused(r) for r in records), f"{family}/{mode}: patch fused nothing in any test: proves nothing"
    if kind == "moe":
        assert any(r["experts"] for r in records), f"{family}/{mode}: no experts module was switched"
    where = "from_pretrained_skeleton" if mode == "build" else "after_from_pretrained"
    hits = [r for r in records if r["where"] == where and fused(r)]
    assert hits, f"{family}/{mode}: nothing fused at {where}"
    if mode == "build":
        assert any(r["device"] == "meta" for r in hits), f"{family}/build: the meta skeleton was never patched"
    else:
        assert not any(r["where"] == "from_pretrained_skeleton" for r in records)
