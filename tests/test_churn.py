"""Resource hygiene under churn: many Loaders opened and closed, some of them killed with
SIGKILL mid-read, leave no process, file descriptor, socket directory or /dev/shm segment
behind once the next Loader's sweep has run. ``make test`` runs a short churn; the full one
(200 Loaders) is marked slow."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import _foreign, _private_dirs, _segments
from zloader import Loader, Pipeline

KILLED = """
import sys
from zloader import Loader, Pipeline
loader = Loader(Pipeline.range(10**9).map(lambda x: x), num_workers=1, timeout=30)
for i, x in enumerate(loader):
    if i == 50:
        print("reading", flush=True)
"""


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def own_segments() -> set[str]:
    """The zloader segments not of another live test process (tests may run two at a
    time): a killed trainer's count, until a sweep removes them."""
    return {name for name in _segments() if not _foreign(name, 2)}


def own_dirs() -> set[str]:
    return {name for name in _private_dirs() if not _foreign(name, 1)}


def churn(loaders: int, kill_every: int) -> None:
    fds = open_fds()
    segments, dirs = own_segments(), own_dirs()
    for n in range(loaders):
        if n % kill_every == kill_every - 1:
            # A trainer killed hard while reading: its worker notices its parent is gone.
            process = subprocess.Popen([sys.executable, "-c", KILLED], stdout=subprocess.PIPE,
                                       text=True, start_new_session=True)
            assert process.stdout is not None
            assert process.stdout.readline().strip() == "reading"
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            process.stdout.close()
            continue
        with Loader(Pipeline.range(50 + n), num_workers=1, timeout=30) as loader:
            if n % 2:
                assert sorted(loader) == list(range(50 + n))
            else:  # left mid-epoch
                next(iter(loader))
    # The next Loader sweeps what the killed ones left (their segments and directories).
    with Loader(Pipeline.range(5), num_workers=1, timeout=30) as loader:
        assert sorted(loader) == list(range(5))
    assert open_fds() == fds
    assert own_segments() <= segments, sorted(own_segments() - segments)
    assert own_dirs() <= dirs, sorted(own_dirs() - dirs)


def ring_fds() -> set[str]:
    """This process's descriptors of shared-memory rings."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if "-ring-" in os.readlink(f"/proc/self/fd/{fd}"):
                found.add(fd)
    return found


def test_a_loader_closed_mid_epoch_holds_no_ring_and_still_says_where_it_was():
    """Records received and never read, and the origins of the one under way, pointed
    into the rings: a closed Loader kept them mapped until the garbage collector found
    it (so a churn of Loaders piled up descriptors). The garbage collector is off here, so
    only close() can let them go."""
    before = ring_fds()
    gc.disable()
    try:
        with Loader(Pipeline.range(500), num_workers=1, timeout=30) as loader:
            elements = iter(loader)
            next(elements)
            del elements
        assert ring_fds() == before
        assert loader.state_dict()["epoch"] == 0  # the epoch under way, as before close
    finally:
        gc.enable()


@pytest.mark.slow
def test_a_short_churn_leaves_nothing_behind():
    churn(8, kill_every=4)


@pytest.mark.slow
def test_two_hundred_loaders_leave_nothing_behind():
    churn(200, kill_every=5)
