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
    for command in first_block:
        assert command in ci_lines, command
    venv = next(i for i, line in enumerate(ci_lines) if line.startswith("python -m venv "))
    activate = next(i for i, line in enumerate(ci_lines) if line.startswith("source ") and "/bin/activate" in line)
    assert venv < activate < min(ci_lines.index(command) for command in first_block)
