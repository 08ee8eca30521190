"""A Loader belongs to the process that made it: a forked child that uses it gets an
error at once (not a wait for data that never comes), and a child that merely exits
leaves the parent's Loader working and prints nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from zloader import Loader, Pipeline


def _in_child(loader: Loader, action: str) -> str:
    """Fork; the child runs ``action`` on ``loader`` and writes what happened to a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        try:
            if action == "iterate":
                out = f"yielded {len(list(loader))}"
            elif action == "next":
                out = f"yielded {next(loader)}"  # type: ignore[call-overload]
            else:
                out = f"state {loader.state_dict()}"
        except RuntimeError as exc:
            out = f"raised {exc}"
        os.write(write, out.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read().decode()
    os.waitpid(pid, 0)
    return out


@pytest.mark.timeout(60)
def test_a_forked_child_using_its_parents_loader_raises_at_once():
    with Loader(Pipeline.range(100), num_workers=1, timeout=30) as loader:
        assert sorted(loader) == list(range(100))
        for action in ("iterate", "state"):
            out = _in_child(loader, action)
            assert out.startswith("raised") and "forked child" in out, out
        iterator = iter(loader)
        first = next(iterator)
        out = _in_child(iterator, "next")  # an iterator made in the parent
        assert out.startswith("raised") and "forked child" in out, out
        assert sorted([first, *iterator]) == list(range(100))  # the parent reads on


def test_a_child_that_exits_leaves_the_parents_loader_working_and_says_nothing():
    script = textwrap.dedent("""
        import os, sys
        from zloader import Loader, Pipeline
        loader = Loader(Pipeline.range(50), num_workers=1, timeout=30)
        assert sorted(loader) == list(range(50))
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # the interpreter exits: finalizers run in the child
        os.waitpid(pid, 0)
        assert sorted(loader) == list(range(50))
        loader.close()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "Exception ignored" not in done.stderr and "Error" not in done.stderr, done.stderr
