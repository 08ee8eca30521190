"""Fixtures shared by every test. The autouse ``no_leaks`` fixture fails a test that leaves
a child process, a zloader shared-memory segment or an embedded Loader's socket directory
behind (design invariant 4)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import psutil
import pytest

SHM_DIR = "/dev/shm"


def _segments() -> set[str]:
    try:
        return {name for name in os.listdir(SHM_DIR) if "zloader" in name.lower()}
    except FileNotFoundError:  # pragma: no cover - not Linux
        return set()


def _private_dirs() -> set[str]:
    """Embedded Loaders' socket directories (tempfile's zloader-* folders)."""
    import tempfile

    root = tempfile.gettempdir()
    return {name for name in os.listdir(root) if name.startswith("zloader-")}


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _foreign(name: str, at: int) -> bool:
    """Whether segment or directory ``name``, whose creator's pid is its ``at``-th dash
    part (``zloader-<uid>-<pid>-...``: 2, ``zloader-<pid>-...``: 1), belongs to a live
    process outside this test run: another test session running at the same time on this
    machine, not a leak of this one."""
    parts = name.split("-")
    if len(parts) <= at or not parts[at].isdigit():
        return False
    pid = int(parts[at])
    if pid == os.getpid() or not psutil.pid_exists(pid):
        return False
    return pid not in _children()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    segments_before = _segments()
    children_before = _children()
    dirs_before = _private_dirs()
    yield
    deadline = time.monotonic() + 5.0  # give exiting children a moment to be reaped
    while True:
        new_children = _children() - children_before
        new_segments = {n for n in _segments() - segments_before if not _foreign(n, 2)}
        new_dirs = {n for n in _private_dirs() - dirs_before if not _foreign(n, 1)}
        if not (new_children or new_segments or new_dirs) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not new_children, f"test left child processes behind: {sorted(new_children)}"
    assert not new_segments, f"test left shared-memory segments behind: {sorted(new_segments)}"
    assert not new_dirs, f"test left Loader socket directories behind: {sorted(new_dirs)}"
