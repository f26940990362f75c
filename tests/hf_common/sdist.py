"""Put transformers' common test mixins together at test time, from the PyPI sdist of the INSTALLED version.

Nothing of transformers' test code is kept in this repository. `assemble()`:

1. downloads `transformers-<version>.tar.gz` with `pip download --no-deps --no-binary :all:` into
   `$SWIGLU_HF_CACHE` (default `~/.cache/swiglu_cupy/transformers-sdist/<version>/`), reused when present;
2. extracts its top-level `tests/test_*.py` (test_modeling_common, test_configuration_common, test_training_mixin,
   test_fsdp_mixin, test_tensor_parallel_mixin, test_expert_parallel_mixin, ... whatever that version ships) into a
   fresh folder as the package `hf_sdist_tests`;
3. adds OUR stand-ins (`standins/`) for the modules those files import that the sdist does not ship
   (`tests/generation/test_utils.py`, `tests/exporters/test_export.py`, `tests/utils/test_configuration_utils.py`,
   `tests/distributed_testing_utils.py`);
4. downloads the `parameterized` wheel the mixins import (cached beside the sdist) and unpacks it there.

Any failure raises `Unavailable` with the reason (the tests then skip with it; CI can reach the registry).
"""
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "hf_sdist_tests"
HELPERS = ("parameterized==0.9.0",)
HERE = Path(__file__).resolve().parent
# stand-in file (ours) -> where the mixins import it from, inside the package
STANDINS = {
    "generation_test_utils.py": "generation/test_utils.py",
    "exporters_test_export.py": "exporters/test_export.py",
    "configuration_utils_kwargs.py": "utils/test_configuration_utils.py",
    "distributed_testing_utils.py": "distributed_testing_utils.py",
}


class Unavailable(RuntimeError):
    """The sdist (or a helper wheel) could not be had: the reason, for a skip."""


def cache_dir(version):
    root = os.environ.get("SWIGLU_HF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "swiglu_cupy",
                                                                "transformers-sdist")
    return Path(root) / version


def _pip_download(args, dest, what):
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"pip download of {what} failed: {exc}") from exc
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise Unavailable(f"pip download of {what} failed (registry unreachable?): {last[0][:300]}")


def sdist_path(version):
    """The cached sdist of transformers `version`, downloaded if absent."""
    cache = cache_dir(version)
    path = cache / f"transformers-{version}.tar.gz"
    if not path.is_file() or path.stat().st_size == 0:
        _pip_download(["--no-binary", ":all:", f"transformers=={version}"], cache, f"the transformers {version} sdist")
        if not path.is_file():
            raise Unavailable(f"pip download left no {path}")
    return path


def _helper_wheels(version):
    wheels = cache_dir(version) / "wheels"
    found = []
    for req in HELPERS:
        name, ver = req.split("==")
        hits = sorted(wheels.glob(f"{name}-{ver}-*.whl")) if wheels.is_dir() else []
        if not hits:
            _pip_download(["--only-binary", ":all:", req], wheels, req)
            hits = sorted(wheels.glob(f"{name}-{ver}-*.whl"))
            if not hits:
                raise Unavailable(f"pip download left no wheel of {req} in {wheels}")
        found.append(hits[0])
    return found


def assemble(dest, version=None):
    """Build `dest/hf_sdist_tests/` (+ helper packages in `dest/`); returns the list of mixin files extracted.
    Put `dest` on sys.path / PYTHONPATH to import `hf_sdist_tests.test_modeling_common` etc."""
    if version is None:
        import transformers

        version = transformers.__version__
    dest = Path(dest)
    pkg = dest / PACKAGE
    if pkg.exists():
        shutil.rmtree(pkg)
    pkg.mkdir(parents=True)
    top = f"transformers-{version}/tests/"
    names = []
    try:
        with tarfile.open(sdist_path(version)) as tar:
            for member in tar.getmembers():
                rel = member.name[len(top):] if member.name.startswith(top) else None
                if rel and "/" not in rel and rel.startswith("test_") and rel.endswith(".py") and member.isfile():
                    with tar.extractfile(member) as src, open(pkg / rel, "wb") as out:
                        shutil.copyfileobj(src, out)
                    names.append(rel)
    except (tarfile.TarError, OSError) as exc:
        raise Unavailable(f"cannot read the transformers {version} sdist: {exc}") from exc
    if "test_modeling_common.py" not in names:
        raise Unavailable(f"the transformers {version} sdist has no tests/test_modeling_common.py")
    (pkg / "__init__.py").write_text("# transformers' sdist tests/test_*.py, assembled by tests/hf_common/sdist.py\n")
    for ours, where in STANDINS.items():
        target = pkg / where
        target.parent.mkdir(parents=True, exist_ok=True)
        init = target.parent / "__init__.py"
        if target.parent != pkg and not init.exists():
            init.write_text("")
        shutil.copyfile(HERE / "standins" / ours, target)
    for wheel in _helper_wheels(version):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(dest)
    return sorted(names)
