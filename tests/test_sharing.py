"""Shared jobs: one pipeline run serves several trainer processes (real broker, workers and
trainers; see tests/share_trainer.py for the trainer)."""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest

from tests.service import run_together, service, status, stop, wait_for
from zloader import Loader, Pipeline
from zloader._status import status_text
from zloader.sharing.window import Window

TRAINER = os.path.join(os.path.dirname(__file__), "share_trainer.py")
N = 120


class Trainer:
    """A trainer process whose JSON lines are collected on a thread (stopped, if it still
    runs, when the :func:`trainer_service` it was started in exits)."""

    running: ClassVar[list[Trainer]] = []

    def __init__(self, broker: str, *args: str, n: int = N, variant: int = 1,
                 epochs: int = 1) -> None:
        self.process = subprocess.Popen(
            [sys.executable, TRAINER, broker, str(n), str(variant), str(epochs), *args],
            stdout=subprocess.PIPE, text=True)
        Trainer.running.append(self)
        self.lines: list[dict] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(json.loads(line))

    @property
    def progress(self) -> int:
        return max((line["progress"] for line in self.lines if "progress" in line), default=0)

    def epochs(self, timeout: float = 60.0) -> list[dict]:
        assert self.process.wait(timeout) == 0
        self.reader.join(5)
        return [line for line in self.lines if "epoch" in line]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@contextlib.contextmanager
def trainer_service(workers: int) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """:func:`service`, whose trainers still running at the end (a test that failed half
    way, before it waited for them) are killed before its workers and broker stop."""
    with service(workers=workers) as running:
        try:
            yield running
        finally:
            while Trainer.running:
                trainer = Trainer.running.pop()
                if trainer.process.poll() is None:
                    trainer.kill()
                trainer.reader.join(5)


def shared_jobs(address: str) -> list[dict]:
    return [j for j in status(address)["jobs"] if j.get("shared")]


def exactly_once(got: list[int], size: int) -> None:
    """Each of ``range(size)`` once in ``got``: what was lost and what came twice, named."""
    counts = collections.Counter(got)
    twice = {x: n for x, n in counts.items() if n > 1}
    lost = sorted(set(range(size)) - set(counts))
    assert not twice and not lost and len(got) == size, (
        f"{len(got)} elements for {size}: {sum(twice.values()) - len(twice)} repeated "
        f"(e.g. {sorted(twice)[:5]}), {len(lost)} lost (e.g. {lost[:5]})")


def segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith("zloader-") and "-shr-" in n]


@pytest.mark.slow  # (about 7-10 s; the suite keeps under 6 min on 2 cores)
def test_three_trainers_share_one_run_and_see_the_same_sequence(tmp_path):
    log = str(tmp_path / "calls")
    with trainer_service(1) as (address, _):
        # (slow enough that the others, started once it reads, join while it still runs)
        first = Trainer(address, "--log", log, "--delay", "0.02", epochs=3)
        wait_for(lambda: first.progress >= 10, what="the first trainer's progress")
        others = [Trainer(address, "--log", log, epochs=3) for _ in range(2)]
        runs = [t.epochs() for t in (first, *others)]
        reference = {epoch["epoch"]: epoch["got"] for epoch in runs[0]}
        for run in runs:
            assert len(run) == 3
            for epoch in run:  # every element of every epoch exactly once
                assert sorted(epoch["got"]) == list(range(N))
                assert epoch["stats"]["share_skipped"] == 0
            # From the moment it attached (the job's epoch then, under a slow start maybe
            # not the first's epoch 0): the epoch under way in the same order, then the
            # part it missed, made again in the same order; later epochs identical.
            got, ref = run[0]["got"], reference[run[0]["epoch"]]
            k = ref.index(got[0])
            assert got == ref[k:] + ref[:k]
            for epoch in run[1:]:
                if epoch["epoch"] in reference:
                    assert epoch["got"] == reference[epoch["epoch"]]
        replayed = sum(r[-1]["stats"]["share_replayed"] for r in runs)
        epochs = {epoch["epoch"] for run in runs for epoch in run}
        assert os.path.getsize(log) == len(epochs) * N + replayed  # once an epoch (+ replays)
        assert replayed < 2 * N
        wait_for(lambda: not segments(), what="the shared records to be freed")


@pytest.mark.slow
def test_identical_pipelines_share_and_a_changed_one_gets_its_own_job():
    with trainer_service(2) as (address, _):
        trainers = [Trainer(address, "--delay", "0.03", variant=v) for v in (1, 1, 2)]
        wait_for(lambda: sorted(j["consumers"] for j in shared_jobs(address)) == [1, 2],
                 what="two shared jobs, one with two trainers")
        for trainer in trainers:
            (epoch,) = trainer.epochs()
            # dynamic sharding, 2 workers: every element. The second job takes a worker
            # of the shared one when it registers mid-epoch, and a shared job's moved
            # worker's splits are read again (docs/pool.md): its trainers may get some
            # elements twice, never none.
            assert sorted(set(epoch["got"])) == list(range(N))


@pytest.mark.slow
def test_a_killed_trainer_does_not_stall_the_others():
    with trainer_service(1) as (address, _):
        # A small window and "block" with a long block time: only eviction of the dead
        # trainer (three missed heartbeats) lets the live one finish in time.
        args = ("--window", str(1 << 16), "--block", "600")
        live = Trainer(address, *args, "--delay", "0.005", n=400)
        doomed = Trainer(address, *args, "--delay", "0.05", n=400)
        wait_for(lambda: doomed.progress >= 10, what="the doomed trainer's progress")
        doomed.kill()
        (epoch,) = live.epochs(timeout=60)
        assert sorted(epoch["got"]) == list(range(400))


@pytest.mark.slow
def test_a_slow_trainer_skips_and_counts_with_skip():
    with trainer_service(1) as (address, _):
        window = ("--window", str(1 << 16))
        # The slow one first: a trainer that joins late gets what it missed replayed at its
        # own pace, which a slow late joiner would spend most of the epoch on.
        slow = Trainer(address, *window, "--lag", "skip", "--delay", "0.05", n=300)
        wait_for(lambda: slow.progress >= 10, what="the slow trainer's progress")
        fast = Trainer(address, *window, "--lag", "skip", n=300)
        (fast_epoch,), (slow_epoch,) = fast.epochs(), slow.epochs()
        assert sorted(fast_epoch["got"]) == list(range(300))
        skipped = slow_epoch["stats"]["share_skipped"]
        assert skipped > 0
        assert len(slow_epoch["got"]) + skipped == 300
        assert len(set(slow_epoch["got"])) == len(slow_epoch["got"])


@pytest.mark.slow
def test_a_slow_trainer_holds_the_producer_with_block():
    with trainer_service(1) as (address, _):
        window = ("--window", str(1 << 16), "--block", "600")
        fast = Trainer(address, *window, n=150)
        slow = Trainer(address, *window, "--delay", "0.01", n=150)
        for trainer in (fast, slow):  # the producer waited for the slow one: nothing lost
            (epoch,) = trainer.epochs()
            assert sorted(epoch["got"]) == list(range(150))
            assert epoch["stats"]["share_skipped"] == 0


@pytest.mark.slow
def test_a_late_joiner_gets_a_whole_epoch_and_only_what_left_the_window_is_recomputed(
        tmp_path):
    log = str(tmp_path / "calls")
    with trainer_service(1) as (address, _):
        window = ("--window", str(1 << 18), "--log", log)  # about 8 elements
        first = Trainer(address, *window, "--delay", "0.02", n=200)
        wait_for(lambda: first.progress >= 60, what="the first trainer's progress")
        late = Trainer(address, *window, n=200)
        (epoch,), (late_epoch,) = first.epochs(), late.epochs()
        assert sorted(epoch["got"]) == list(range(200))
        assert sorted(late_epoch["got"]) == list(range(200))  # complete, no duplicates
        replayed = late_epoch["stats"]["share_replayed"]
        assert 50 <= replayed < 200  # what had left the window, not the whole epoch
        assert os.path.getsize(log) == 200 + replayed


def test_shared_elements_are_copy_on_write_for_each_trainer():
    pipeline = Pipeline.range(40).map(lambda x: np.full(100_000, x, dtype=np.int32))
    with service(workers=1) as (address, _):
        with Loader(pipeline, broker=address, share=True, timeout=20) as a, \
                Loader(pipeline, broker=address, share=True, timeout=20) as b:
            for x, y in zip(a, b, strict=True):
                assert x.flags.writeable
                x[:] = -1  # changes a's copy only
                assert int(y[0]) == int(y[-1]) >= 0
            assert a.stats()["segments"] > 0  # they came through shared memory


def test_window_lag_policies_and_late_joins():
    window = Window(capacity=100, lag="skip")
    a = window.join(b"a", 0, started=False)
    a.credits = 10
    for _ in range(3):
        ok, gone = window.room(40, 0.0)
        assert ok
        window.add(0, 2, 40)
    assert window.nbytes == 80 and window.entries[0].seq == 1  # the oldest went (skipped)
    assert a.lagged == 2 and a.seq == 1
    late = window.join(b"b", 0, started=True)
    assert late.seq == 1 and late.missed == 2  # replays seq 1, 2; elements 0-1 made again
    blocking = Window(capacity=100, lag="block", block_seconds=5)
    blocking.join(b"a", 0, started=False)
    for _ in range(2):
        blocking.add(0, 1, 50)
    assert blocking.room(50, 0.0) == (False, [])  # waits for the trainer...
    ok, gone = blocking.room(50, 6.0)  # ...up to block_seconds, then skips it ahead
    assert ok and len(gone) == 1 and blocking.cursors[b"a"].lagged == 1
    blocking.add(0, 1, 50)
    ok, gone = blocking.room(50, 6.5)  # still stalled: skipped at once, not waited for again
    assert ok and len(gone) == 1 and blocking.cursors[b"a"].lagged == 2
    stalled = blocking.cursors[b"a"]
    entry = blocking.next_for(stalled)
    assert entry is not None
    blocking.took(stalled, entry)  # it moves again: the producer waits for it again
    blocking.add(0, 1, 50)
    ok, gone = blocking.room(50, 7.0)
    assert ok and len(gone) == 1  # (the record it took)
    blocking.add(0, 1, 50)
    assert blocking.room(50, 7.0) == (False, [])
    with pytest.raises(ValueError, match="share_lag"):
        Window(capacity=1, lag="wait")


def test_joining_an_epoch_that_has_left_the_window_entirely_replays_all_of_it():
    window = Window(capacity=100)
    window.join(b"a", 0, started=False)
    window.add(0, 3, 10)
    window.add(0, 0, 0, end=True)
    window.leave(b"a")
    window.clear()  # the last trainer left: the window's memory was freed
    late = window.join(b"b", 0, started=True, finished=True)
    assert late.missed == 3 and late.end is not None and late.end.end  # over here: replay
    under_way = Window(capacity=100)
    under_way.join(b"a", 0, started=False)
    under_way.add(0, 3, 10)
    under_way.clear()
    joined = under_way.join(b"b", 0, started=True)
    assert joined.missed == 3 and joined.end is None  # the rest and the end are to come


@pytest.mark.parametrize("kwargs, message", [
    ({"share": True}, "needs a broker"),
    ({"share": True, "broker": "tcp://127.0.0.1:1", "job_name": "x"}, "do not mix"),
    ({"share": True, "broker": "tcp://127.0.0.1:1", "share_lag": "wait"}, "share_lag"),
    ({"share": True, "broker": "tcp://127.0.0.1:1", "share_window_bytes": 10},
     "share_window_bytes"),
    ({"share": True, "broker": "tcp://127.0.0.1:1", "share_block_seconds": -1},
     "share_block_seconds"),
    ({"share": "yes", "broker": "tcp://127.0.0.1:1"}, "share"),
])
def test_bad_share_arguments_raise(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Loader(Pipeline.range(3), **kwargs)


def test_trainers_that_leave_free_the_shared_memory():
    pipeline = Pipeline.range(30).map(lambda x: np.full(50_000, x, dtype=np.int64))
    with service(workers=1) as (address, procs):
        with Loader(pipeline, broker=address, share=True, timeout=20) as a:
            assert len(list(a)) == 30
            assert segments()
        wait_for(lambda: not segments(), what="the worker to free the window")
        assert procs[0].poll() is None  # the worker itself is still running


@pytest.mark.slow
def test_status_shows_a_shared_job_with_its_trainers_lag_and_skips():
    with trainer_service(1) as (address, _):
        window = ("--window", str(1 << 16), "--lag", "skip")
        slow = Trainer(address, *window, "--delay", "0.05", n=400)
        wait_for(lambda: slow.progress >= 10, what="the slow trainer's progress")
        trainers = [slow, Trainer(address, *window, "--delay", "0.01", n=400)]

        def seen() -> list[dict]:
            jobs = shared_jobs(address)
            return jobs[0]["trainers"] if jobs else []

        wait_for(lambda: len(seen()) == 2 and any(t["skipped"] for t in seen()),
                 what="two trainers, one skipping, in the status")
        assert {"consumer", "pid", "lag", "skipped"} <= set(seen()[0])
        table = subprocess.run([os.path.join(os.path.dirname(sys.executable), "zloader"),
                                "status", "--broker", address], capture_output=True,
                               text=True, timeout=30, check=True).stdout
        assert "(shared)" in table and table.count("    trainer ") == 2
        for trainer in trainers:
            trainer.epochs()


def test_the_torch_and_tf_adapters_share_too():
    torch = pytest.importorskip("torch")
    pytest.importorskip("tensorflow")
    import zloader.tf
    import zloader.torch

    pipeline = Pipeline.range(50).map(lambda x: np.full(3, x, dtype=np.int64))
    with service(workers=1) as (address, _):
        first = zloader.torch.IterableDataset(pipeline, broker=address, share=True)
        second = zloader.torch.IterableDataset(pipeline, broker=address, share=True)
        dataset = zloader.tf.dataset(pipeline, broker=address, share=True)
        try:
            for _ in range(2):
                got = [sorted(int(t[0]) for t in ds) for ds in (first, second)]
                got.append(sorted(int(t[0]) for t in dataset.as_numpy_iterator()))
                assert got == [list(range(50))] * 3
            assert isinstance(next(iter(first)), torch.Tensor)
            (job,) = shared_jobs(address)
            assert job["consumers"] == 3
        finally:
            first.close()
            second.close()
            zloader.tf.close(dataset)
    with pytest.raises(ValueError, match="IterableDataset"):
        zloader.torch.DataLoader(list(range(4)), share=True)


def test_a_trainer_that_leaves_an_epoch_early_gets_the_next_one_whole():
    pipeline = Pipeline.range(400).map(lambda x: np.full(4096, x, dtype=np.int64))
    with service(workers=1) as (address, _):
        with Loader(pipeline, broker=address, share=True, timeout=20, prefetch=2,
                    share_window_bytes=1 << 18) as loader:
            for index, _ in enumerate(loader):
                if index == 20:
                    break  # the producer is left waiting for this epoch's reader
            assert sorted(int(x[0]) for x in loader) == list(range(400))


def _sleepy(x: int) -> int:
    time.sleep(0.002)
    return x


@pytest.mark.slow  # (about 8 s each)
@pytest.mark.parametrize("at, batched", [(300, False), (1900, False), (1500, True),
                                         (600, "b's own")])
def test_a_worker_killed_under_shared_trainers_loses_and_repeats_nothing(at, batched):
    """One of a shared job's two workers is SIGKILLed while two trainers read (early, near
    the end: the other worker may have ended the epoch for them before the broker sees
    the death, and records in the dead worker's shared memory are swept), in a pipeline
    of single elements and in one that shuffles and batches. The broker makes of the
    splits it had handed it a segment that the other worker makes again for each trainer,
    less the elements that trainer got from it: each gets every element once. (Its splits
    were read again by the other worker: both got what they had twice, 103 of 1,200 in
    bench.shared_faults; and near the end, the slower lost up to 152 of 2,000.) With
    "b's own", trainer b shuffles and batches after the shared map (a branch): the other
    worker makes the dead one's splits again through b's pipeline for b."""
    pipeline = Pipeline.range(2000, split_size=20).map(_sleepy)
    own = pipeline
    if batched:
        own = pipeline.shuffle(64, seed=3).batch(7)
        pipeline = pipeline if batched == "b's own" else own
    with service(workers=2) as (address, procs):
        with Loader(pipeline, broker=address, share=True, timeout=30) as a, \
                Loader(own, broker=address, share=True, timeout=30) as b:
            got: dict[str, list[int]] = {}

            def read(name: str, loader: Loader) -> None:
                seen: list[int] = []
                for x in loader:
                    seen.extend(np.asarray(x).reshape(-1).tolist())
                    if name == "a" and len(seen) >= at and procs[0].poll() is None:
                        procs[0].send_signal(signal.SIGKILL)
                        procs[0].wait()  # reaped: the consumers sweep its segments
                    if name == "b":
                        time.sleep(0.001)  # (a slower trainer: production follows a)
                got[name] = seen

            run_together([functools.partial(read, "a", a), functools.partial(read, "b", b)],
                         timeout=90)
            for seen in got.values():
                exactly_once(seen, 2000)


def decodes(log: str) -> int:
    return os.path.getsize(log) if os.path.exists(log) else 0


def check_suffix(epoch: dict, suffix: str, n: int) -> None:
    """A trainer's epoch is its pipeline's, exactly: every element once (the even ones
    for the filtering suffix)."""
    got = epoch["got"]
    if suffix == "even":
        assert sorted(got) == list(range(0, n, 2)), suffix
    else:
        exactly_once(got, n)


@pytest.mark.slow  # (about 15 s)
def test_trainers_with_their_own_stages_share_the_common_ones_and_each_gets_its_epoch(
        tmp_path):
    """Four trainers share a map (the "decode") and then part: one has nothing more, one
    shuffles and batches, one maps and batches, one filters; a fifth, with yet another
    suffix, is killed mid-epoch. Each of the four gets its own pipeline's epoch exactly
    (every element once, in its own batches), and the map ran once per element for all.
    (They start the epoch together, as a sweep's trials do: a trainer that opens it late
    on a worker that has made all its part gets that part made again for it alone.)"""
    log = str(tmp_path / "decode.log")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    n = 600
    suffixes = ["", "shuffle_batch25", "augment_batch4", "even"]
    with trainer_service(2) as (address, _):
        trainers = [Trainer(address, "--delay", "0.015", "--log", log, "--suffix", suffix,
                            "--barrier", f"{barrier}:5", n=n) for suffix in suffixes]
        leaver = Trainer(address, "--delay", "0.015", "--log", log, "--suffix", "batch10",
                         "--barrier", f"{barrier}:5", n=n)
        wait_for(lambda: leaver.progress >= 100, timeout=60, what="the leaver reading")
        (job,) = shared_jobs(address)  # one job for all five
        assert job["consumers"] == 5
        branches = {t["consumer"]: t for t in job["trainers"]}
        assert all(t["prefix"] == ["map(element)"] for t in branches.values())
        text = status_text(status(address))  # (zloader status, as printed)
        assert "shares map(element); own: shuffle(64) > batch(25)" in text \
            and "own: filter(even)" in text, text
        leaver.kill()
        replayed = []
        for suffix, trainer in zip(suffixes, trainers, strict=True):
            (epoch,) = trainer.epochs(90)
            check_suffix(epoch, suffix, n)
            replayed.append(epoch["stats"]["share_replayed"])
    # The map ran once per element, unless a worker made a trainer's part of the epoch
    # again for it (one that opened it there late, on a loaded machine): still shared.
    assert decodes(log) == n if not any(replayed) else decodes(log) < 2 * n, replayed


@pytest.mark.slow  # (about 15 s)
def test_a_late_trainer_with_its_own_stages_gets_its_whole_epoch():
    """A trainer whose pipeline shares the map with a running shared job, and batches
    after it, comes when the epoch is half read: the first time while the elements made
    so far are kept (it shares the epoch where a worker still makes it; a worker that
    has made all of its part makes that part again for it alone), the second time with a
    window too small to keep them (the workers make its epoch again for it alone, once
    they have read it). Each time it gets its epoch exactly, and so does the first
    trainer."""
    n = 400
    for window in (None, 1 << 16):
        with trainer_service(2) as (address, _):
            extra = ["--window", str(window)] if window else []
            first = Trainer(address, "--delay", "0.02", *extra, n=n)
            wait_for(lambda t=first: t.progress >= n // 2, timeout=60, what="half an epoch")
            late = Trainer(address, "--delay", "0.002", "--suffix", "shuffle_batch25",
                           *extra, n=n)
            (epoch,) = late.epochs(90)
            exactly_once(epoch["got"], n)
            assert epoch["stats"]["share_replayed"] > 0 or not window
            (epoch,) = first.epochs(90)
            exactly_once(epoch["got"], n)


def _wide(x: int) -> np.ndarray:
    time.sleep(0.002)
    return np.full(4096, x, dtype=np.int64)  # 32 KiB: a small window holds few


@pytest.mark.slow  # (about 15 s)
def test_a_trainer_that_joined_late_on_a_worker_that_dies_gets_its_epoch_exactly():
    """Trainer b joins a shared epoch late, with a window that no longer holds its start:
    from each worker it gets the records still in the window, then what is made from
    then on, and the start (made again for it) last. Worker 0 is SIGKILLed while b has
    the middle of what it made: the worker that stays makes the dead one's splits again
    for b less the elements b has of them (by their places, DATA.first), not the first
    that many. (Counted from the start, b lost what it lacked of the start and got the
    middle twice.)"""
    pipeline = Pipeline.range(1500, split_size=20).map(_wide)
    with service(workers=2) as (address, procs):
        got: dict[str, list[int]] = {}

        def read(name: str) -> None:
            if name == "b":
                wait_for(lambda: len(got.get("a", ())) >= 500, timeout=60, what="a")
            seen = got[name] = []
            with Loader(pipeline, broker=address, share=True, timeout=30,
                        share_window_bytes=1 << 17) as loader:
                for x in loader:
                    seen.append(int(x[0]))
                    if name == "b" and len(seen) == 200 and procs[0].poll() is None:
                        procs[0].send_signal(signal.SIGKILL)
                        procs[0].wait()
                stats = loader.stats()
            if name == "b":
                assert stats["share_replayed"] > 0  # (it did join late)

        run_together([functools.partial(read, "a"), functools.partial(read, "b")],
                     timeout=120)
        for seen in got.values():
            exactly_once(seen, 1500)


@pytest.mark.slow  # (about 15 s)
@pytest.mark.parametrize("own", [False, True])
def test_a_shared_job_s_last_worker_killed_is_made_again_by_the_next_one(own):
    """A shared job's only worker is SIGKILLed mid-epoch under two trainers (b, with
    ``own``, batching after the shared map: a branch). Its splits are not read again: the
    next worker the job gets makes them again for each trainer, less what it had, and
    reads the rest of the epoch. Each gets every element once (before: read again when a
    worker came back, every trainer got what it had of them twice)."""
    from tests.service import start_worker

    pipeline = Pipeline.range(800, split_size=20).map(_sleepy)
    with service(workers=1) as (address, procs):
        got: dict[str, list[int]] = {}

        def read(name: str) -> None:
            seen = got[name] = []
            mine = pipeline.batch(3) if own and name == "b" else pipeline
            with Loader(mine, broker=address, share=True, timeout=60) as loader:
                for x in loader:
                    seen.extend(np.asarray(x).reshape(-1).tolist())
                    if name == "a" and len(seen) == 300 and procs[0].poll() is None:
                        procs[0].send_signal(signal.SIGKILL)
                        procs[0].wait()
                        # The next worker comes once the broker has dropped this one
                        # (none stays to take its splits then).
                        wait_for(lambda: not status(address)["workers"], timeout=30,
                                 what="the broker to drop the dead worker")
                        procs.append(start_worker(address))  # (stopped by service)
                    if name == "b":
                        time.sleep(0.003)  # (a slower trainer: production follows a)

        run_together([functools.partial(read, "a"), functools.partial(read, "b")],
                     timeout=120)
        for seen in got.values():
            exactly_once(seen, 800)


@pytest.mark.slow  # (about 7-10 s; the suite keeps under 6 min on 2 cores)
def test_a_drained_worker_sends_its_window_to_a_lagging_trainer_before_it_leaves():
    """A worker that drains (SIGTERM, or a move to another job) has made its splits and
    put them in its window, but a slow trainer has not been sent them all yet (production
    follows the faster one): the worker stays until it has, since its splits are done and
    nobody would read them again (it left at once, and the slow trainer lost 29-30 of 120
    elements)."""
    with trainer_service(2) as (address, procs):
        # Production follows the faster trainer; the slower one lags behind the window.
        slow = Trainer(address, "--delay", "0.04")  # 120 elements: about 5 s
        fast = Trainer(address, "--delay", "0.002")
        wait_for(lambda: fast.progress >= 40 and slow.progress >= 10,
                 what="both trainers' first elements")
        procs[0].send_signal(signal.SIGTERM)  # drains: its window is ahead of the slow one
        for trainer in (slow, fast):
            (epoch,) = trainer.epochs()
            assert sorted(set(epoch["got"])) == list(range(N)), \
                f"lost {sorted(set(range(N)) - set(epoch['got']))}"


@pytest.mark.slow  # (about 7-10 s; the suite keeps under 6 min on 2 cores)
def test_a_worker_moved_off_a_shared_job_while_another_reads_repeats_nothing():
    """A second job takes one of a shared job's workers mid-epoch while the other worker
    still reads the epoch: the worker drains (it sends its window to the slower trainer
    too), and no trainer of the shared job gets an element twice or misses one. (It moved
    at once and its splits were read again by the other worker: every trainer that had
    them got them twice.)"""
    n = 2 * N  # the faster trainer's epoch (about 2 s) outlasts the second one's start
    with trainer_service(2) as (address, _):
        slow = Trainer(address, "--delay", "0.015", n=n)
        fast = Trainer(address, "--delay", "0.008", n=n)
        wait_for(lambda: fast.progress >= 10 and slow.progress >= 10,
                 what="both trainers' first elements")
        other = Trainer(address, "--delay", "0.01", variant=2)  # takes a worker
        for trainer, size in ((slow, n), (fast, n), (other, N)):
            (epoch,) = trainer.epochs()
            exactly_once(epoch["got"], size)


def _slow(x: int) -> int:
    time.sleep(0.004)
    return x


@pytest.mark.slow  # (about 10 s)
def test_a_worker_moved_off_a_shared_job_repeats_nothing_and_hands_on_what_it_read():
    """The issue's sweep: a shared job on a pool of two workers, a second shared job with
    another pipeline arriving, which the pool gives one of the two; then a trainer of the
    first pipeline joins its epoch. The moved worker drains and hands the splits it read
    on to the worker that stays, which makes them again for the late trainer: all three
    trainers get their epochs exactly. (Moved at once, the first trainer got 264 of 1,200
    twice; draining without the handover, the late one lost the 280 that the moved worker
    had made.)"""
    first = Pipeline.range(1200, split_size=20).map(_slow)
    second = Pipeline.range(600, split_size=20).map(_slow)
    with service(workers=2) as (address, _):
        got: dict[str, list[int]] = {}
        pipelines = {"a": first, "b": second, "c": first}

        def jobs() -> dict[str, int]:
            return {j["fingerprint"]: j["workers"] for j in (status(address) or {})
                    .get("jobs", ())}

        def read(name: str) -> None:
            if name == "b":
                wait_for(lambda: len(got.get("a", ())) >= 100, what="the first trainer")
            if name == "c":  # the move is done: the second job runs on one worker
                wait_for(lambda: jobs().get(second.fingerprint) == 1
                         and jobs().get(first.fingerprint) == 1, what="the move")
            got[name] = []
            with Loader(pipelines[name], broker=address, share=True, timeout=60) as loader:
                got[name].extend(int(x) for x in loader)

        run_together([functools.partial(read, name) for name in pipelines], timeout=120)
        for name, size in (("a", 1200), ("b", 600), ("c", 1200)):
            exactly_once(got[name], size)


class SlowToLoad:
    """A map function whose unpickling takes ``seconds`` (a worker loading its task's
    pipeline waits that long), and that writes the pid of each process that loaded it
    into ``folder``."""

    def __init__(self, seconds: float, folder: str) -> None:
        self.seconds, self.folder = seconds, folder

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        time.sleep(self.seconds)
        with open(os.path.join(self.folder, f"loaded-{os.getpid()}"), "w"):
            pass

    def __call__(self, x: int) -> int:
        time.sleep(0.002)
        return x


@pytest.mark.slow  # (about 6 s)
def test_a_worker_moved_while_its_shared_task_loads_leaves_no_trainer_waiting(
        tmp_path, caplog):
    """A shared job's two workers load its pipeline (1.5 s each) when a second job comes
    and the pool moves one of them: that worker drains before its task began, and the
    trainer, which had opened its epoch there already, gets its END and all the job's
    elements from the worker that stays. (Its OPEN was kept for a task that never began:
    the trainer waited LEAVE_GRACE_SECONDS for an END, then warned; about once in 150
    runs of ``tests.sweep --modes shared-move --seeds 922:923`` under load.)"""
    first = Pipeline.range(600, split_size=20).map(SlowToLoad(1.5, str(tmp_path)))
    second = Pipeline.range(300, split_size=20).map(_slow)
    with service(workers=2) as (address, _):
        got: dict[str, list[int]] = {}

        def read(name: str) -> None:
            if name == "b":  # (both of a's workers load its pipeline now)
                wait_for(lambda: "a" in got, what="the first trainer")
                time.sleep(0.3)
            got[name] = []
            with Loader(first if name == "a" else second, broker=address, share=True,
                        timeout=60) as loader:
                got[name].extend(int(x) for x in loader)

        with caplog.at_level(logging.WARNING, logger="zloader"):
            run_together([functools.partial(read, name) for name in "ab"], timeout=120)
        exactly_once(got["a"], 600)
        exactly_once(got["b"], 300)
        assert not [r for r in caplog.records if "did not come" in r.getMessage()]
        assert len(list(tmp_path.glob("loaded-*"))) == 2  # (both began to load it)


@pytest.mark.slow  # (about 8 s)
def test_a_worker_stopped_with_sigterm_hands_on_what_it_read_to_a_later_trainer():
    """One of a shared job's two workers gets SIGTERM mid-epoch: it drains (its window goes
    to the trainer reading), then hands the splits it read on with its BYE, and a trainer
    that joins the epoch afterwards gets it whole from the worker that stays. (It lost
    what the stopped worker had made.)"""
    pipeline = Pipeline.range(1200, split_size=20).map(_slow)
    with service(workers=2) as (address, procs):
        got: dict[str, list[int]] = {}

        def read(name: str) -> None:
            if name == "c":
                wait_for(lambda: len(got.get("a", ())) >= 200, what="the first trainer")
                procs[0].send_signal(signal.SIGTERM)
                procs[0].wait(30)  # drained and gone
            got[name] = []
            with Loader(pipeline, broker=address, share=True, timeout=60) as loader:
                got[name].extend(int(x) for x in loader)

        run_together([functools.partial(read, name) for name in "ac"], timeout=120)
        for name in "ac":
            exactly_once(got[name], 1200)


@pytest.mark.slow  # (about 10 s)
def test_a_trainer_paused_for_seconds_gets_its_shared_epoch_exactly():
    """A trainer of a shared job stopped (SIGSTOP) for 3 s mid-epoch, then continued:
    it and the other trainer each get every element once."""
    pause_one_of_two(2 * N, other_delay=0.005, seconds=3.0)


def pause_one_of_two(n: int, other_delay: float, seconds: float) -> None:
    """Two trainers of a shared job on two workers; one (0.01 s an element) is stopped
    with SIGSTOP for ``seconds`` once both have elements, the other reads on at
    ``other_delay``: each gets every element once."""
    with trainer_service(2) as (address, _):
        paused = Trainer(address, "--delay", "0.01", n=n)
        other = Trainer(address, "--delay", str(other_delay), n=n)
        wait_for(lambda: other.progress >= 20 and paused.progress >= 20,
                 what="both trainers' first elements")
        os.kill(paused.process.pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(paused.process.pid, signal.SIGCONT)
        for trainer in (paused, other):
            (epoch,) = trainer.epochs(timeout=180)
            exactly_once(epoch["got"], n)


@pytest.mark.slow  # (about 35 s)
def test_a_trainer_paused_past_its_grace_while_the_job_goes_on_gets_its_epoch_exactly():
    """Stopped for 20 s, past its 15 s grace (the tests' heartbeat): the workers forgot
    its cursors; it comes back while the other trainer still reads the epoch, opens it
    again saying what it had from each worker, and gets the rest, each element once."""
    pause_one_of_two(1200, other_delay=0.02, seconds=20.0)  # (the other still reads)


class Journaled:
    """A broker on a work dir with 2 workers (tests/test_journal.py), whose broker a test
    SIGKILLs and restarts on that dir (:meth:`restart`); all stopped on exit."""

    def __init__(self, tmp_path) -> None:
        from tests.test_journal import start_journaled

        self.address, self.work_dir, broker, self.workers = start_journaled(tmp_path, 2)
        self.broker = broker

    def restart(self) -> None:
        from tests.test_journal import start_broker

        self.broker.send_signal(signal.SIGKILL)
        self.broker.wait()
        self.broker = start_broker(self.address, self.work_dir)

    def __enter__(self) -> Journaled:
        return self

    def __exit__(self, *exc: object) -> None:
        for process in [*self.workers, self.broker]:
            stop(process)


@pytest.mark.slow  # (about 10 s)
@pytest.mark.parametrize("own", [False, True])
def test_a_shared_job_through_a_broker_restart_on_its_work_dir_is_exact(tmp_path, own):
    """The broker of a shared job is SIGKILLed mid-epoch and restarted on its work dir:
    two trainers reading, and one that joins after the restart, each get every element
    once. With ``own``, trainer b batches after the shared map (a branch, kept in the
    journal: it is b's branch again after the restart)."""
    pipeline = Pipeline.range(2000, split_size=20).map(_sleepy)
    got: dict[str, list[int]] = {}
    with Journaled(tmp_path) as service_:

        def read(name: str) -> None:
            if name == "c":
                wait_for(lambda: len(got.get("a", ())) >= 900, timeout=60, what="the restart")
            got[name] = []
            mine = pipeline.batch(5) if own and name == "b" else pipeline
            with Loader(mine, broker=service_.address, share=True, timeout=60) as loader:
                for x in loader:
                    got[name].extend(np.asarray(x).reshape(-1).tolist())
                    if name == "a" and len(got[name]) == 500:
                        if own:
                            (job,) = shared_jobs(service_.address)
                            assert sorted(t["branch"] for t in job["trainers"]) == [0, 1]
                        service_.restart()
                    if name == "b":
                        time.sleep(0.001)

        run_together([functools.partial(read, name) for name in "abc"], timeout=120)
    for name in "abc":
        exactly_once(got[name], 2000)


@pytest.mark.slow  # (about 10 s each)
@pytest.mark.parametrize("after", [0.2, 1.5])
def test_a_broker_restarted_around_a_dead_worker_s_fence_is_exact(tmp_path, after):
    """A shared job's worker is SIGKILLed and, ``after`` seconds (before the broker saw
    the death, or while it asks the trainers what they had), the broker is SIGKILLed too
    and restarted on its work dir. The fence is in no journal: the restarted broker has
    the dead worker from it, sees it silent, and fences it again; the trainers answer
    again. Each trainer gets every element once."""
    pipeline = Pipeline.range(2000, split_size=20).map(_sleepy)
    got: dict[str, list[int]] = {}
    with Journaled(tmp_path) as service_:

        def read(name: str) -> None:
            got[name] = []
            with Loader(pipeline, broker=service_.address, share=True, timeout=60) as loader:
                for x in loader:
                    got[name].append(int(x))
                    if name == "a" and len(got[name]) == 500:
                        service_.workers[0].send_signal(signal.SIGKILL)
                        service_.workers[0].wait()
                        time.sleep(after)
                        service_.restart()
                    if name == "b":
                        time.sleep(0.001)

        run_together([functools.partial(read, name) for name in "ab"], timeout=120)
    for name in "ab":
        exactly_once(got[name], 2000)


@pytest.mark.slow
def test_a_shared_job_gives_a_worker_whose_splits_nobody_would_read_again_by_draining():
    """A second job takes one of a shared job's workers mid-epoch once both workers were
    told that no split is left (the faster trainer has ended its epoch; production follows
    it): nobody would read the moved worker's splits again, so it drains, sending its
    window to the slower trainer first. (It moved at once: the slower trainer lost what it
    had not been sent yet, 19 to 103 of 240 in 6 runs, unless the worker came back to the job, once
    the second job's epoch was over, before the slower trainer ended its epoch.)"""
    n = 2 * N  # 24 splits: each worker reads about half of them
    with trainer_service(2) as (address, _):
        slow = Trainer(address, "--delay", "0.02", n=n)  # about 5 s
        fast = Trainer(address, "--delay", "0.001", n=n)
        wait_for(lambda: slow.progress >= 10, what="the slow trainer's first elements")
        (fast_epoch,) = fast.epochs()  # both workers have ended their pass
        # Its epoch (about 5 s too) outlasts the rest of the slow trainer's: the moved
        # worker does not come back to the shared job before the slow trainer ends its epoch.
        other = Trainer(address, "--delay", "0.04", variant=2)
        for epoch, size in ((fast_epoch, n), (slow.epochs()[0], n), (other.epochs()[0], N)):
            exactly_once(epoch["got"], size)


def _packed(batch: np.ndarray) -> np.ndarray:
    """A packer: element ``v`` is ``1 + v % 3`` tokens ``v``, packed into rows of 4
    (the last padded with -1): another number of rows than elements."""
    tokens = [int(v) for v in batch for _ in range(1 + int(v) % 3)]
    tokens += [-1] * (-len(tokens) % 4)
    return np.array(tokens).reshape(-1, 4)


@pytest.mark.slow
def test_a_shared_job_s_worker_paused_past_its_heartbeats_repeats_no_packed_row():
    """A worker of a shared job packing rows (a map between batch and unbatch that makes
    another number of rows) is stopped (SIGSTOP) for 3 s, longer than the broker waits
    for its heartbeats, then continued: the trainer gets every token once. (The trainer
    used to read the worker on for a grace after answering its fence: what it sent once
    continued was made again by the other worker too, 1,477-4,488 of 12,000 tokens.)"""
    pipeline = Pipeline.range(6000, split_size=200).batch(8).map(_packed).unbatch().batch(16)
    want = collections.Counter(int(t) for b in pipeline.iter(0)
                               for t in np.asarray(b).reshape(-1) if t >= 0)
    with service(workers=2) as (address, workers):
        got: collections.Counter = collections.Counter()
        with Loader(pipeline, broker=address, share=True, timeout=60) as loader:
            for i, batch in enumerate(loader):
                got.update(int(t) for t in np.asarray(batch).reshape(-1) if t >= 0)
                if i == 40:
                    os.kill(workers[1].pid, signal.SIGSTOP)
                    time.sleep(3)
                    os.kill(workers[1].pid, signal.SIGCONT)
    assert got == want, (sum((want - got).values()), sum((got - want).values()))
