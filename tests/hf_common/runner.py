"""Run the family suite in pytest subprocesses (one per mode and chunk of families, with junit xml and the hook's
JSON log) and compare each patched run with the unpatched one, test by test."""
import glob
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .families import FAMILIES

HERE = Path(__file__).resolve().parent
TESTS_DIR = HERE.parent
REPO = TESTS_DIR.parent

# The tests that spawn ranks (2 gloo processes each, 30-80 s per test on 2 cores): only in SWIGLU_HF_COMMON=all.
DISTRIBUTED = ("test_fsdp2_", "test_hsdp_", "test_tp_forward", "test_tp_backward", "test_tp_generation",
               "test_ep_forward", "test_ep_backward")
# The heaviest single-process tests (per family, 2 cores): eager-vs-SDPA attention over 24 dtype/padding cases
# (~15 s, attention only: the MLP is the same in both), the torch_dtype back-compat loads (~11 s), 300 training
# steps of overfitting (~10 s). Left out by default to fit the CI budget; SWIGLU_HF_COMMON=all runs them.
HEAVY = ("test_eager_matches_sdpa_inference", "test_bc_torch_dtype", "test_training_overfit")

PYTEST_INI = """[pytest]
addopts = -p no:cacheprovider
markers =
    torch_compile_test
    torch_export_test
    is_training_test
    is_fsdp_test
    is_tensor_parallel_test
    is_expert_parallel_test
    flash_attn_test
    flash_attn_3_test
    flash_attn_4_test
    generate
    slow
"""


def class_name(family):
    return "".join(part.capitalize() for part in family.split("_")) + "CommonTest"


# The default CI subset (SWIGLU_HF_COMMON unset): the common tests where patching can change the outcome, i.e.
# that build, load, save, re-initialise or train models (and the MoE experts-implementation equivalence). Every
# family's full single-process suite takes 40-50 s per run on 2 cores, too much for 18 families x 2 runs in CI.
DEFAULT_TESTS = (
    "test_save_load", "test_torch_save_load", "test_from_pretrained_no_checkpoint", "test_can_use_safetensors",
    "test_can_init_all_missing_weights", "test_can_be_initialized_on_meta", "test_correct_missing_keys",
    "test_load_contiguous_weights", "test_base_model_prefix_loads_base_weights", "test_load_save_without_tied_weights",
    "test_model_weights_reload_no_missing_tied_weights", "test_all_tensors_are_parameter_or_buffer",
    "test_init_weights_can_init_buffers", "test_training", "test_batching_equivalence",
    "test_eager_matches_batched_and_grouped_inference", "test_config",
)


def keyword_filter(full):
    """None (everything) for SWIGLU_HF_COMMON=all, else DEFAULT_TESTS (prefix match: test_training covers the
    gradient-checkpointing variants) minus DISTRIBUTED and HEAVY."""
    if full:
        return None
    keep = " or ".join(DEFAULT_TESTS)
    drop = " and ".join(f"not {name}" for name in DISTRIBUTED + HEAVY)
    return f"({keep}) and {drop}"


def prepare(tree):
    """tree: a folder with hf_sdist_tests assembled (sdist.assemble); adds our suite module and ini."""
    tree = Path(tree)
    (tree / "test_family_suite.py").write_text((HERE / "family_suite.py").read_text())
    (tree / "pytest.ini").write_text(PYTEST_INI)


def run_pytest(tree, label, mode, families, kfilter, timeout=3600):
    tree = Path(tree)
    logs = tree / "logs"
    logs.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(tree), str(REPO), str(TESTS_DIR), env.get("PYTHONPATH", "")]),
               SWIGLU_HF_MODE=mode, SWIGLU_HF_FAMILIES=",".join(families), SWIGLU_HF_LOG=str(logs / f"hook_{label}"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "hf_common.hook", "-c", str(tree / "pytest.ini"),
           "--rootdir", str(tree), "test_family_suite.py", f"--junitxml={logs / (label + '.xml')}", "-rfE",
           "-W", "ignore::pytest.PytestUnknownMarkWarning"]
    if kfilter:
        cmd += ["-k", kfilter]
    with open(logs / f"{label}.log", "w") as out:
        proc = subprocess.run(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    return proc.returncode


def load_junit(path):
    """{(class, test): (status, first line of the error)}; status: passed | failed | skipped."""
    results = {}
    for tc in ET.parse(path).iter("testcase"):
        key = (tc.get("classname").rsplit(".", 1)[-1], tc.get("name"))
        status, msg = "passed", ""
        for kind in ("failure", "error"):
            el = tc.find(kind)
            if el is not None:
                status = "failed"
                msg = ((el.get("message") or el.text or "").strip().splitlines() or [""])[0][:300]
        if status == "passed" and tc.find("skipped") is not None:
            status = "skipped"
        if results.get(key, ("",))[0] == "failed":
            continue
        results[key] = (status, msg)
    return results


def load_hook_log(tree, label):
    records = []
    for path in glob.glob(str(Path(tree) / "logs" / f"hook_{label}.*.jsonl")):
        with open(path) as fh:
            records += [json.loads(line) for line in fh if line.strip()]
    return records


def chunks(families, n):
    n = max(1, min(n, len(families)))
    return [families[i::n] for i in range(n)]


def run_matrix(tree, matrix, full, jobs=2):
    """matrix: [(family, mode)] with mode build|after. Runs the baseline (off) for every family in it and each
    mode; returns {mode: {(class, test): (status, msg)}}, {mode: [hook records]}, {label: returncode}."""
    prepare(tree)
    kfilter = keyword_filter(full)
    by_mode = {"off": sorted({f for f, _ in matrix}, key=list(FAMILIES).index)}
    for family, mode in matrix:
        by_mode.setdefault(mode, []).append(family)
    work = []
    for mode, fams in by_mode.items():
        for i, chunk in enumerate(chunks(fams, jobs)):
            work.append((f"{mode}_{i}", mode, chunk))
    # longest first: the baseline and build runs hold every family
    work.sort(key=lambda w: -len(w[2]))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rcs = dict(zip([w[0] for w in work],
                       pool.map(lambda w: run_pytest(tree, w[0], w[1], w[2], kfilter), work)))
    results, hooks = {}, {}
    for label, mode, _ in work:
        xml = Path(tree) / "logs" / f"{label}.xml"
        if xml.is_file():
            results.setdefault(mode, {}).update(load_junit(xml))
        hooks.setdefault(mode, []).extend(load_hook_log(tree, label))
    return results, hooks, rcs


def compare(base, patched, family):
    cls = class_name(family)
    b = {t: v for (c, t), v in base.items() if c == cls}
    p = {t: v for (c, t), v in patched.items() if c == cls}
    both = sorted(t for t in b if b[t][0] == "passed" and p.get(t, ("",))[0] == "passed")
    newly = {t: p.get(t, ("missing", "not run in the patched run"))[1] or p.get(t, ("missing",))[0]
             for t in b if b[t][0] == "passed" and p.get(t, ("",))[0] != "passed"}
    return b, p, both, newly
