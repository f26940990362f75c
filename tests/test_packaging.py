"""The wheel carries kernels_cu: build it, install it into a fresh venv
outside the repository, and compile a kernel from the installed copy."""
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(REPO)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("swiglu_cupy-*.whl")
    return whl


def test_wheel_contains_the_kernel_sources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for source in sorted(p.name for p in (REPO / "kernels_cu").iterdir()):
        assert f"swiglu_cupy/kernels_cu/{source}" in names
    assert "swiglu_cupy/__init__.py" in names


def test_installed_wheel_compiles_its_own_kernels(wheel, tmp_path):
    venv = tmp_path / "venv"
    # System site-packages supply torch/cupy/nvidia wheels; the package itself
    # comes only from the wheel (the venv's site-packages come first).
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    script = textwrap.dedent("""
        import torch, swiglu_cupy
        from pathlib import Path
        from swiglu_cupy import _sources
        from swiglu_cupy.compile_check import compile_module
        pkg = Path(swiglu_cupy.__file__).resolve().parent
        assert str(pkg).startswith(str(Path(%r).resolve())), pkg
        assert _sources.kernel_dir() == pkg / "kernels_cu", _sources.kernel_dir()
        reports, cubin = compile_module(torch.bfloat16, "sm_90")
        assert len(cubin) > 0 and {r.kernel for r in reports} == set(_sources.kernel_names())
        print("OK", pkg)
    """ % str(venv))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(python), "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK")
