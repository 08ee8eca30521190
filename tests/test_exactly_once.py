"""Exactly-once epochs (dynamic sharding): every source element of an epoch reaches the
consumer once, through worker SIGKILLs, shuffle buffers larger than a split and batching,
and across a Loader's checkpoint (``state_dict``) and resume (``state=``)."""

from __future__ import annotations

import collections
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service import HEARTBEAT, service, start_broker, start_worker, status, stop, wait_for
from zloader import Loader, Pipeline, PipelineError
from zloader.lineage import Ledger

N = 2400


def slow(x):
    time.sleep(0.001)
    return x


def shuffled_batches() -> Pipeline:
    """A shuffle buffer five splits long, then batches: elements from many splits mix."""
    return Pipeline.range(N, split_size=40).map(slow).shuffle(200).batch(8)


def count(counter: collections.Counter, batch) -> None:
    counter.update(np.asarray(batch).tolist())


def assert_exactly_once(seen: collections.Counter, n: int = N) -> None:
    repeated = sorted(k for k, v in seen.items() if v > 1)
    missing = sorted(set(range(n)) - set(seen))
    assert not repeated and not missing, (f"repeated {len(repeated)}: {repeated[:10]}, "
                                          f"missing {len(missing)}: {missing[:10]}")


def run_with_kills(address: str, procs: list, kills: list[int]) -> collections.Counter:
    """One epoch, SIGKILLing a live worker (and starting a new one) after each batch number
    in ``kills``."""
    seen: collections.Counter = collections.Counter()
    with Loader(shuffled_batches(), broker=address, timeout=30) as loader:
        for i, batch in enumerate(loader):
            count(seen, batch)
            if i in kills:
                victim = next(p for p in procs if p.poll() is None)
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                procs.append(start_worker(address))
    return seen


@pytest.mark.slow
def test_workers_killed_mid_epoch_through_a_shuffle_and_batches_lose_and_repeat_nothing():
    with service(workers=3) as (address, procs):
        seen = run_with_kills(address, procs, kills=[30, 150])
        assert_exactly_once(seen)


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_seeded_random_kill_schedule_loses_and_repeats_nothing(seed):
    rng = random.Random(seed)
    kills = sorted(rng.sample(range(5, N // 8 - 20), rng.randint(1, 3)))
    with service(workers=3) as (address, procs):
        assert_exactly_once(run_with_kills(address, procs, kills))


@pytest.mark.slow
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(st.lists(st.integers(0, N // 8 - 20), min_size=1, max_size=4, unique=True))
def test_random_kill_schedules_never_lose_or_repeat_an_element(kills):
    with service(workers=3) as (address, procs):
        assert_exactly_once(run_with_kills(address, procs, sorted(kills)))


@pytest.mark.slow
def test_a_split_that_reads_differently_the_second_time_is_reported():
    def changing(split):  # not reproducible: another value each time it is read
        for _ in range(20):
            yield random.random()

    def paced(x):
        time.sleep(0.01)
        return x

    # The shuffle buffer holds a worker's whole share: every split is read (and its count
    # and digest known to the consumer) before the first element leaves.
    pipeline = Pipeline.from_generator(changing, 20).shuffle(1000).map(paced)
    with service(workers=2) as (address, procs):
        with Loader(pipeline, broker=address, timeout=30, prefetch=1) as loader:
            with pytest.raises(PipelineError, match="read differently"):
                for i, _ in enumerate(loader):
                    if i == 3:
                        procs[0].send_signal(signal.SIGKILL)
                        procs[1].send_signal(signal.SIGKILL)
                        procs.append(start_worker(address))


def test_state_dict_resumes_mid_epoch_exactly_with_several_workers_and_a_shuffle():
    pipeline = Pipeline.range(N, split_size=40).shuffle(300).batch(8)
    seen: collections.Counter = collections.Counter()
    with Loader(pipeline, num_workers=2, timeout=30) as loader:
        for i, batch in enumerate(loader):
            count(seen, batch)
            if i == 60:
                state = loader.state_dict()
                break
    text = json.dumps(state)
    assert len(text) < 64 * 1024 and state["epoch"] == 0
    with Loader(pipeline, num_workers=2, timeout=30, state=json.loads(text)) as loader:
        for batch in loader:
            count(seen, batch)
        assert_exactly_once(seen)
        assert loader.state_dict()["epoch"] == 1  # the epoch is over: the next one is due
        again: collections.Counter = collections.Counter()
        for batch in loader:
            count(again, batch)
        assert_exactly_once(again)


def test_states_of_job_name_consumers_resume_the_epoch_together():
    pipeline = Pipeline.range(N, split_size=40).shuffle(200)
    with service(workers=2) as (address, _):
        seen: collections.Counter = collections.Counter()
        states = []
        loaders = [Loader(pipeline, broker=address, job_name="resumed", timeout=30)
                   for _ in range(2)]
        try:
            # Which consumer gets which split is first come, first served: under load one
            # consumer may get most of the epoch, so take 600 elements from whichever has them.
            live = [iter(loader) for loader in loaders]
            taken = 0
            while taken < 600 and live:
                for iterator in list(live):
                    try:
                        seen[next(iterator)] += 1
                        taken += 1
                    except StopIteration:
                        live.remove(iterator)
            assert taken == 600
            states = [loader.state_dict() for loader in loaders]
        finally:
            for loader in loaders:
                loader.close()
        resumed = [Loader(pipeline, broker=address, job_name="resumed", timeout=30,
                          state=states) for _ in range(2)]
        try:
            iterators = [iter(loader) for loader in resumed]
            live = list(iterators)
            while live:
                for iterator in list(live):
                    try:
                        seen[next(iterator)] += 1
                    except StopIteration:
                        live.remove(iterator)
        finally:
            for loader in resumed:
                loader.close()
        assert_exactly_once(seen)


def test_a_job_name_consumer_that_ended_its_part_does_not_end_the_epoch_it_resumes():
    """One consumer of a job_name reads to the end of its part while the other still holds
    elements it has not yielded: resumed together, their states give the rest of that
    epoch, not a new one (which would repeat the first consumer's part)."""
    pipeline = Pipeline.range(N, split_size=40)
    with service(workers=2) as (address, _):
        seen: collections.Counter = collections.Counter()
        loaders = [Loader(pipeline, broker=address, job_name="ended", timeout=30)
                   for _ in range(2)]
        try:
            first, second = (iter(loader) for loader in loaders)
            for _ in range(20):
                seen[next(second)] += 1
            for x in first:  # the first takes what the second's credits do not hold
                seen[x] += 1
            states = [loader.state_dict() for loader in loaders]
        finally:
            for loader in loaders:
                loader.close()
        assert states[0]["epoch"] == 1 and states[0]["finished"]["epoch"] == 0
        assert sum(seen.values()) < N  # the second held some it had not yielded
        with Loader(pipeline, broker=address, job_name="ended", timeout=30,
                    state=states) as resumed:
            for x in resumed:
                seen[x] += 1
        assert_exactly_once(seen)


def test_state_dict_refuses_what_it_cannot_record():
    with pytest.raises(ValueError, match="exactly_once"):
        Loader(Pipeline.range(10), num_workers=1, sharding="static", state={"zloader": 1})
    with Loader(Pipeline.range(10), num_workers=1, exactly_once=False) as loader:
        with pytest.raises(ValueError, match="exactly_once"):
            loader.state_dict()
    with Loader(Pipeline.range(10).take(5), num_workers=1) as loader:
        with pytest.raises(ValueError, match="take"):
            loader.state_dict()
    with pytest.raises(ValueError, match="another pipeline"):
        state = {"zloader": 1, "fingerprint": "0" * 64, "epoch": 0, "delivered": []}
        Loader(Pipeline.range(10), num_workers=1, state=state)
    with pytest.raises(ValueError, match="delivered"):
        state = {"zloader": 1, "fingerprint": Pipeline.range(10).fingerprint, "epoch": 0,
                 "delivered": [["bad"]]}
        Loader(Pipeline.range(10), num_workers=1, state=state)


@pytest.mark.slow
def test_without_exactly_once_a_dead_workers_splits_are_read_again_whole():
    with service(workers=2) as (address, procs):
        seen: collections.Counter = collections.Counter()
        pipeline = Pipeline.range(600, split_size=20).map(slow)
        with Loader(pipeline, broker=address, timeout=30, exactly_once=False) as loader:
            for i, x in enumerate(loader):
                seen[x] += 1
                if i == 100:
                    procs[0].send_signal(signal.SIGKILL)
        assert set(seen) == set(range(600))  # at least once


@pytest.mark.slow
def test_a_worker_drained_by_sigterm_through_a_shuffle_loses_and_repeats_nothing():
    with service(workers=2) as (address, procs):
        seen: collections.Counter = collections.Counter()
        with Loader(shuffled_batches(), broker=address, timeout=30) as loader:
            for i, batch in enumerate(loader):
                count(seen, batch)
                if i == 30:
                    procs[0].send_signal(signal.SIGTERM)  # as a scale-down would
            assert procs[0].wait(30) == 0  # it left once its buffered elements were out
        assert_exactly_once(seen)


PAUSED_CONSUMER = """
import collections, json, sys, time
import numpy as np
from zloader import Loader, Pipeline

def slow(x):
    time.sleep(0.001)
    return x

pipeline = Pipeline.range({n}, split_size=40).map(slow).shuffle(200).batch(8)
seen = collections.Counter()
with Loader(pipeline, broker={address!r}, timeout=30) as loader:
    for i, batch in enumerate(loader):
        seen.update(np.asarray(batch).tolist())
        if i == 20:
            print("reading", flush=True)
print(json.dumps(sorted(seen.items())), flush=True)
"""


@pytest.mark.slow
def test_a_consumer_paused_past_its_expiry_rejoins_and_gets_each_element_once():
    """SIGSTOP for longer than 3 heartbeats: the broker drops the consumer; on SIGCONT it
    registers again, opens its epoch again and still gets every element once."""
    with service(workers=2) as (address, _):
        out = _paused(PAUSED_CONSUMER.format(n=N, address=address), 4 * HEARTBEAT)
        assert_exactly_once(collections.Counter(dict(json.loads(out))))


def _paused(script: str, seconds: float) -> str:
    """Run consumer ``script`` until it prints "reading", SIGSTOP it for ``seconds``, let
    it finish; its last line of output."""
    consumer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                text=True)
    try:
        assert consumer.stdout is not None
        assert consumer.stdout.readline().strip() == "reading"
        consumer.send_signal(signal.SIGSTOP)
        time.sleep(seconds)  # the broker gives up on it after 3 heartbeats
        consumer.send_signal(signal.SIGCONT)
        out, _ = consumer.communicate(timeout=60)
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()
    assert consumer.returncode == 0
    return out.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_worker_paused_past_its_expiry_is_fenced_and_repeats_nothing_when_it_returns():
    """SIGSTOP a worker longer than 3 heartbeats (a partition, a stall): the broker drops
    it and re-queues its splits; on SIGCONT it comes back, drops the task it still held
    and serves afresh. Nothing it held before reaches the consumer twice."""
    with service(workers=3) as (address, procs):
        seen: collections.Counter = collections.Counter()
        pipeline = Pipeline.range(10_000, split_size=40).map(slow).shuffle(200).batch(8)
        with Loader(pipeline, broker=address, timeout=30) as loader:
            paused = None
            for i, batch in enumerate(loader):
                count(seen, batch)
                if i == 30:
                    procs[0].send_signal(signal.SIGSTOP)
                    paused = time.monotonic()
                if paused is not None and time.monotonic() - paused > 6 * HEARTBEAT:
                    listed = len(status(address)["workers"])  # before it comes back
                    procs[0].send_signal(signal.SIGCONT)
                    paused = None
        procs[0].send_signal(signal.SIGCONT)
        assert_exactly_once(seen, 10_000)
        assert listed == 2  # it had been dropped when it came back


@pytest.mark.slow
def test_a_broker_stopped_for_five_seconds_mid_epoch_loses_and_repeats_nothing():
    """SIGSTOP the broker (a long GC, a slow disk) for longer than its peers' expiry: on
    SIGCONT it does not hold the time it was stopped against them, and what a consumer
    that was only waiting for it holds is never read again."""
    broker, address = start_broker()
    procs = [start_worker(address) for _ in range(2)]
    resume = threading.Timer(5.0, broker.send_signal, (signal.SIGCONT,))
    try:
        wait_for(lambda: len((status(address, 1.0) or {}).get("workers", [])) == 2,
                 what="the workers")
        seen: collections.Counter = collections.Counter()
        pipeline = Pipeline.range(2000, split_size=20).map(slow).shuffle(100).batch(8)
        with Loader(pipeline, broker=address, timeout=30) as loader:
            for i, batch in enumerate(loader):
                count(seen, batch)
                if i == 20:
                    broker.send_signal(signal.SIGSTOP)
                    resume.start()
        assert_exactly_once(seen, 2000)
    finally:
        resume.cancel()
        broker.send_signal(signal.SIGCONT)
        for process in [*procs, broker]:
            stop(process)


PAUSED_WITH_SEGMENTS = """
import itertools
import json
import os
import numpy as np
from zloader import Loader, Pipeline

def big(x):
    return np.full(300_000, x, np.int32)  # 1.2 MB: larger than the ring, a segment each

seen = []
with Loader(Pipeline.range(300, split_size=10).map(big), broker={address!r}, timeout=30,
            ring_bytes=1 << 20) as loader:
    for i, element in enumerate(loader):
        seen.append(int(element[0]))
        if i == 20:
            print("reading", flush=True)
print(json.dumps(seen), flush=True)
"""


@pytest.mark.slow
def test_a_consumer_paused_while_records_wait_in_segments_still_gets_every_element():
    """SIGSTOP a consumer past its expiry while large records wait for it in one-record
    segments: its worker unlinks those it had not mapped yet (it was dropped), so their
    records are lost on the way. The epoch must not end short: the consumer checks it
    against the splits' counts and has what is missing read again."""
    with service(workers=1) as (address, _):
        out = _paused(PAUSED_WITH_SEGMENTS.format(address=address), 8 * HEARTBEAT)
        assert_exactly_once(collections.Counter(json.loads(out)), 300)


@pytest.mark.slow
def test_a_peer_replaying_the_plain_token_cannot_make_an_epoch_end_short(tmp_path):
    """With ``--plain-data`` a peer that replays the token can open a trainer's stream as
    that trainer and take records: the trainer's epoch then ends whole (what was taken is
    read again) or raises, never short without an error."""
    from zloader import ZloaderError
    from zloader.transport.keys import Keys, keygen
    from zloader.transport.protocol import Command, encode

    keys = str(tmp_path / "keys")
    keygen(keys)
    with service(0, keys=keys) as (address, procs):
        procs.append(subprocess.Popen([sys.executable, "-c", "import sys; from zloader.cli "
                                       "import worker_main; sys.exit(worker_main())",
                                       "--broker", address, "--keys", keys, "--plain-data"]))
        pipeline = Pipeline.range(1000, split_size=50).map(slow)
        with Loader(pipeline, broker=address, keys=keys, timeout=20, transport="tcp") as loader:
            iterator = iter(loader)
            seen = collections.Counter([next(iterator)])
            io = loader._io
            (peer,) = io.peers()
            context = zmq.Context()
            thief = context.socket(zmq.DEALER)
            thief.setsockopt(zmq.LINGER, 0)
            Keys.load(keys).connect_plain(thief)
            thief.connect(peer.endpoint)
            thief.send_multipart(encode(Command.OPEN, {
                "job": io.job, "task": peer.task, "consumer": io.registration["consumer"],
                "epoch": 0, "credits": 100_000, "rerun": 0, "ring": None}))
            try:
                seen.update(iterator)
            except ZloaderError as exc:
                assert "ended short" in str(exc)
            else:
                assert_exactly_once(seen, 1000)
            finally:
                thief.close(0)
                context.term()


@pytest.mark.slow
def test_origins_travel_as_runs_and_a_killed_worker_still_loses_and_repeats_nothing():
    """Elements read in order (no shuffle): each record's origins are runs, so what the
    consumer holds of a split is one range, not an index per element; a worker SIGKILLed
    mid-epoch still costs nothing and repeats nothing."""
    n = 3000
    pipeline = Pipeline.range(n, split_size=40)  # (quick elements: records of many)
    seen: collections.Counter = collections.Counter()
    runs = []  # per record yielded: (elements, runs on the wire, splits they came from)
    with service(workers=3) as (address, procs), \
            Loader(pipeline, broker=address, timeout=30) as loader:
        yielded = loader._merger.yielded
        record = yielded.record

        def note(origins, elements):
            if origins is not None:
                runs.append((int(origins.runs[:, 3].sum()), len(origins.runs),
                             len({tuple(r) for r in origins.runs[:, :2].tolist()})))
            record(origins, elements)

        yielded.record = note
        for i, x in enumerate(loader):
            seen[int(x)] += 1
            if i == 300:
                ledger = loader._merger.yielded.ledger
                assert ledger.open or ledger.done
                # at most one range per split read so far, one more for a record under way
                assert all(len(held.starts) <= 2 for held in ledger.open.values())
                victim = next(p for p in procs if p.poll() is None)
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                procs.append(start_worker(address))
    assert_exactly_once(seen, n)
    assert runs and all(count == splits for _, count, splits in runs)  # a run per split
    assert sum(elements for elements, _, _ in runs) >= n and any(e > 1 for e, _, _ in runs)


@pytest.mark.slow  # (over 3 s: the fast suite keeps to 6 minutes on 2 cores)
def test_job_name_consumers_of_which_one_leaves_first_share_an_epoch_without_repeats():
    """Two Loaders of one job_name take part in one epoch of a quick pipeline, and the
    first done leaves: the other may end the epoch as the job's only consumer then; what
    it lacks went to the one that left, and reading it again (as a lone consumer does for
    records lost on the way) would repeat it."""
    with service(workers=2) as (address, _procs):
        for attempt in range(8):
            seen: list[collections.Counter] = [collections.Counter(), collections.Counter()]
            made = threading.Barrier(2)

            def consume(i: int, attempt: int = attempt, seen: list = seen,
                        made: threading.Barrier = made) -> None:
                with Loader(Pipeline.range(800, split_size=40), broker=address,
                            job_name=f"together-{attempt}", timeout=30) as loader:
                    made.wait(30)  # both joined the one job; the first done leaves first
                    for x in loader:
                        seen[i][int(x)] += 1

            threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert_exactly_once(seen[0] + seen[1], 800)



def _made_by(x: int) -> tuple[int, int]:
    time.sleep(0.002)  # (slow enough that both Loaders get some of each worker's)
    return x, os.getpid()


def test_what_a_job_name_consumer_yielded_before_it_left_is_not_read_again_for_the_others():
    """A Loader of a job_name yields a few elements and closes mid-epoch; then the worker
    that made them is SIGKILLed. Its splits are read again for the Loader that stays,
    less what that one holds and what the one that left had yielded (its BYE said: the
    broker was not to count on a consumer that is gone), so nothing it yielded comes
    again; the states of both resume the rest. Before, every element it had yielded of
    those splits came to the other Loader too."""
    pipeline = Pipeline.range(600, split_size=50).map(_made_by)
    with service(workers=2) as (address, procs):
        by_pid = {proc.pid: proc for proc in procs}
        stays = Loader(pipeline, broker=address, job_name="left", timeout=30)
        try:
            kept = iter(stays)
            first = [next(kept)]  # (both are consumers of the job's epoch 0 now)
            with Loader(pipeline, broker=address, job_name="left", timeout=30) as leaves:
                gone = list(itertools.islice(leaves, 5))
                left_state = leaves.state_dict()
            maker = by_pid[gone[0][1]]
            maker.send_signal(signal.SIGKILL)
            maker.wait()
            rest = first + list(kept)
            state = stays.state_dict()
        finally:
            stays.close()
        with Loader(pipeline, broker=address, job_name="left", timeout=30,
                    state=[state, left_state]) as resumed:
            after = list(resumed)
    values = collections.Counter(x for x, _ in gone + rest + after)
    assert not {x for x, _ in gone} & {x for x, _ in rest}  # (none it yielded came again)
    assert_exactly_once(values, 600)


def test_a_job_name_consumer_that_finished_its_part_says_what_it_yielded_as_it_leaves():
    """A Loader of a job_name that ended its part of an epoch and closes says in its BYE
    what it yielded of that epoch (the others may still be in it, and a worker that had
    ended the epoch may die after this Loader left: the broker then learns of the death
    only after its BYE, and reads that worker's splits again for the others less this).
    Before, it said nothing: the generated split mode repeated 1-45 elements in about 1
    of 100 cases (a worker SIGKILLed while one Loader confirmed the epoch's end and the
    other had not)."""
    pipeline = Pipeline.range(300, split_size=50)
    with service(workers=2) as (address, _):
        with Loader(pipeline, broker=address, job_name="says", timeout=30) as one:
            assert one._left() is None  # (nothing yielded yet: nothing to say)
            got = list(one)
            left = one._left()
            assert left is not None and left == one.state_dict()["finished"]
    assert left["epoch"] == 0 and sorted(got) == list(range(300))
    ledger = Ledger()
    ledger.merge_json(left["delivered"])
    assert all(ledger.info((0,), split) == {"all": True} for split in range(6))
