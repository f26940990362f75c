"""The documentation stays true: README.md and every page under docs/.

1. Every ```python block runs on the CPU (each in a fresh namespace, all of
   them in one subprocess, so nothing a block does reaches this process), or
   is marked as not runnable here by an HTML comment on the line just before
   it, ``<!-- not run: REASON -->``. An unmarked block that raises fails; so
   does a marker without a reason, or one that is not followed by a python
   block. A block that needs an optional package that is not installed
   (transformers, peft, xformers, ...) is skipped, as the rest of the suite
   skips without it.
2. Every test file a page names (``test_x.py``, ``tests/test_x.py``,
   ``test_x.py::test_name`` or ``::test_prefix*``) exists, with that test.
3. Every public name written as ``swiglu_cupy.X``, ``swiglu_cupy.X.Y`` or
   ``sc.X`` imports (module) or resolves (attribute).
4. Every relative link resolves, anchors included; every repository path
   (``swiglu_cupy/...``, ``tests/...``, ``examples/...``, ``kernels_cu/...``)
   and every file name in backticks (``name.py``) exists; every
   ``python -m swiglu_cupy CMD`` is a command of the CLI.

The checkers are plain functions of a markdown string; the last tests run
them on small synthetic pages to show that each one catches what it is for.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Optional packages: a block that needs one that is not installed is skipped, not failed.
OPTIONAL = {"transformers", "peft", "xformers", "accelerate", "onnx", "onnxruntime", "onnxscript"}
RUN_TIMEOUT_S = 900


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


# ---- 1. code blocks ------------------------------------------------------------------------

FENCE = re.compile(r"^\s*```\s*([\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*not run\b\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclasses.dataclass
class Block:
    page: str
    line: int                 # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None        # the reason of a "not run" marker just before it; None: no marker


def parse(text: str, page: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a page, and the problems with its markers."""
    lines = text.splitlines()
    blocks, problems = [], []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            marker = MARKER.match(lines[i])
            if marker is not None:
                nxt = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
                if nxt is None or nxt.group(1) != "python":
                    problems.append(f"{page}:{i + 1}: a 'not run' marker that is not just before a python block")
            elif "<!--" in lines[i] and re.search(r"not[\s_-]*run", lines[i], re.I):
                problems.append(f"{page}:{i + 1}: malformed 'not run' marker (want <!-- not run: REASON -->)")
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        body = []
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            problems.append(f"{page}:{start + 1}: unclosed code block")
        i += 1
        before = MARKER.match(lines[start - 1]) if start > 0 else None
        reason = None if before is None else (before.group(1) or "").strip()
        if reason == "":
            problems.append(f"{page}:{start}: a 'not run' marker without a reason")
        blocks.append(Block(page, start + 1, lang, "\n".join(body) + "\n", reason))
    return blocks, problems


RUNNER = r"""
import json, sys, traceback
OPTIONAL = set(json.loads(sys.argv[2]))
blocks = json.load(open(sys.argv[1]))
results = []
for b in blocks:
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)
    namespace = {"__name__": "__doc_block__"}
    try:
        exec(compile(b["code"], b["name"], "exec"), namespace)
        results.append({"status": "ok"})
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top in OPTIONAL:
            results.append({"status": "skip", "detail": f"needs {top}, which is not installed"})
        else:
            results.append({"status": "error", "detail": traceback.format_exc()})
    except BaseException:
        results.append({"status": "error", "detail": traceback.format_exc()})
    sys.stdout.flush()
json.dump(results, open(sys.argv[1] + ".out", "w"))
"""


def run_blocks(blocks: list[Block], timeout: float = RUN_TIMEOUT_S) -> list[dict]:
    """Run each block in a fresh namespace, all in one fresh interpreter;
    one result per block: status ok / skip / error (with the traceback)."""
    if not blocks:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "blocks.json")
        with open(path, "w") as f:
            json.dump([{"name": f"<{b.page}:{b.line}>", "code": b.code} for b in blocks], f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-c", RUNNER, path, json.dumps(sorted(OPTIONAL))], cwd=tmp,
                              env=env, capture_output=True, text=True, timeout=timeout)
        out = path + ".out"
        if not os.path.exists(out):
            detail = f"the block runner died (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            return [{"status": "error", "detail": detail} for _ in blocks]
        with open(out) as f:
            return json.load(f)


def block_problems(text: str, page: str) -> tuple[list[str], list[Block], list[dict]]:
    """Marker problems plus one problem per unmarked python block that
    raises; also the runnable blocks and their results."""
    blocks, problems = parse(text, page)
    runnable = [b for b in blocks if b.lang == "python" and b.marker is None]
    results = run_blocks(runnable)
    for b, r in zip(runnable, results):
        if r["status"] == "error":
            problems.append(f"{b.page}:{b.line}: this python block fails (mark it '<!-- not run: why -->' if "
                            f"it cannot run here):\n{r['detail']}")
    return problems, runnable, results


# ---- 2.-4. names, files, links ---------------------------------------------------------------

TEST_REF = re.compile(r"(?<![\w/])(?:tests/)?(test_\w+\.py)(?:::(test_\w+)(\*)?)?")
NAME_REF = re.compile(r"(?<![\w.])(swiglu_cupy|sc)((?:\.[A-Za-z_]\w*)+)")
PATH_REF = re.compile(r"(?<![\w/.-])((?:swiglu_cupy|tests|examples|kernels_cu|docs|\.ci)/[\w./-]*\w)(?![\w*])")
FILE_REF = re.compile(r"`(\w+\.py)`")
# A path inside the package written from below swiglu_cupy/ (`dense/functions.py`).
PACKAGE_PATH_REF = re.compile(r"`((?:\w+/)+\w+\.(?:py|cuh?))`")
CLI_REF = re.compile(r"(?:python -m swiglu_cupy|(?<![\w-])swiglu-cupy) ([a-z][\w-]*)")
ROOTS = ("swiglu_cupy", "tests", "examples", "kernels_cu", "docs", ".ci")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def resolve_name(dotted: str) -> None:
    """Import the longest module prefix of ``dotted``, then getattr the rest."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] in OPTIONAL:
                raise
            continue
        for attr in parts[k:]:
            obj = getattr(obj, attr)
        return
    raise ModuleNotFoundError(dotted)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def cli_commands() -> set[str]:
    import argparse

    from swiglu_cupy.subcommands import build_parser

    parser = build_parser()
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    return set()


def reference_problems(text: str, page_path: Path, repo: Path = REPO) -> list[str]:
    try:
        page = page_path.resolve().relative_to(repo).as_posix()
    except ValueError:
        page = str(page_path)
    problems = []
    for m in TEST_REF.finditer(text):
        test_file = repo / "tests" / m.group(1)
        if not test_file.exists():
            problems.append(f"{page}: names {m.group(1)}, which is not in tests/")
        elif m.group(2):
            source = test_file.read_text()
            pattern = rf"def {m.group(2)}" + ("" if m.group(3) else r"\b")
            if not re.search(pattern, source):
                problems.append(f"{page}: names {m.group(0)}, which {m.group(1)} does not define")
    for m in NAME_REF.finditer(text):
        dotted = "swiglu_cupy" + m.group(2)
        try:
            resolve_name(dotted)
        except ImportError as exc:
            if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] in OPTIONAL:
                continue
            problems.append(f"{page}: names {m.group(0)}, which does not import ({exc})")
        except AttributeError:
            problems.append(f"{page}: names {m.group(0)}, which does not exist")
    for m in PATH_REF.finditer(text):
        if not (repo / m.group(1)).exists():
            problems.append(f"{page}: names the path {m.group(1)}, which does not exist")
    known_files = {p.name for top in ("swiglu_cupy", "tests", "examples") for p in (repo / top).rglob("*.py")}
    known_files |= {p.name for p in repo.glob("*.py")}
    for m in PACKAGE_PATH_REF.finditer(text):
        path = m.group(1)
        if path.split("/")[0] not in ROOTS and not (repo / "swiglu_cupy" / path).exists():
            problems.append(f"{page}: names swiglu_cupy/{path}, which does not exist")
    for m in FILE_REF.finditer(text):
        if not m.group(1).startswith("test_") and m.group(1) not in known_files:  # test files: TEST_REF
            problems.append(f"{page}: names the file {m.group(1)}, which is nowhere in the package, tests or examples")
    commands = cli_commands()
    for m in CLI_REF.finditer(text):
        if m.group(1) not in commands:
            problems.append(f"{page}: names the command '{m.group(0)}'; the CLI has {sorted(commands)}")
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page_path.parent / file_part).resolve() if file_part else page_path
        if not dest.exists():
            problems.append(f"{page}: links to {target}, which does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{page}: links to {target}, but {dest.name} has no heading #{anchor}")
    return problems


# ---- the real pages --------------------------------------------------------------------------

_RESULTS: dict = {}


def _page_blocks(page: Path):
    """(runnable blocks, results) of ``page``; every page's blocks run in one
    subprocess, the first time any is asked for (one torch import, not one per page)."""
    if not _RESULTS:
        runnable = {p: [b for b in parse(p.read_text(), rel(p))[0] if b.lang == "python" and b.marker is None]
                    for p in PAGES}
        results = iter(run_blocks([b for p in PAGES for b in runnable[p]]))
        for p in PAGES:
            _RESULTS[p] = (runnable[p], [next(results) for _ in runnable[p]])
    return _RESULTS[page]


def _runnable_ids():
    out = []
    for page in PAGES:
        blocks, _ = parse(page.read_text(), rel(page))
        out += [(page, i, f"{rel(page)}:{b.line}")
                for i, b in enumerate(b for b in blocks if b.lang == "python" and b.marker is None)]
    return out


def test_there_are_pages_and_blocks_to_check():
    assert (REPO / "docs").is_dir() and len(PAGES) > 5
    assert len(_runnable_ids()) >= 10


@pytest.mark.parametrize("page,index", [(p, i) for p, i, _ in _runnable_ids()],
                         ids=[name for _, _, name in _runnable_ids()])
def test_python_block_runs_on_the_cpu(page, index):
    runnable, results = _page_blocks(page)
    block, result = runnable[index], results[index]
    if result["status"] == "skip":
        pytest.skip(result["detail"])
    assert result["status"] == "ok", f"{block.page}:{block.line}:\n{block.code}\n{result['detail']}"


@pytest.mark.parametrize("page", PAGES, ids=[rel(p) for p in PAGES])
def test_not_run_markers_have_reasons(page):
    _, problems = parse(page.read_text(), rel(page))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=[rel(p) for p in PAGES])
def test_named_tests_names_paths_links_and_commands_exist(page):
    problems = reference_problems(page.read_text(), page)
    assert not problems, "\n".join(problems)


def test_readme_stays_short_and_links_every_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 210
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, page.name


# ---- the checkers on synthetic pages ---------------------------------------------------------

SYNTHETIC = """# A page
```python
raise ValueError("boom")
```
<!-- not run: needs a CUDA GPU -->
```python
raise RuntimeError("a marked block must never run")
```
```python
x = 1 + 1
assert x == 2
```
<!-- not run -->
```python
pass
```
<!-- not run: a marker before nothing -->
Some text.
<!-- not-run: typo -->
```bash
echo a bash block is not executed
```
"""


def test_checker_reports_an_unmarked_failing_block_and_bad_markers():
    problems, runnable, results = block_problems(SYNTHETIC, "synthetic.md")
    # The failing block, the marker without a reason, the stray marker, the malformed one.
    assert len(problems) == 4, problems
    failing = [p for p in problems if "fails" in p]
    assert len(failing) == 1 and failing[0].startswith("synthetic.md:2:") and "boom" in failing[0]
    assert any("without a reason" in p for p in problems)
    assert any("not just before a python block" in p for p in problems)
    assert any("malformed" in p for p in problems)
    # Marked blocks are not run; the unmarked ones are, the good one passes.
    assert [r["status"] for r in results] == ["error", "ok"]
    assert all("never run" not in b.code for b in runnable)


def test_checker_passes_a_clean_page_and_skips_missing_optional_packages():
    page = "```python\nimport transformers_is_not_this\n```\n"
    problems, _, results = block_problems(page, "p.md")
    assert problems and results[0]["status"] == "error"   # an unknown module is an error
    OPTIONAL.add("an_optional_package_that_is_not_installed")
    try:
        page = "```python\nimport an_optional_package_that_is_not_installed\n```\n"
        problems, _, results = block_problems(page, "p.md")
    finally:
        OPTIONAL.discard("an_optional_package_that_is_not_installed")
    assert not problems and results[0]["status"] == "skip"


def test_reference_checker_catches_stale_names_files_paths_links_and_commands(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text("# A page\n")
    good = ("`test_api.py`, `tests/test_docs.py::test_readme_stays_short_and_links_every_page`, "
            "`test_transforms.py::test_export_*`, `swiglu_cupy.hf.patch_model`, `sc.SwiGLU`, "
            "`swiglu_cupy/kernels/launch.py`, `dense/functions.py`, `reference.py`, `python -m swiglu_cupy info`, "
            "[x](other.md#a-section), [y](#a-page), `torch.ops.swiglu_cupy.swiglu_forward`\n")
    assert reference_problems("# A page\n" + good, page) == []
    stale = ("`test_nothing_here.py`, `test_api.py::test_no_such_test`, `swiglu_cupy.launch_config`, "
             "`sc.NoSuchThing`, `swiglu_cupy/functions.py`, `kernels/_launch.py`, `_launch.py`, `python -m swiglu_cupy frobnicate`, "
             "[x](missing.md), [y](other.md#no-such-section)\n")
    problems = reference_problems("# A page\n" + stale, page)
    assert len(problems) == 10, "\n".join(problems)
