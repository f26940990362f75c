"""The test tiers (tests/conftest.py, docs/testing.md#tiers): every test file
is given a tier on purpose, every tier has its documented command, and the
quick tier runs, skipping what it cannot, where none of the optional packages
can be imported."""
import fnmatch
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FILES, TESTS, TIERS

REPO = Path(__file__).resolve().parents[1]
TESTS_DIR = REPO / "tests"

# Every optional package the tests use (the `test` and `hf` extras, and the peers of
# tests/requirements/), by import name: the no-peers run hides them all.
OPTIONAL = ("transformers", "xformers", "peft", "deepspeed", "timm", "torchvision", "onnx", "onnxscript",
            "onnxruntime", "accelerate", "litgpt", "lightning", "torchtune", "olmo_core", "megatron",
            "torchtitan", "hypothesis", "matplotlib")


def test_every_test_file_is_given_a_tier():
    on_disk = {p.name for p in TESTS_DIR.glob("test_*.py")}
    assert set(FILES) - on_disk == set(), "FILES in tests/conftest.py names files that are gone"
    assert on_disk - set(FILES) == set(), "new test files: give each a tier in FILES in tests/conftest.py"
    assert set(FILES.values()) <= set(TIERS)
    assert set(TIERS) - {"training"} <= set(FILES.values())  # each tier has a home file


def test_every_test_named_in_the_tier_table_exists():
    for file, tests in TESTS.items():
        assert file in FILES, file
        defined = re.findall(r"^(?:async )?def (test_\w+)\(", (TESTS_DIR / file).read_text(), re.M)
        for pattern, tier in tests.items():
            assert tier in TIERS, (file, pattern, tier)
            name = pattern.split("[")[0]
            assert fnmatch.filter(defined, name), f"{file} defines no {name} (TESTS in tests/conftest.py)"
            assert tier != FILES[file], f"{file}::{pattern} is in its file's tier already"


def test_each_collected_test_has_exactly_one_tier(request):
    for item in request.session.items:
        tiers = [tier for tier in TIERS if item.get_closest_marker(tier) is not None]
        assert len(tiers) == 1, (item.nodeid, tiers)


def test_each_tier_is_registered_and_has_its_documented_command():
    pyproject = (REPO / "pyproject.toml").read_text()
    testing = (REPO / "docs" / "testing.md").read_text()
    for tier in TIERS:
        assert re.search(rf'"{tier}: ', pyproject), f"pyproject.toml registers no marker {tier}"
        assert f"python -m pytest -q -m {tier}" in testing, f"docs/testing.md has no command for {tier}"
    assert "python -m pytest -q -m quick" in (REPO / "README.md").read_text()


def _hidden_env():
    return dict(os.environ, SWIGLU_HIDE_PACKAGES=",".join(OPTIONAL),
                PYTHONPATH=os.pathsep.join([str(TESTS_DIR / "without_peers"), str(REPO),
                                            os.environ.get("PYTHONPATH", "")]))


def test_quick_tier_runs_without_the_optional_packages():
    """`python -m pytest -q -m quick` in a process where none of OPTIONAL can
    be imported (tests/without_peers/sitecustomize.py hides them, in the ranks
    and subprocesses it starts too): every test file is collected (a crash at
    import would be a collection error), the quick tier passes, and what needs
    a hidden package skips saying which."""
    if os.environ.get("SWIGLU_HIDE_PACKAGES"):
        pytest.skip("already inside the no-peers run")
    env = _hidden_env()
    # The hiding works: the packages are gone, torch and this package are not.
    probe = ("import importlib.util, sys\n"
             f"hidden = {OPTIONAL!r}\n"
             "found = [n for n in hidden if importlib.util.find_spec(n) is not None]\n"
             "assert not found, found\n"
             "try:\n    import transformers\nexcept ModuleNotFoundError as e:\n    print('hidden:', e)\n"
             "import torch, swiglu_cupy\nprint('here:', swiglu_cupy.__file__)\n")
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "hidden: No module named 'transformers'" in out.stdout, out.stdout
    assert f"here: {REPO / 'swiglu_cupy' / '__init__.py'}" in out.stdout, out.stdout

    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "quick", "-rs"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - start
    text = proc.stdout + proc.stderr
    problems = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))
                or "PytestCollectionWarning" in line]
    assert proc.returncode == 0 and not problems, "\n".join(problems) + "\n...\n" + text[-3000:]
    summary = text.strip().splitlines()[-1]
    assert " passed" in summary and "error" not in summary and "failed" not in summary, summary
    assert int(re.search(r"(\d+) passed", summary).group(1)) >= 300, summary
    skips = [line for line in text.splitlines() if line.startswith("SKIPPED")]
    for package in ("transformers", "peft", "xformers"):
        assert any(package in line for line in skips), f"no skip names {package}:\n" + "\n".join(skips)
    print(f"quick tier without {len(OPTIONAL)} optional packages: {summary} ({seconds:.0f} s)")
