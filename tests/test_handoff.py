"""The dataset's lists packed after the fork (zloader/handoff.py): forked workers start on
the lists as they are and switch to the packed copy a packer process makes meanwhile,
never dropping what they wrote, never waiting for a packer that died, leaking nothing."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import time
from typing import Any

import psutil
import pytest
import torch
import torch.utils.data

import zloader
import zloader.torch as zt
from zloader import _native, handoff

pytestmark = pytest.mark.skipif(not handoff.available(),
                                reason="this Python packs before the fork")


class Paths(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """(path, label) samples; each sample says what its worker reads them from, and
    counts, in a list of the dataset's own, the samples its worker made so far."""

    def __init__(self, size: int) -> None:
        self.samples = [(f"/data/img_{i:08d}.jpg", i % 10) for i in range(size)]
        self.made = [0] * size  # a memo-like list the workers write into

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[str, int, int]:
        self.samples[index]  # (read, as a dataset reads its samples)
        self.made[0] += 1
        return type(self.samples).__name__, os.getpid(), self.made[0]


def _epoch(loader: Any) -> list[tuple[str, int, int]]:
    try:
        return [tuple(row) for batch in loader for row in zip(*batch, strict=True)]
    finally:
        loader.close()


def test_workers_switch_to_the_packed_copy_and_keep_a_list_they_wrote():
    rows = _epoch(zt.DataLoader(Paths(200_000), batch_size=512, num_workers=2,
                                shuffle=True, collate_fn=lambda b: list(zip(*b, strict=True))))
    assert len(rows) == 200_000
    kinds = [kind for kind, _, _ in rows]
    assert kinds[-1] == "PackedSequence"  # the packed copy, once ready
    by_worker: dict[int, list[int]] = collections.defaultdict(list)
    for _, pid, made in rows:
        by_worker[pid].append(made)
    for counts in by_worker.values():  # ``made`` was written before its copy came: kept
        assert counts == sorted(counts) and len(set(counts)) == len(counts)


def test_a_packer_that_dies_leaves_the_lists_to_the_workers():
    dataset = Paths(300_000)
    pipeline = zloader.Pipeline.from_torch(dataset, split_size=20_000)
    with zloader.Loader(pipeline, num_workers=2, timeout=60) as loader:
        os.kill(_packer(loader), signal.SIGKILL)  # (killed before or while it packs)
        started = time.monotonic()
        rows = list(loader)
        assert time.monotonic() - started < 50  # does not wait out HANDOFF_WAIT_SECONDS
    assert len(rows) == 300_000
    assert {kind for kind, _, _ in rows} <= {"list", "PackedSequence"}


def _packer(loader: zloader.Loader) -> int:
    """The pid of ``loader``'s packer (noted in the handoff's table by whoever forked it)."""
    handed = loader._embedded.handoff
    assert handed is not None
    deadline = time.monotonic() + 30
    while not int(handed.head[0]):
        assert time.monotonic() < deadline, "no packer was forked"
        time.sleep(0.001)
    return int(handed.head[0])


def _memfds() -> int:
    folder = "/proc/self/fd"
    count = 0
    for name in os.listdir(folder):
        with contextlib.suppress(OSError):
            count += os.readlink(f"{folder}/{name}").startswith("/memfd:zloader-packed")
    return count


@pytest.mark.parametrize("workers", [1, 3])
def test_the_loader_holds_no_memfd_and_its_packer_is_reaped(workers: int):
    before = _memfds()
    with zloader.Loader(zloader.Pipeline.from_torch(Paths(300_000)),
                        num_workers=workers) as loader:
        assert _memfds() == before  # (the workers and the packer hold theirs)
        # (written by the compiled core's writer where it is built: packed.pack)
        assert loader._embedded.handoff.writer is _native.pick("marshal_into", None)
        packer = psutil.Process(_packer(loader))
        # (forked by the first worker, or by the forker right after the first worker)
        forker = loader._embedded.forker
        assert packer.ppid() == (loader._processes[0].pid if forker is None
                                 else forker.process.pid)
        assert sum(1 for _ in loader) == 300_000
    assert not packer.is_running() or packer.status() == psutil.STATUS_ZOMBIE
    assert _memfds() == before


def test_a_worker_forked_after_the_packer_does_not_take_it_for_its_own(monkeypatch):
    # (the forker forks the packer after worker 0: the later workers inherit its note of
    # the packer's pid, and one leaving early would kill the packer the others wait for)
    monkeypatch.setattr(handoff, "_PACKER", 4_000_000)
    monkeypatch.setattr(handoff, "_OPEN", set())
    handoff.forked(None)
    assert handoff._PACKER is None
    handoff.reap(stop=True)  # (nothing to kill)
