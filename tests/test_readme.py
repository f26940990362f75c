"""The README's first commands are what CI runs, in a fresh venv."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_commands_in_a_fresh_venv():
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert first_block[0].startswith('pip install -e ".[')
    assert first_block[1] == "python -m pytest -q"
    assert first_block[2] == "python examples/quickstart.py"
    ci_lines = [line.split("#")[0].strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    # Command 1's extras hold the CUDA 13 wheels, the test extra and transformers, named or through `dev`.
    extras = set(re.match(r'pip install -e "\.\[([\w,]+)\]"', first_block[0]).group(1).split(","))
    if "dev" in extras:
        dev = re.search(r'^dev = \["swiglu-cupy\[([\w,]+)\]"\]$', (REPO / "pyproject.toml").read_text(), re.M)
        extras = (extras - {"dev"}) | set(dev.group(1).split(","))
    assert {"cuda13", "test", "hf"} <= extras, extras
    for command in first_block:
        assert command in ci_lines, command
    venv = next(i for i, line in enumerate(ci_lines) if line.startswith("python -m venv "))
    activate = next(i for i, line in enumerate(ci_lines) if line.startswith("source ") and "/bin/activate" in line)
    assert venv < activate < min(ci_lines.index(command) for command in first_block)


def _release(version):
    """'2.11' and '2.11.0' both -> (2, 11, 0)."""
    parts = [int(p) for p in version.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_ci_floor_run_pins_the_declared_minimums():
    """The floor run of .ci/run installs exactly the minimum torch,
    transformers and CuPy that pyproject.toml declares, so the declared floor
    is a tested one; the README's tested-versions table names the same
    versions."""
    pyproject = (REPO / "pyproject.toml").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    floor_install = [line for line in ci.splitlines()
                     if 'pip install -e ".[' in line and "torch==" in line.split("#")[0]]
    assert len(floor_install) == 1, floor_install
    pins = dict(re.findall(r"\b(torch|transformers|cupy-cuda13x)==([\d.]+)", floor_install[0]))
    for package in ("torch", "transformers", "cupy-cuda13x"):
        declared = re.findall(rf'"{package}>=([\d.]+)"', pyproject)
        assert len(declared) == 1, (package, declared)
        assert _release(pins[package]) == _release(declared[0]), (package, pins[package], declared[0])
        assert f"`{package}` | {pins[package]}" in readme, package
    # torch goes in first on its own, pinned, as in the first run.
    assert f"-m pip install torch=={pins['torch']}\n" in ci


def test_ci_installs_the_peer_libraries_in_both_venvs_pinned():
    """README command 1 installs the peers' requirement files with --no-deps
    (a plain install would pull a CUDA torch): all-peers.txt, which is
    peers.txt and torchtitan.txt; the floor venv gets the same peers.txt, so
    the libraries are tested at the floor too; every peer there is pinned to
    the version the docs name."""
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    command = re.search(r"```bash\n(.*?)\n", readme).group(1)
    assert "pip install --no-deps -r tests/requirements/all-peers.txt" in command
    all_peers = [line.strip() for line in (REPO / "tests" / "requirements" / "all-peers.txt").read_text().splitlines()
                 if line.strip() and not line.startswith("#")]
    assert all_peers == ["-r peers.txt", "-r torchtitan.txt"], all_peers
    assert '"$floor/bin/python" -m pip install --no-deps -r tests/requirements/peers.txt\n' in ci
    peers = [line.strip() for line in (REPO / "tests" / "requirements" / "peers.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert peers and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[\w.]+", line) for line in peers), peers


def test_ci_first_run_installs_the_torch_the_readme_names():
    """The first run's torch (with its torchvision and timm) is pinned in
    .ci/run, and README step 1 names that very command."""
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    lines = [line for line in ci.splitlines() if line.startswith("python -m pip install torch==")]
    assert len(lines) == 1, lines
    command = lines[0].split("#")[0].strip().removeprefix("python -m ")
    assert re.fullmatch(r"pip install torch==[\d.]+ torchvision==[\d.]+ timm==[\d.]+", command), command
    assert f"`{command}`" in readme, command
