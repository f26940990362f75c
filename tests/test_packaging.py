"""The wheel carries kernels_cu: build it, install it into a fresh directory
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


def test_wheel_contains_the_kernel_sources_and_every_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for source in sorted(p.name for p in (REPO / "kernels_cu").iterdir()):
        assert f"swiglu_cupy/kernels_cu/{source}" in names
    modules = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "swiglu_cupy").rglob("*.py"))
    assert {f"swiglu_cupy/{sub}/__init__.py" for sub in ("kernels", "primitives", "dense", "moe", "integrations",
                                                       "tools", "tools/bench")} <= set(modules)  # subpackages included
    for module in modules:
        assert module in names, module


def test_installed_wheel_compiles_its_own_kernels(wheel, tmp_path):
    """The wheel goes into its own directory, which leads sys.path of the
    interpreter running this suite. That interpreter keeps its own site setup
    (venv, system, conda, user site), so torch, CuPy and the nvidia wheels,
    and the NVRTC that CuPy locates through ``site.getsitepackages()``, are
    found as they are here; a nested venv would see other site-packages.

    The checkout follows the wheel on sys.path, as an editable install's
    ``.pth`` puts it after site-packages: every swiglu_cupy module must still
    come from the wheel."""
    target = tmp_path / "installed"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                           "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    script = textwrap.dedent("""
        import sys, torch, swiglu_cupy
        from pathlib import Path
        from swiglu_cupy.kernels import sources as _sources
        from swiglu_cupy.kernels.compile_check import compile_module
        pkg = Path(%r).resolve() / "swiglu_cupy"
        assert Path(swiglu_cupy.__file__).resolve().parent == pkg, swiglu_cupy.__file__
        assert _sources.kernel_dir() == pkg / "kernels_cu", _sources.kernel_dir()
        reports, cubin = compile_module(torch.bfloat16, "sm_90")
        assert len(cubin) > 0 and {r.kernel for r in reports} == set(_sources.kernel_names())
        elsewhere = sorted(name for name, mod in list(sys.modules.items())
                           if name.split(".")[0] == "swiglu_cupy" and getattr(mod, "__file__", None)
                           and not Path(mod.__file__).resolve().is_relative_to(pkg))
        assert not elsewhere, elsewhere
        print("OK", pkg)
    """ % str(target))
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(REPO), *inherited]))
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK")
