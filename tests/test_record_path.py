"""The record path under load (issue 26): records that pile up in the consumer while it is
away, drained in bursts from many workers at once, stay whole, exactly once and, per
worker, in the order that worker made them; a worker killed in the middle of such a burst
costs nothing; 64 embedded workers finish an epoch.

Every element names the worker process that made it and its place in that worker's
output: the pipeline's map appends one byte per element to a file named for the worker's
pid, and the file's size before the write is the element's sequence number. The sum of
those files' sizes tells the test how many elements the workers have made, so that it can
stay away until the records have piled up (a condition with a deadline, not a sleep)."""

from __future__ import annotations

import collections
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from zloader import Loader, Pipeline

PER_WORKER = 150
"""Elements per worker in the burst tests: more than a worker's credits (8 records)."""

PACE = 0.0015
"""Seconds a worker spends on each element in the burst tests: longer than half the
producer's RECORD_LINGER, so a producer with credit sends each element as a record of its
own, and a paused consumer has every worker's credits' worth of records waiting."""

QUIET = 0.5
"""A pause also ends when the workers made nothing new for this long (they wait for
credit): how much a producer makes ahead of its credits is the worker's business."""


def _tagger(directory: str, pace: float) -> Callable[[int], tuple[int, int, int]]:
    """The map that names each element's worker: ``x -> (pid, seq, x)``, ``seq`` counting
    the elements that worker process made before this one (see the module docstring)."""

    def tag(x: int) -> tuple[int, int, int]:
        if pace:
            time.sleep(pace)
        pid = os.getpid()
        fd = os.open(os.path.join(directory, str(pid)), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                     0o600)
        try:
            seq = os.fstat(fd).st_size
            os.write(fd, b".")
        finally:
            os.close(fd)
        return pid, seq, x

    return tag


def _made(directory: str) -> dict[int, int]:
    """Elements made so far, by worker pid."""
    return {int(name): os.path.getsize(os.path.join(directory, name))
            for name in os.listdir(directory)}


def _stay_away(directory: str, target: int, limit: float = 20.0) -> None:
    """Return once the workers have made ``target`` elements in all, or made none for
    QUIET seconds (each waits for credit with its records in the consumer), or after
    ``limit`` seconds: the test's assertions hold however far the pile got."""
    deadline = time.monotonic() + limit
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        total = sum(_made(directory).values())
        if total >= target:
            return
        now = time.monotonic()
        if total != last:
            last, since = total, now
        elif now - since >= QUIET:
            return
        time.sleep(0.01)


def _assert_once(values: collections.Counter, n: int, what: str) -> None:
    repeated = sorted(v for v, times in values.items() if times > 1)
    lost = sorted(set(range(n)) - set(values))
    extra = sorted(set(values) - set(range(n)))
    assert not repeated and not lost and not extra, (
        f"{what}: {len(repeated)} repeated (e.g. {repeated[:5]}), {len(lost)} lost "
        f"(e.g. {lost[:5]}), {len(extra)} not in the source (e.g. {extra[:5]})")


def _received(loader: Loader) -> dict[int, int]:
    """Elements the consumer has received so far, by worker pid (``stats()``)."""
    return dict(loader.stats()["per_worker"])


def _kill_the_one_owing_most(loader: Loader, directory: str, made_before: dict[int, int],
                             received_before: dict[int, int]) -> int:
    """SIGKILL the live worker of ``loader`` with the most elements made this epoch that
    the consumer has not received (its last, coalesced record, held back for lack of
    credit): its death leaves a part of the epoch to be read again. Returns its pid."""
    made, received = _made(directory), _received(loader)

    def owing(pid: int) -> int:
        return (made.get(pid, 0) - made_before.get(pid, 0)
                - received.get(pid, 0) + received_before.get(pid, 0))

    live = [p for p in loader._processes if p.poll() is None]
    victim = max(live, key=lambda p: owing(p.pid))
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    return victim.pid


def _burst(loader: Loader, directory: str, n: int, kill_after: int,
           values: collections.Counter) -> Iterator[Any]:
    """Start an epoch of ``loader``, take one element, stay away while the records pile
    up, then drain them, killing a worker after ``kill_after`` more. Counts each
    element's value in ``values``; returns the epoch's iterator (the rest unread)."""
    made_before, received_before = _made(directory), _received(loader)
    epoch = iter(loader)
    values[next(epoch)[2]] += 1
    _stay_away(directory, sum(made_before.values()) + n)
    for _ in range(kill_after):
        values[next(epoch)[2]] += 1
    _kill_the_one_owing_most(loader, directory, made_before, received_before)
    return epoch


@pytest.mark.parametrize("kill_after", [0, pytest.param(40, marks=pytest.mark.slow)])
def test_a_burst_from_many_workers_rebuilds_the_epoch_after_a_worker_is_killed_mid_burst(
        tmp_path, kill_after: int):
    """8 workers each fill their credits while the consumer is away; one is SIGKILLed
    with its records waiting (``kill_after`` 0: none of the burst read yet; 40: in the
    middle of the one-element records). Each epoch still holds every element once; in the
    second, a resumed Loader finishes what a killed worker and a closed Loader left. The
    first epoch waits for the broker to notice the death (about 4 s), hence one case fast."""
    workers, n = 8, 8 * PER_WORKER
    pipeline = Pipeline.range(n, split_size=10).map(_tagger(str(tmp_path), PACE))
    first: collections.Counter = collections.Counter()
    second: collections.Counter = collections.Counter()
    with Loader(pipeline, num_workers=workers, timeout=30) as loader:
        epoch = _burst(loader, str(tmp_path), n, kill_after, first)
        for _, _, x in epoch:
            first[x] += 1
        _assert_once(first, n, "epoch 0 with a worker killed mid-burst")

        epoch = _burst(loader, str(tmp_path), n, kill_after, second)
        for _ in range(n // 4):
            second[next(epoch)[2]] += 1
        state = loader.state_dict()
    with Loader(pipeline, num_workers=workers, timeout=30, state=state) as resumed:
        for _, _, x in resumed:
            second[x] += 1
    _assert_once(second, n, "epoch 1 with a worker killed mid-burst, then resumed")


@pytest.mark.parametrize("sharding", ["static", "dynamic"])
def test_a_paused_consumer_gets_every_piled_up_record_in_each_workers_order(
        tmp_path, sharding: str):
    """8 workers fill their credits while the consumer is away; read afterwards, every
    element arrives once and each worker's elements arrive in the order it made them (its
    sequence numbers run 0, 1, 2, ...: nothing it made is missing, nothing swapped; with
    static sharding its source values rise too)."""
    workers, n = 8, 8 * PER_WORKER
    pipeline = Pipeline.range(n, split_size=10).map(_tagger(str(tmp_path), PACE))
    with Loader(pipeline, num_workers=workers, sharding=sharding, timeout=30) as loader:
        epoch = iter(loader)
        arrived = [next(epoch)]
        _stay_away(str(tmp_path), n)
        arrived.extend(epoch)
    _assert_once(collections.Counter(x for _, _, x in arrived), n, "the paused epoch")
    by_worker: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for pid, seq, x in arrived:
        by_worker[pid].append((seq, x))
    assert len(by_worker) > 1, f"one worker made the whole epoch: {sorted(by_worker)}"
    for pid, got in by_worker.items():
        seqs = [seq for seq, _ in got]
        wrong = next((i for i, seq in enumerate(seqs) if seq != i), None)
        assert wrong is None, (
            f"worker {pid}'s elements arrived out of the order it made them, or one it "
            f"made is missing: arrival {wrong} of {len(seqs)} is its element "
            f"{seqs[wrong]}; around it: {seqs[max(0, wrong - 3):wrong + 3]}")
        if sharding == "static":
            xs = [x for _, x in got]
            assert xs == sorted(xs), f"worker {pid}'s static splits arrived out of order"
    if sharding == "static":
        assert len(by_worker) == workers  # each worker index has its own splits


@pytest.mark.timeout(90)
def test_64_embedded_workers_finish_an_epoch(tmp_path):
    """64 embedded workers, each with its own ring (256 KiB: 16 MiB of shared memory in
    all), read an epoch of 64 x 20 elements: each element once, and no hang."""
    workers, n = 64, 64 * 20
    pipeline = Pipeline.range(n, split_size=5).map(_tagger(str(tmp_path), 0.0))
    with Loader(pipeline, num_workers=workers, timeout=30, ring_bytes=256 * 1024) as loader:
        got = list(loader)
    _assert_once(collections.Counter(x for _, _, x in got), n, "the 64-worker epoch")


def _paced(x: int) -> int:
    time.sleep(0.003)  # elements 3 ms apart: alone in a record while the consumer keeps up
    return x


def test_a_consumer_that_falls_behind_gets_fewer_larger_records():
    """While a worker has no credit free, the elements it makes join the record being made
    (up to a full one) instead of waiting one by one: after a pause the consumer gets the
    pile in a few records. Nothing is lost or repeated, and each worker's order holds."""
    n = 400
    with Loader(Pipeline.range(n, split_size=n).map(_paced), num_workers=1, prefetch=2,
                timeout=30) as loader:
        it = iter(loader)
        first = [next(it)]
        time.sleep(0.6)  # about 200 elements made meanwhile, with 2 records of credit
        rest = list(it)
        records = loader.stats()["records"]
    assert first + rest == list(range(n))  # one worker, one split: in order
    # Each element alone in its record would make n of them; the pile made during the
    # pause (about 200 elements) came in a few.
    assert records < n - 50, f"{records} records for {n} elements"
