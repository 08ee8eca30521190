"""The README's Python snippets run as written, and `zloader fingerprint` imports the
user's module from the working directory (as `python -m` does)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from tests.service import BIN

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def snippets() -> list[str]:
    """The README's ```python blocks that run on this host alone (no broker address)."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)
    return [block for block in blocks if "tcp://" not in block]


@pytest.mark.slow  # imports torch and tensorflow in a fresh interpreter
def test_the_readme_python_snippets_run_in_order():
    """Each snippet runs after the ones before it, as a reader would paste them: the
    pipeline of "A pipeline" feeds the service and adapter snippets; a map-style torch
    dataset stands for the reader's own."""
    prelude = ("import torch\n"
               "dataset = torch.utils.data.TensorDataset(torch.arange(256.0))\n"
               "del torch\n")
    program = prelude + "\n".join(f"exec(compile({block!r}, 'README snippet {i}', 'exec'))"
                                  for i, block in enumerate(snippets()))
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0, done.stderr[-3000:]


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
