"""Every Python code block of README.md and docs/*.md runs as written, each in a fresh
interpreter; and `zloader fingerprint` imports the user's module from the working directory
(as `python -m` does).

A block that needs what a test host lacks says so on a line of its own,
``# requires: cluster`` (a broker and workers elsewhere), ``gpu`` or ``network``, and is
skipped for that reason, though it must still compile. Blocks that are not Python name
another fence language (``sh``, ``text``, ``yaml``), so no Python hides in an unlabelled
block."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from tests.service import BIN

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS = {"cluster", "gpu", "network"}
REQUIRES = re.compile(r"^# requires: (\w+)", re.MULTILINE)
HEAVY = re.compile(r"^import .*\b(zloader\.tf|tensorflow)\b", re.MULTILINE)
BLOCK_SECONDS = 120


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: str  # relative to the repository
    line: int  # of its opening fence
    language: str
    code: str

    @property
    def requires(self) -> list[str]:
        return REQUIRES.findall(self.code)


def blocks(path: pathlib.Path) -> list[Block]:
    """The fenced code blocks of a markdown page, in order."""
    found: list[Block] = []
    opening: tuple[int, str] | None = None
    body: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.startswith("```"):
            if opening is not None:
                body.append(line)
            continue
        if opening is None:
            opening, body = (number, line[3:].strip()), []
        else:
            page = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
            found.append(Block(page, opening[0], opening[1], "\n".join(body) + "\n"))
            opening = None
    assert opening is None, f"{path.name}: the block opened on line {opening[0]} never closes"
    return found


ALL = [block for page in PAGES for block in blocks(page)]
PYTHON = [block for block in ALL if block.language == "python"]


def as_param(block: Block) -> object:
    marks = [pytest.mark.slow] if HEAVY.search(block.code) else []  # tensorflow: ~10 s
    return pytest.param(block, marks=marks, id=f"{block.page}:{block.line}")


def test_every_code_block_names_its_language():
    unlabelled = [f"{b.page}:{b.line}" for b in ALL if not b.language]
    assert not unlabelled, f"code blocks without a language (python, sh, text...): {unlabelled}"
    assert len(PYTHON) >= 12  # the parser still finds them


@pytest.mark.parametrize("block", [as_param(block) for block in PYTHON])
def test_python_block_runs_as_written(block: Block, tmp_path: pathlib.Path):
    """The block runs alone in a fresh interpreter, in an empty working directory, and
    exits cleanly; a block marked ``# requires: X`` is skipped, but must compile."""
    unknown = set(block.requires) - NEEDS
    assert not unknown, f"{block.page}:{block.line}: unknown requirement {unknown} ({NEEDS})"
    compile(block.code, f"{block.page}:{block.line}", "exec")
    if block.requires:
        marker = re.search(r"^# (requires: .*)$", block.code, re.MULTILINE)
        pytest.skip(f"{block.page}:{block.line} {marker.group(1) if marker else ''}")
    done = subprocess.run(
        [sys.executable, "-c", block.code], capture_output=True, text=True, cwd=tmp_path,
        timeout=BLOCK_SECONDS,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, (f"{block.page}:{block.line} failed:\n"
                                  f"{done.stderr[-3000:]}")


def test_a_fragment_fails_and_an_unclosed_block_is_an_error(tmp_path: pathlib.Path):
    """What the checks are for: a fragment that uses a name it never defines fails as a
    run block would, and a block never closed is reported."""
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nfor batch in loader:\n    pass\n```\n")
    (fragment,) = blocks(page)
    assert (fragment.line, fragment.language) == (3, "python")
    done = subprocess.run([sys.executable, "-c", fragment.code], capture_output=True,
                          text=True, cwd=tmp_path, timeout=BLOCK_SECONDS)
    assert done.returncode != 0 and "NameError: name 'loader'" in done.stderr
    page.write_text("```python\nprint(1)\n")
    with pytest.raises(AssertionError, match="never closes"):
        blocks(page)


def test_fingerprint_imports_a_module_from_the_working_directory(tmp_path):
    """`zloader fingerprint data:pipeline` run where data.py lies finds it (the console
    script's sys.path starts with its own directory, not the working one), and prints the
    fingerprint the pipeline has in-process; a missing module is a clear error."""
    (tmp_path / "data.py").write_text(textwrap.dedent("""
        from zloader import Pipeline

        pipeline = Pipeline.range(100).map(lambda x: x * 2)
        """))
    done = subprocess.run([os.path.join(BIN, "zloader"), "fingerprint", "data:pipeline"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    expected = subprocess.run(
        [sys.executable, "-c", "import data; print(data.pipeline.fingerprint)"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.stdout.split() == expected.stdout.split() and len(done.stdout.split()[0]) == 64
    missing = subprocess.run([os.path.join(BIN, "zloader"), "fingerprint", "nowhere:p"],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "cannot import nowhere" in missing.stderr
