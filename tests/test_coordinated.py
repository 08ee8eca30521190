"""Coordinated reads (num_consumers): ports of tf.data service's coordinated-read tests, on
real brokers, workers and consumers. A round's elements come from one worker, produced one
after the other; the groups pipeline makes that visible: round x holds x*N .. x*N+N-1, and
consumer j gets x*N + j."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.coord_consumer import groups
from tests.service import BIN, read_together, service, start_broker, status, stop, wait_for
from zloader import Loader, Pipeline

CONSUMER = os.path.join(os.path.dirname(__file__), "coord_consumer.py")


@contextlib.contextmanager
def coordinated_loaders(pipeline: Pipeline, address: str, job: str, n: int,
                        **options: Any) -> Iterator[list[Loader]]:
    """The N coordinated consumers of ``job`` (``options``: more Loader arguments), closed
    on exit."""
    loaders = [Loader(pipeline, broker=address, job_name=job, num_consumers=n,
                      consumer_index=i, timeout=30, **options) for i in range(n)]
    try:
        yield loaders
    finally:
        for loader in loaders:
            loader.close()


def check_groups(sequences: list[list[int]], n: int) -> None:
    """Consumer j's k-th element is x*N + j for the same x at every j: one round."""
    assert len({len(s) for s in sequences}) == 1, [len(s) for s in sequences]
    for j, sequence in enumerate(sequences):
        assert all(v % n == j for v in sequence)
    for step in zip(*sequences, strict=True):
        assert len({v // n for v in step}) == 1, step


@pytest.mark.parametrize("workers", [1, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("consumers", [1, 2, pytest.param(5, marks=pytest.mark.slow)])
def test_each_round_is_one_group_from_one_worker(workers, consumers):
    rounds = 40
    with service(workers) as (address, _):
        with coordinated_loaders(groups(consumers, rounds, 0.0), address, "groups",
                                 consumers) as loaders:
            results = read_together(loaders, epochs=2)
    for epoch in range(2):
        sequences = [[int(v) for v in r[epoch]] for r in results]
        check_groups(sequences, consumers)
        # Nothing lost or repeated without faults: every group, once.
        assert sorted(v // consumers for v in sequences[0]) == list(range(rounds))
    stats = loaders[0].stats()
    assert stats["dropped"] == 0 and stats["rounds_lost"] == 0


@pytest.mark.slow
def test_finite_input_gives_equal_counts_and_counts_the_dropped_last_round():
    with service(3) as (address, _):
        pipeline = Pipeline.range(100, split_size=3)
        with coordinated_loaders(pipeline, address, "finite", 3) as loaders:
            results = read_together(loaders, epochs=2)
    for epoch in range(2):
        sequences = [r[epoch] for r in results]
        assert len({len(s) for s in sequences}) == 1  # equal: no rank waits on a last step
        seen = [v for s in sequences for v in s]
        assert len(set(seen)) == len(seen)
    dropped = [loader.stats()["dropped"] for loader in loaders]
    assert len(set(dropped)) == 1  # every consumer counts the job's drops
    # Each of the 3 workers drops its last, incomplete round: at most N-1 = 2 elements.
    for epoch in range(2):
        yielded = sum(len(r[epoch]) for r in results)
        assert yielded <= 100 and 100 - yielded <= 3 * 2
    assert sum(len(r[e]) for r in results for e in range(2)) + dropped[0] == 200


@pytest.mark.slow
def test_bucketing_gives_every_consumer_of_a_step_the_same_bucket():
    consumers, boundaries, size = 15, [30, 60], 10

    def bucket_of(batch: np.ndarray) -> set[int]:
        return {int(np.searchsorted(boundaries, x % 90, side="right")) for x in batch}

    pipeline = (Pipeline.range(3000, split_size=100, shuffle_splits=True, seed=3)
                .shuffle(200, seed=1)
                .bucket_by_length(lambda x: int(x) % 90, boundaries, [size] * 3))
    with service(2) as (address, _):
        with coordinated_loaders(pipeline, address, "buckets", consumers) as loaders:
            results = read_together(loaders)
    sequences = [r[0] for r in results]
    steps = list(zip(*sequences, strict=True))
    assert len(steps) >= 6
    for step in steps:
        buckets = set().union(*(bucket_of(batch) for batch in step))
        assert len(buckets) == 1, buckets  # one bucket for every consumer of a step
        assert all(len(batch) == size for batch in step)
    # What is left at the end (under a round per bucket) is dropped and counted.
    yielded = sum(len(batch) for s in sequences for batch in s)
    assert yielded + loaders[0].stats()["dropped"] * size >= 3000 - 2 * 3 * size


@pytest.mark.slow
def test_worker_killed_mid_read_keeps_groups_consistent_without_hanging():
    consumers = 3
    with service(3) as (address, procs):
        with coordinated_loaders(groups(consumers, 150, 0.01), address, "kill",
                                 consumers) as loaders:
            killer = threading.Thread(target=lambda: (
                wait_for(lambda: loaders[0].stats()["elements"] >= 20, what="progress"),
                procs[1].send_signal(signal.SIGKILL)), daemon=True)
            killer.start()
            start = time.monotonic()
            results = read_together(loaders, timeout=90)
        killer.join(5)
        assert time.monotonic() - start < 90
    sequences = [[int(v) for v in r[0]] for r in results]
    check_groups(sequences, consumers)
    # The dead worker's split is read again (at-least-once); rounds it had not delivered
    # to every consumer are skipped by all alike.
    assert {v // consumers for v in sequences[0]} == set(range(150))
    assert len({loader.stats()["rounds_lost"] for loader in loaders}) == 1


def test_a_consumer_leaving_an_epoch_early_ends_it_for_the_others_without_a_hang():
    with service(2) as (address, _), \
            coordinated_loaders(groups(2, 100, 0.002), address, "early", 2) as loaders:
        results: list[list] = [[], []]

        def leave_early() -> None:
            epoch = iter(loaders[0])
            results[0].append([int(next(epoch)) for _ in range(5)])  # then leaves it
            results[0].append([int(v) for v in loaders[0]])

        def read_all() -> None:
            results[1] = [[int(v) for v in loaders[1]] for _ in range(2)]

        threads = [threading.Thread(target=f, daemon=True) for f in (leave_early, read_all)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(t.is_alive() for t in threads), "a consumer hung"
    first, second = results[0][0], results[1][0]
    assert 5 <= len(second) < 2 * 100  # the epoch ended for it too, after what it had
    check_groups([first, second[:5]], 2)
    check_groups([results[0][1], results[1][1]], 2)  # the next epoch is whole and in step
    assert sorted(v // 2 for v in results[0][1]) == list(range(100))


class Consumer:
    def __init__(self, address: str, job: str, n: int, index: int, rounds: int,
                 delay: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, CONSUMER, address, job, str(n), str(index), str(rounds),
             str(delay)], stdout=subprocess.PIPE, text=True)
        self.values: list[int] = []
        self.stats: dict = {}
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            record = json.loads(line)
            if "v" in record:
                self.values.append(record["v"])
            else:
                self.stats = record["stats"]

    def finish(self, timeout: float = 90.0) -> None:
        assert self.process.wait(timeout) == 0
        self.reader.join(5)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.mark.slow
def test_restarted_consumer_rejoins_at_the_round_the_others_are_on():
    n, rounds = 3, 200
    with service(2) as (address, _):
        consumers = [Consumer(address, "restart", n, i, rounds, 0.01) for i in range(n)]
        try:
            wait_for(lambda: len(consumers[1].values) >= 30, timeout=60, what="progress")
            consumers[1].kill()
            consumers[1] = Consumer(address, "restart", n, 1, rounds, 0.01)
            for consumer in consumers:
                consumer.finish()
        finally:
            for consumer in consumers:
                if consumer.process.poll() is None:
                    consumer.kill()
    survivors = [consumers[0].values, consumers[2].values]
    assert [v // n for v in survivors[0]] == [v // n for v in survivors[1]]
    rejoined = consumers[1].values
    assert rejoined and all(v % n == 1 for v in rejoined)
    # The restarted consumer reads the same rounds as the others, from where they were.
    tail = [v // n for v in survivors[0]][-len(rejoined):]
    assert [v // n for v in rejoined] == tail
    assert consumers[1].stats["rounds_missed"] > 0
    assert consumers[1].stats["rounds_missed"] + len(rejoined) + \
        consumers[1].stats["rounds_lost"] >= len(survivors[0])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_consumers": 2}, "given alone"),
    ({"consumer_index": 0}, "given alone"),
    ({"num_consumers": 2, "consumer_index": 2}, r"\[0, 2\)"),
    ({"num_consumers": 0, "consumer_index": 0}, "num_consumers must be >= 1"),
    ({"num_consumers": 2, "consumer_index": -1}, "consumer_index must be >= 0"),
])
def test_bad_coordinated_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Loader(Pipeline.range(4), broker="tcp://127.0.0.1:1", job_name="j", **kwargs)


def test_coordinated_reads_need_a_job_name_and_exclude_share():
    with pytest.raises(ValueError, match="need a job_name"):
        Loader(Pipeline.range(4), broker="tcp://127.0.0.1:1", num_consumers=2,
               consumer_index=0)
    with pytest.raises(ValueError, match="do not mix"):
        Loader(Pipeline.range(4), broker="tcp://127.0.0.1:1", num_consumers=2,
               consumer_index=0, share=True)


@pytest.mark.slow
def test_a_missing_consumer_makes_the_others_time_out_naming_its_index():
    from zloader import Timeout

    with service(1) as (address, _):
        with Loader(Pipeline.range(10), broker=address, job_name="alone", num_consumers=2,
                    consumer_index=0, timeout=2) as loader:
            with pytest.raises(Timeout, match="consumer_index 1 of 2"):
                list(loader)


def test_another_num_consumers_for_the_same_job_is_refused():
    with service(1) as (address, _):
        pipeline = Pipeline.range(10)
        first = Loader(pipeline, broker=address, job_name="n", num_consumers=2,
                       consumer_index=0, timeout=10)
        second = Loader(pipeline, broker=address, job_name="n", num_consumers=3,
                        consumer_index=0, timeout=10)
        try:
            wait_for(lambda: first._io.job is not None, what="the first consumer")
            with pytest.raises(ValueError, match="num_consumers"):
                list(second)
        finally:
            first.close()
            second.close()


def test_a_consumer_releases_rounds_in_order_once_committed_and_skips_lost_ones():
    from zloader.client.items import Data
    from zloader.client.rounds import Rounds

    rounds = Rounds((2, 1))
    rounds.start(0)

    def item(n: int) -> Data:
        return Data(0, f"w{n % 2}", 0, [n])

    for number in (2, 0, 1, 3):
        assert rounds.hold(number, item(number))
    rounds.commit([2, 3], [])
    assert rounds.release() == []  # round 0 is not committed yet
    rounds.commit([0], [1])  # round 1 was lost: its element goes back (its credit)
    out = rounds.release()
    assert [(type(i).__name__, getattr(i, "elements", [])) for i in out] == [
        ("Lost", []), ("Data", [0]), ("Data", [2]), ("Data", [3])]
    assert not rounds.hold(1, item(1))  # a late element of a lost round is refused
    rounds.issued = {"0": 4}
    assert rounds.finished(0)
    rounds.issued = {"0": 5}
    assert not rounds.finished(0)


def is_subsequence(short: list[int], long: list[int]) -> bool:
    it = iter(long)
    return all(any(x == y for y in it) for x in short)


@pytest.mark.slow
def test_a_consumer_paused_past_its_expiry_rejoins_in_step():
    n = 2
    with service(2) as (address, _):
        consumers = [Consumer(address, "pause", n, i, 200, 0.01) for i in range(n)]
        try:
            wait_for(lambda: len(consumers[1].values) >= 20, timeout=60, what="progress")
            consumers[1].process.send_signal(signal.SIGSTOP)
            time.sleep(4.5)  # the broker gives up on it after three silent heartbeats
            consumers[1].process.send_signal(signal.SIGCONT)
            for consumer in consumers:
                consumer.finish()
        finally:
            for consumer in consumers:
                if consumer.process.poll() is None:
                    consumer.kill()
    ours, theirs = ([v // n for v in c.values] for c in (consumers[1], consumers[0]))
    assert all(v % n == 1 for v in consumers[1].values)
    assert is_subsequence(ours, theirs) and ours[-1] == theirs[-1]
    # It was given up on and rejoined: it passed over the rounds in between (those lost
    # for everyone included), and yields every round the others yield from there on.
    assert consumers[1].stats["rounds_missed"] > 0
    assert len(theirs) - len(ours) <= consumers[1].stats["rounds_missed"]


@pytest.mark.slow
def test_a_burst_of_consumers_with_large_rings_keeps_its_worker_on_the_job():
    """Twelve coordinated consumers with 256 MiB rings open the epoch on one worker at once,
    and each OPEN maps and reserves a ring (tenths of a second on a busy host). The worker
    beats through the burst: before, it went silent for seconds, the broker dropped it as
    dead, it abandoned the task, came back and met the same burst, and no round was read."""
    consumers = 12
    broker, address = start_broker()
    worker = subprocess.Popen([os.path.join(BIN, "zloader-worker"), "--broker", address],
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len((status(address, 1.0) or {}).get("workers", ())) == 1,
                 what="the worker")
        with coordinated_loaders(groups(consumers, 40, 0.0), address, "burst", consumers,
                                 ring_bytes=256 << 20) as loaders:
            results = read_together(loaders, timeout=90)
    finally:
        stop(worker)
        stop(broker)
        assert worker.stderr is not None
        log = worker.stderr.read()
        worker.stderr.close()
    check_groups([[int(v) for v in r[0]] for r in results], consumers)
    assert "dropped this worker" not in log
