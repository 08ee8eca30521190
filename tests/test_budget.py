"""One memory budget for a Loader's rings and the records in flight to it
(zloader/client/budget.py): rings start at each worker's share, grow within the budget,
and records too large for it lower the prefetch, which the Loader says once."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

import zloader
from zloader._defaults import DEFAULT_RING_BYTES
from zloader.client.budget import Budget, default_budget
from zloader.transport.ring import ALIGN

MIB = 1 << 20


def test_rings_start_at_each_workers_share_of_the_budget():
    budget = Budget(512 * MIB, prefetch=8)
    assert budget.ring_bytes(1) == budget.ring_bytes(8) == DEFAULT_RING_BYTES
    assert budget.ring_bytes(64) * 64 <= budget.total
    assert all(budget.ring_bytes(n) % ALIGN == 0 for n in range(1, 300))
    docker = Budget(32 * MIB, prefetch=8)  # half of Docker's 64 MiB /dev/shm
    assert docker.ring_bytes(8) == 4 * MIB and docker.ring_bytes(10_000) * 10_000 <= 32 * MIB
    assert Budget(32 * MIB, prefetch=8, width=16).ring_bytes(2) == 2 * MIB  # the job's width
    assert 0 < default_budget() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_records_too_large_for_the_budget_lower_the_prefetch_once(caplog):
    budget = Budget(64 * MIB, prefetch=8)
    assert budget.large(4) == 2 * MIB and budget.credit_batch == 4
    with caplog.at_level(logging.WARNING, "zloader.loader"):
        budget.fit(4 * MIB, workers=4)  # a share of 16 MiB: 4 records, 2 of them in flight
        budget.fit(4 * MIB, workers=4)  # the same: said once
        assert budget.limit == 2 and budget.credit_batch == 1
        budget.fit(64 * MIB, workers=4)  # never below one
    assert budget.limit == 1
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("memory_budget=" in text for text in said)
    assert "limits prefetch to 2 records per worker" in said[0]


def _dev_shm_of(pid: int) -> int:
    total = 0
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if name.startswith("zloader-") and len(parts) > 2 and parts[2] == str(pid):
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(f"/dev/shm/{name}").st_blocks * 512
    return total


def test_large_batches_from_many_workers_stay_within_a_small_budget(caplog):
    """8 workers with prefetch 8 and 2 MiB batches would hold 128 MiB in flight; with a
    budget of 24 MiB the epoch is whole, the Loader says it lowered the prefetch, and its
    rings and segments never hold much more than the budget."""
    pipeline = zloader.Pipeline.range(400).map(lambda i: np.full(2 * MIB // 8, i, np.int64))
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], _dev_shm_of(os.getpid()))

    watcher = threading.Thread(target=watch, daemon=True)
    with caplog.at_level(logging.WARNING, "zloader.loader"):
        with zloader.Loader(pipeline, num_workers=8, prefetch=8,
                            memory_budget=24 * MIB) as loader:
            watcher.start()
            try:
                seen = sorted(int(batch[0]) for batch in loader if np.all(batch == batch[0]))
            finally:
                done.set()
                watcher.join()
            stats = loader.stats()
    assert seen == list(range(400))
    assert stats["memory_budget"] == 24 * MIB and stats["prefetch"] < 8
    assert any("limits prefetch" in r.getMessage() for r in caplog.records)
    assert peak[0] <= 24 * MIB + 8 * 3 * MIB, peak[0]  # (a ring's reserved start each)


def test_a_worker_keeps_its_window_of_bytes_in_flight():
    from zloader.worker.streams import Stream

    stream = Stream(b"id", "consumer", 0, window=10 * MIB)
    assert stream.fits(64 * MIB)  # nothing in flight: a record larger than it goes alone
    stream.sent(4 * MIB)
    stream.sent(4 * MIB)
    assert not stream.fits(4 * MIB) and stream.fits(2 * MIB)
    stream.returned(1)  # the consumer used the oldest
    assert stream.flight_bytes == 4 * MIB and stream.fits(6 * MIB)
    stream.returned(5)  # more credits than records in flight (a fresh grant's)
    assert stream.flight_bytes == 0 and not stream.flight
    assert Stream(b"id", "consumer", 0).fits(1 << 40)  # no window: credits only


def test_memory_budget_is_checked():
    with pytest.raises(ValueError, match="memory_budget"):
        zloader.Loader(zloader.Pipeline.range(4), num_workers=1, memory_budget=1000)


DOCKER_SHM = """
import json, logging, sys
import zloader
said = []
logging.getLogger("zloader").addHandler(type("H", (logging.Handler,), {
    "emit": lambda self, record: said.append(record.getMessage())})())
with zloader.Loader(zloader.Pipeline.range(50_000).batch(256), num_workers=8) as loader:
    count = sum(len(batch) for batch in loader)
    stats = loader.stats()
print(json.dumps({"count": count, "segments": stats["segments"],
                  "budget": stats["memory_budget"], "said": said}))
"""


def test_a_docker_sized_dev_shm_gets_rings_that_fit_not_the_socket():
    """Docker gives a container 64 MiB of /dev/shm: 8 workers with 64 MiB rings fell back
    to the socket; with the budget (half of it) each gets a 4 MiB ring. Run in a mount
    namespace of its own, where /dev/shm is a fresh 64 MiB tmpfs."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare --mount needs CAP_SYS_ADMIN)")
    command = ("mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "
               f"{shlex.quote(sys.executable)} -c {shlex.quote(DOCKER_SHM)}")
    done = subprocess.run(["unshare", "--mount", "sh", "-c", command], capture_output=True,
                          text=True, timeout=120, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["count"] == 50_000 and result["budget"] == 32 * MIB
    assert result["segments"] == 0 and not [s for s in result["said"] if "socket" in s]
