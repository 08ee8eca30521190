"""A broker with a work dir journals its state and resumes every job after a SIGKILL:
workers and Loaders reconnect by themselves and carry on where they were."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.service import BIN, HEARTBEAT, free_port, start_worker, status, stop, wait_for
from tests.test_state import nested, ready, record, register, split, task_of, tasks_by_worker
from zloader import Loader, Pipeline, ZloaderError
from zloader.broker.journal import VERSION, Journal, line_of
from zloader.broker.state import State
from zloader.transport.protocol import Command


def test_a_restored_state_hands_out_the_splits_where_it_stopped(tmp_path):
    state = State(journal=Journal(tmp_path))
    ready(state, "w1")
    ready(state, "w2")
    out = register(state, "c1", splits=6)
    tasks = {o.identity.decode(): o.body["task"] for o in out if o.command is Command.TASK}
    assert [split(state, "w1", tasks["w1"]) for _ in range(2)] == [0, 1]
    assert split(state, "w2", tasks["w2"]) == 2
    state.pass_done(b"w1", record(Command.PASS_DONE, {"task": tasks["w1"], "pass": [0]}), 0.0)
    state.journal.close()

    again = State(journal=Journal(tmp_path))
    assert again.restore(now=100.0) == 1
    (job,) = again.jobs.values()
    passed = job.handout.passes[(0,)]
    assert passed.handed == {"w2": [2]} and list(passed.order) == [3, 4, 5]
    # The workers come back under new connections and keep their tasks: the same TASK
    # again (a worker that runs it already ignores it), no new one.
    for name in ("w1", "w2"):
        out = ready(again, name, now=100.5)
        assert [o.command for o in out] == [Command.ACK, Command.TASK]
        assert out[0].body["task"] == out[1].body["task"] == tasks[name]
    # The consumer comes back too, naming its job: it gets that job, not a new one.
    view = _registered_again(again, job.id, 6, 100.5)
    assert view["job"] == job.id and len(again.jobs) == 1
    # w2 lost the answer to its request: asking again with have=0 gets split 2 again.
    (answer,) = again.split_request(b"w2", record(Command.SPLIT_REQ, {
        "task": tasks["w2"], "pass": [0], "have": 0}), 100.5)
    assert answer.body["split"] == 2
    assert split(again, "w1", tasks["w1"]) == 3
    # A worker that stops answering: its split goes to the others.
    again.seen(b"w1", 103.0)
    again.seen(b"c1", 103.0)
    again.tick(104.0)
    assert "w2" not in again.workers
    assert list(again.jobs[job.id].handout.passes[(0,)].requeued) == [2]


@pytest.mark.parametrize("compacted", [False, True])
def test_a_dead_workers_splits_are_read_again_once_after_a_restart(tmp_path, compacted):
    """A worker that died had its splits re-queued, each journaled as a requeue event of
    its own: the restarted broker hands each out once, not once for the worker's leave
    and once more for its event (which read them twice)."""
    state = State(journal=Journal(tmp_path))
    for name in ("w1", "w2", "w3"):
        ready(state, name)
    tasks = {o.identity.decode(): o.body["task"] for o in register(state, "c1", splits=8)
             if o.command is Command.TASK}
    assert [split(state, name, tasks[name]) for name in ("w1", "w2")] == [0, 1]
    state.pass_done(b"w1", record(Command.PASS_DONE, {"task": tasks["w1"], "pass": [0]}), 0.0)
    if compacted:
        state.journal.compact(state.snapshot())
    for name in ("w3", "c1"):
        state.seen(name.encode(), 9.0)
    state.tick(10.0)  # w1 and w2 silent past the expiry: dropped, splits 0 and 1 re-queued
    assert sorted(state.workers) == ["w3"]
    (job,) = state.jobs.values()
    before = list(job.handout.passes[(0,)].requeued)
    assert sorted(before) == [0, 1]
    state.journal.close()

    again = State(journal=Journal(tmp_path))
    assert again.restore(now=100.0) == 1 and again.journal.skipped == []
    assert list(again.jobs[job.id].handout.passes[(0,)].requeued) == before
    ready(again, "w3", now=100.5)
    handed = [split(again, "w3", tasks["w3"], now=100.5) for _ in range(8)]
    assert sorted(handed) == list(range(8))


def test_a_job_is_collected_from_the_journal_too(tmp_path):
    state = State(journal=Journal(tmp_path))
    ready(state, "w1")
    task_of(register(state, "c1"))
    state.bye(b"c1", 0.0)
    state.tick(10.0)  # collected
    assert not state.jobs
    again = State(journal=Journal(tmp_path))
    assert again.restore(now=0.0) == 0
    assert not os.listdir(tmp_path / "pipelines")


def start_broker(address: str, work_dir: str) -> subprocess.Popen:
    return subprocess.Popen([os.path.join(BIN, "zloader-broker"), "--bind", address,
                             "--heartbeat", str(HEARTBEAT), "--work-dir", work_dir,
                             "--log-level", "error"])


def start_journaled(tmp_path, workers: int) -> tuple[str, str, subprocess.Popen, list]:
    """A broker with a work dir and ``workers`` workers, registered: (address, work dir,
    broker, workers)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    work_dir = str(tmp_path / "broker")
    broker = start_broker(address, work_dir)
    wait_for(lambda: status(address, 1.0) is not None, what="the broker")
    started = [start_worker(address) for _ in range(workers)]
    wait_for(lambda: len(status(address)["workers"]) == workers, what="the workers")
    return address, work_dir, broker, started


@pytest.mark.slow
def test_a_broker_killed_mid_epoch_and_restarted_resumes_the_job_exactly(tmp_path):
    def slow(x):
        time.sleep(0.004)
        return x

    address, work_dir, broker, workers = start_journaled(tmp_path, 2)
    try:
        with Loader(Pipeline.range(600, split_size=10).map(slow), broker=address,
                    timeout=30) as loader:
            seen: list[int] = []
            killed = threading.Event()

            def kill_and_restart() -> None:
                wait_for(lambda: len(seen) >= 100, what="progress")
                broker.send_signal(signal.SIGKILL)
                broker.wait()
                killed.set()
                time.sleep(1.0)  # down a while: the workers keep serving what they hold
                restarted.append(start_broker(address, work_dir))

            restarted: list[subprocess.Popen] = []
            thread = threading.Thread(target=kill_and_restart, daemon=True)
            thread.start()
            start = time.monotonic()
            for x in loader:
                seen.append(x)
            thread.join(30)
            assert killed.is_set() and restarted
            assert time.monotonic() - start < 60
            # Every element of the epoch once: the journal kept which splits were handed
            # out, and a worker whose answer was lost got the same split again.
            assert sorted(seen) == list(range(600))
            assert sorted(loader) == list(range(600))  # and the next epoch is whole
            body = status(address)  # (before close: a job whose consumers left goes at once)
            assert len(body["workers"]) == 2 and len(body["jobs"]) == 1
    finally:
        for process in workers:
            stop(process)
        stop(broker)
        for process in locals().get("restarted", []):
            stop(process)



def _tag(name):
    return lambda x: (name, int(x))


@pytest.mark.slow  # (over 3 s: the fast suite keeps to 6 minutes on 2 cores)
def test_a_broker_restarted_on_its_work_dir_resumes_a_mix_per_input(tmp_path):
    """The journal keeps a mix's layout (which splits each input's passes read): the
    restarted broker hands out the rest of each input's splits, none twice."""
    def slow(pair):
        time.sleep(0.004)
        return pair

    mix = Pipeline.mix([Pipeline.range(400, split_size=10).map(_tag("a")),
                        Pipeline.range(200, split_size=10).map(_tag("b"))],
                       [0.6, 0.4], seed=2).map(slow)
    address, work_dir, broker, workers = start_journaled(tmp_path, 2)
    restarted: list[subprocess.Popen] = []
    try:
        with Loader(mix, broker=address, timeout=30) as loader:
            seen: list[tuple[str, int]] = []
            for element in loader:
                seen.append((str(element[0]), int(element[1])))
                if len(seen) == 100:
                    broker.send_signal(signal.SIGKILL)
                    broker.wait()
                    restarted.append(start_broker(address, work_dir))
        assert sorted(seen) == sorted([("a", x) for x in range(400)]
                                      + [("b", x) for x in range(200)])
    finally:
        for process in [*workers, broker, *restarted]:
            stop(process)

@pytest.mark.slow
def test_a_worker_killed_while_the_broker_is_down_loses_and_repeats_nothing(tmp_path):
    """Broker and a worker both SIGKILLed mid-epoch, with a shuffle buffer larger than a
    split and batches: the restarted broker learns from its journal which splits the dead
    worker held, fences them, and they are read again less what the consumer holds."""
    def slow(x):
        time.sleep(0.003)
        return x

    address, work_dir, broker, workers = start_journaled(tmp_path, 3)
    restarted: list[subprocess.Popen] = []
    try:
        pipeline = Pipeline.range(1200, split_size=20).map(slow).shuffle(100).batch(4)
        with Loader(pipeline, broker=address, timeout=30) as loader:
            seen: list[int] = []
            for i, batch in enumerate(loader):
                seen += [int(x) for x in batch]
                if i == 40:
                    broker.send_signal(signal.SIGKILL)
                    broker.wait()
                    workers[0].send_signal(signal.SIGKILL)
                    workers[0].wait()
                    restarted.append(start_broker(address, work_dir))
            assert sorted(seen) == list(range(1200))
    finally:
        for process in [*workers, broker, *restarted]:
            stop(process)


@pytest.mark.slow
def test_a_worker_killed_before_a_broker_restart_has_its_splits_read_once_more(tmp_path):
    """A job without exactly-once: a worker is SIGKILLed, the broker drops it (journaling
    its leave and the re-queues), then the broker is SIGKILLed and restarted. The dead
    worker's splits are read once more, so no element comes more than twice (a replay
    that re-queued them again read some three times)."""
    def slow(x):
        time.sleep(0.002)
        return x

    address, work_dir, broker, workers = start_journaled(tmp_path, 3)
    restarted: list[subprocess.Popen] = []
    try:
        with Loader(Pipeline.range(3000, split_size=30).map(slow), broker=address,
                    timeout=30, exactly_once=False) as loader:
            seen: list[int] = []
            for x in loader:
                seen.append(x)
                if len(seen) == 400:
                    workers[0].send_signal(signal.SIGKILL)
                    workers[0].wait()
                    wait_for(lambda: len(status(address)["workers"]) == 2,
                             what="the broker to drop the dead worker")
                    broker.send_signal(signal.SIGKILL)
                    broker.wait()
                    restarted.append(start_broker(address, work_dir))
        counts = collections.Counter(seen)
        assert sorted(counts) == list(range(3000))
        assert max(counts.values()) <= 2, counts.most_common(3)
    finally:
        for process in [*workers, broker, *restarted]:
            stop(process)


def test_the_journal_and_pipelines_are_files_only_the_broker_user_can_read(tmp_path):
    """journal.jsonl and each job's pickled pipeline are mode 0600, also after a
    compaction, and a journal another user could write is made 0600 when reopened."""
    def modes() -> set[int]:
        files = [tmp_path / "journal.jsonl", *(tmp_path / "pipelines").iterdir()]
        return {stat.S_IMODE(path.stat().st_mode) for path in files}

    state = State(journal=Journal(tmp_path))
    ready(state, "w1")
    task_of(register(state, "c1"))
    assert len(os.listdir(tmp_path / "pipelines")) == 1 and modes() == {0o600}
    state.journal.compact(state.snapshot())
    assert modes() == {0o600}
    state.journal.close()
    os.chmod(tmp_path / "journal.jsonl", 0o666)
    Journal(tmp_path).close()
    assert modes() == {0o600}


def _journal_lines(tmp_path) -> list[bytes]:
    """A journal as a broker writes it: two workers, a job, splits, a pass done, a gone
    worker, a compacted pass; returned as its lines (the pipeline stays in tmp_path)."""
    state = State(journal=Journal(tmp_path))
    ready(state, "w1")
    ready(state, "w2")
    tasks = {o.identity.decode(): o.body["task"] for o in register(state, "c1", splits=6)
             if o.command is Command.TASK}
    split(state, "w1", tasks["w1"])
    split(state, "w2", tasks["w2"])
    state.pass_done(b"w1", record(Command.PASS_DONE, {"task": tasks["w1"], "pass": [0]}), 0.0)
    state.epoch_started(b"c1", record(Command.EPOCH, {"epoch": 1}), 0.0)
    state.journal.compact(state.snapshot())
    split(state, "w2", tasks["w2"])
    state.journal.close()
    return (tmp_path / "journal.jsonl").read_bytes().splitlines(keepends=True)


def _body(line: bytes) -> dict:
    """The event a journal line holds: its JSON less the line's own sequence number
    and checksum."""
    body = json.loads(line)
    body.pop("n", None)
    body.pop("c", None)
    return body


def _numbers(lines: list[bytes]) -> list[int]:
    """The sequence numbers of journal lines."""
    return [json.loads(line)["n"] for line in lines]


def test_every_kind_of_event_reads_back_as_the_record_written(tmp_path):
    """Each journal line is a record of zloader/broker/events.py: one of each kind, written
    through the journal and replayed, parses back field for field; and every line a broker
    wrote (a job's life and a compaction) parses."""
    from zloader.broker import events
    from zloader.options import JobOptions

    key, origin = (1, 0), (1, 2)
    written = [
        events.WorkerReady(id="w1", host="h", host_id="h/boot/ns", pid=7,
                           endpoint="tcp://127.0.0.1:5", prefer=None, plain_data=True),
        events.JobCreated(id="j", fingerprint="f" * 64, name="n",
                          options=JobOptions(sharding="static", share=None), num_splits=4,
                          shuffle_splits=True, seed=3, width=2, source_data=None, entropy=9,
                          pipeline={"inherited": True}, inputs=[[2, False, None], [2, True, 1]],
                          prefix={"prefixes": ["a", "b"], "names": ["map"], "first_tap": 1}),
        events.BranchAdded(job="j", branch=1, fingerprint="g" * 64, prefixes=("a", "b", "c"),
                           names=("map", "batch(2)"), first_tap=1, tap=1),
        events.Orphaned(job="j", fence="f1", worker="w1", index=0, died=True,
                        order=[[[0], [3, 1]]], answers={"c1": {"epoch": 0, "done": False,
                                                               "count": 4}},
                        switches=([[0], 0, [0.25, 0.75]], [[0], 1500, [0.5, 0.5]])),
        events.OrphanAdopted(job="j", fence="f1"),
        events.RoundsSet(job="j", size=2),
        events.TaskGiven(job="j", task="t", worker="w1", index=1),
        events.SplitHanded(job="j", pass_=key, split=3, worker="w1", origin=origin),
        events.SplitRequeued(job="j", pass_=key, split=3, skip={"skip": "", "expect": [1, 2]}),
        events.JobResumed(job="j", epoch=1, delivered={"done": []}),
        events.ConsumerLeft(job="j", epoch=1, delivered=[[[1], "", []]]),
        events.PassRead(job="j", pass_=key, worker="w1"),
        events.EpochStarted(job="j", epoch=2),
        events.PassKept(job="j", pass_=key, order=[0, 1], requeued=[3], handed={"w1": [2]},
                        read={"w2": [4]}, skips={"3": {"skip": ""}}, origins=[[3, [1, 2]]]),
        events.JobFailed(job="j", error={"message": "boom"}),
        events.JobEnded(job="j"),
        events.WorkerGone(worker="w1", died=True, fenced=True, clean=False),
        events.WorkerLeft(job="j", task="t", worker="w1", clean=True),
        events.MixWeighed(job="j", worker="w1", pass_=(1,), at=1024, weights=(0.1, 0.9)),
    ]
    assert {type(event) for event in written} == set(events.KINDS.values())
    journal = Journal(tmp_path)
    for event in written:
        assert journal.record(event.to_body())
    journal.close()
    journal = Journal(tmp_path)
    assert [events.parse(line) for _, line in journal.replay()] == written
    journal.close()
    for line in _journal_lines(tmp_path / "life"):
        body = _body(line)
        if body["e"] != "journal":
            assert events.parse(body).to_body() == body


def test_the_events_shapes_are_pinned_to_the_journal_version():
    """zloader.broker.journal.VERSION names the events' shapes: a field added to, dropped from or
    renamed in an event (or in JobOptions, which the job event holds whole) changes what
    a journal written before it holds, and a restarted broker would skip those lines. So
    such a change comes with a new VERSION, and with this list."""
    import dataclasses

    from zloader.broker import events
    from zloader.options import JobOptions

    shapes = {kind: [wire for _, wire, *_ in cls.spec()] for kind, cls in events.KINDS.items()}
    # A line's own fields (version 3): its sequence number and checksum, no event's.
    assert not any({"n", "c"} & set(fields) for fields in shapes.values())
    shapes["job.options"] = [field.name for field in dataclasses.fields(JobOptions)]
    assert VERSION == 7 and shapes == {
        "worker": ["id", "host", "host_id", "pid", "endpoint", "prefer", "plain_data"],
        "job": ["id", "fingerprint", "name", "options", "num_splits", "shuffle_splits",
                "seed", "width", "source_data", "entropy", "pipeline", "inputs", "prefix"],
        "branch": ["job", "branch", "fingerprint", "prefixes", "names", "first_tap", "tap",
                   "pipeline", "source_data"],
        "orphan": ["job", "fence", "worker", "index", "died", "order", "answers",
                   "switches"],
        "weighed": ["job", "worker", "pass", "at", "weights"],
        "adopted": ["job", "fence"],
        "job.options": ["sharding", "deterministic", "on_error", "num_workers", "balanced",
                        "num_consumers", "share", "exactly_once", "weight", "objects",
                        "shards"],
        "rounds": ["job", "size"], "task": ["job", "task", "worker", "index"],
        "split": ["job", "pass", "split", "worker", "origin"],
        "requeue": ["job", "pass", "split", "skip"], "resume": ["job", "epoch", "delivered"],
        "bye": ["job", "epoch", "delivered"],
        "done": ["job", "pass", "worker"], "epoch": ["job", "epoch"],
        "pass": ["job", "pass", "order", "requeued", "handed", "read", "skips", "origins"],
        "failed": ["job", "error"], "end": ["job"],
        "gone": ["worker", "died", "fenced", "clean"],
        "left": ["job", "task", "worker", "fenced", "clean"]}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3), max_leaves=8)


@st.composite
def corrupt_line(draw, events: list[dict], number: int) -> bytes:
    """A line that is not what the broker writes: bytes that are not UTF-8, or one of its
    events with a field of another type (or missing, or an extra one), with no sequence
    number and checksum or (to be checked for its fields) with valid ones, as line
    ``number`` (one after the others')."""
    if draw(st.booleans()):
        text = draw(st.binary(min_size=1, max_size=40))
        return text.replace(b"\n", b"") + b"\xff\xfe\n"
    original = draw(st.sampled_from(events))
    event = dict(original)
    name = draw(st.sampled_from(sorted(event)))
    value = draw(json_values)
    if draw(st.booleans()):
        del event[name]
    else:
        event[name] = value
    assume(event != original)
    if draw(st.booleans()):
        return line_of(event, number)
    return json.dumps(event).encode() + b"\n"


@given(st.data())
@settings(max_examples=150, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_corrupt_journal_lines_are_skipped_and_counted_never_fatal(tmp_path_factory, data):
    """Lines with invalid UTF-8, or events whose fields have the wrong type (with a
    checksum that holds or none), among a real journal's: a broker restoring it skips them
    (counted, with their line numbers) and its state then works (ticks, status, metrics,
    a worker's return, a compaction)."""
    root = tmp_path_factory.mktemp("journal")
    lines = _journal_lines(root)
    events = [_body(line) for line in lines]
    top = max(_numbers(lines))
    bad = [data.draw(corrupt_line(events, top + 1 + i))
           for i in range(data.draw(st.integers(1, 6)))]
    for line in bad:
        lines.insert(data.draw(st.integers(0, len(lines))), line)
    (root / "journal.jsonl").write_bytes(b"".join(lines))
    state = State(journal=Journal(root))
    state.restore(now=100.0)
    assert set(state.journal.skipped) <= {number for number, line in enumerate(lines, 1)
                                          if line in bad}
    ready(state, "w1", now=100.5)
    ready(state, "w3", now=100.5)
    for worker in list(state.workers.values()):
        if worker.task is not None:
            state.split_request(worker.id.encode(), record(Command.SPLIT_REQ, {
                "task": worker.task, "pass": [0]}), 100.5)
    for now in (101.0, 102.0, 104.0, 140.0):
        state.tick(now)
        json.dumps(state.status(now))
        state.metrics(now)
    state.journal.compact(state.snapshot())
    state.journal.close()


def test_a_broker_restarts_on_a_journal_with_corrupt_lines(tmp_path):
    """Invalid UTF-8, a job whose options are a number, a pass whose `handed` is a list
    (both with sequence numbers and checksums that hold): the restarted zloader-broker
    skips those three lines, says so once in its log (the count, the line numbers and
    the kinds), and serves the job the other lines describe."""
    lines = _journal_lines(tmp_path)
    top = max(_numbers(lines))
    job = next(_body(line) for line in lines if b'"e":"job"' in line)
    compacted = next(_body(line) for line in lines if b'"e":"pass"' in line)
    lines.insert(1, b'{"e":"epoch","job":"\xff\xfe"}\n')
    lines.insert(3, line_of({**job, "id": "other", "options": 5}, top + 1))
    lines.append(line_of({**compacted, "handed": ["w1"]}, top + 2))
    (tmp_path / "journal.jsonl").write_bytes(b"".join(lines))
    address = f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([os.path.join(BIN, "zloader-broker"), "--bind", address,
                               "--heartbeat", str(HEARTBEAT), "--work-dir", str(tmp_path),
                               "--log-level", "warning"], stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: status(address, 1.0) is not None, what="the restarted broker")
        assert [j["job"] for j in status(address)["jobs"]] == [job["id"]]
    finally:
        stop(broker)
    log_text = (tmp_path / "broker.log").read_text()
    assert log_text.count("skipped") == 1
    assert f"skipped 3 lines (2, 4, {len(lines)})" in log_text
    assert "not a UTF-8 JSON event (torn or corrupt): 1" in log_text
    assert "fields missing or of the wrong type: 2" in log_text


def test_a_full_work_dir_fails_the_consumers_loudly_and_the_broker_keeps_serving(tmp_path):
    """The journal's disk is full (journal.jsonl is /dev/full: every write fails with
    ENOSPC): a Loader raises a ZloaderError naming the work dir and the errno text within
    its timeout, and the broker stays up and answers STATUS."""
    work_dir = tmp_path / "broker"
    work_dir.mkdir(mode=0o700)
    (work_dir / "journal.jsonl").symlink_to("/dev/full")
    address = f"tcp://127.0.0.1:{free_port()}"
    broker = start_broker(address, str(work_dir))
    worker = start_worker(address)
    try:
        wait_for(lambda: len((status(address, 1.0) or {"workers": []})["workers"]) == 1,
                 what="the broker and its worker")
        start = time.monotonic()
        with Loader(Pipeline.range(1000), broker=address, timeout=20) as loader, \
                pytest.raises(ZloaderError, match=f"{work_dir}.*No space left on device"):
            list(loader)
        assert time.monotonic() - start < 20
        assert broker.poll() is None and status(address) is not None
    finally:
        stop(worker)
        stop(broker)


def test_a_journal_starts_with_its_schema_version(tmp_path):
    """A new journal's first line names its schema version, and so does a compacted
    one's; a journal from before versions (no such line) is read as version 1, which
    this zloader (version 7: lines numbered and checksummed, shared jobs' branches, what
    consumers that left had yielded, when a shared mix took new weights; it reads
    versions 2 to 6 too) refuses, naming both."""

    state = State(journal=Journal(tmp_path))
    ready(state, "w1")
    task_of(register(state, "c1"))

    def first_line() -> dict:
        return _body((tmp_path / "journal.jsonl").read_bytes().splitlines()[0])

    assert first_line() == {"e": "journal", "version": VERSION} and VERSION == 7
    state.journal.compact(state.snapshot())
    assert first_line() == {"e": "journal", "version": VERSION}
    state.journal.close()
    lines = (tmp_path / "journal.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "journal.jsonl").write_bytes(b"".join(lines[1:]))
    with pytest.raises(ZloaderError, match=f"{tmp_path}.*version 1.*versions 2, 3, 4, 5, 6"):
        Journal(tmp_path)
    (tmp_path / "journal.jsonl").write_bytes(b"".join(lines))  # its version line back
    again = State(journal=Journal(tmp_path))
    assert again.restore(now=0.0) == 1 and again.journal.skipped == []
    again.journal.close()


def test_a_journal_of_another_version_is_refused_naming_the_work_dir(tmp_path):
    """A work dir whose journal another zloader wrote in a schema this one does not know:
    refused (not misread, not rewritten) with an error naming the work dir and both
    versions; zloader-broker exits with it, not with a traceback."""
    journal = tmp_path / "journal.jsonl"
    journal.write_text('{"e":"journal","version":99}\n{"e":"end","job":"x"}\n')
    journal.chmod(0o600)
    before = journal.read_bytes()
    with pytest.raises(ZloaderError, match=f"{tmp_path}.*version 99.*versions 2, 3, 4"):
        Journal(tmp_path)
    done = subprocess.run([os.path.join(BIN, "zloader-broker"), "--bind",
                           f"tcp://127.0.0.1:{free_port()}", "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert str(tmp_path) in done.stderr and "version 99" in done.stderr
    assert journal.read_bytes() == before


# --- torn, reordered, stale and impossible lines ------------------------------------------------

SPLITS = 40


def _busy_journal(root) -> dict[str, str]:
    """A journal as a broker writes it mid-epoch: three workers read a job of SPLITS
    splits, one finishes its pass, w2 dies (its splits re-queued, each a line of its
    own) and the others take them; returns each worker's task."""
    state = State(journal=Journal(root))
    for name in ("w1", "w2", "w3"):
        ready(state, name)
    tasks = tasks_by_worker(register(state, "c1", splits=SPLITS))
    for _ in range(5):
        for name in ("w1", "w2", "w3"):
            split(state, name, tasks[name])
    state.pass_done(b"w1", record(Command.PASS_DONE, {"task": tasks["w1"], "pass": [0]}), 0.0)
    for name in ("w1", "w3", "c1"):
        state.seen(name.encode(), 9.0)
    state.tick(10.0)  # w2 silent past its expiry: dropped, its 5 splits re-queued
    assert "w2" not in state.workers
    for _ in range(6):
        for name in ("w1", "w3"):
            split(state, name, tasks[name], now=10.0)
    state.journal.close()
    return tasks


def _summary(state: State) -> dict:
    """What a restored state holds that decides which split goes where."""
    return {"workers": {w.id: w.task for w in state.workers.values()},
            "jobs": {job.id: (dict(job.tasks), job.epoch, {
                key: (list(p.order), list(p.requeued), p.handed, p.read, p.skips)
                for key, p in job.handout.passes.items()}) for job in state.jobs.values()}}


def _registered_again(state: State, job_id: str, splits: int, now: float) -> dict:
    """The JOB view a restarted broker answers consumer c1's REGISTER naming ``job_id``
    with (its source of ``splits`` splits)."""
    (view,) = [o.body for o in state.register(b"c1", record(Command.REGISTER, nested({
        "consumer": "c1", "fingerprint": "f" * 64, "job_name": None, "job": job_id,
        "sharding": "dynamic", "deterministic": False, "num_workers": 0,
        "on_error": "raise", "host_id": "h/boot/ns", "pid": 1,
        "source": {"num_splits": splits, "shuffle_splits": False, "seed": None}}),
        [b"pipeline"]), now) if o.command is Command.JOB]
    return view


def _restored(root) -> State:
    state = State(journal=Journal(root))
    state.restore(now=100.0)
    return state


def _each_split_once(state: State, tasks: dict[str, str]) -> None:
    """The restored state holds each split of the epoch once (waiting in the pass or held
    by a worker), and its workers, back, are handed the waiting ones, each once, then
    none: no split twice, none lost, the pass ends."""
    (job,) = state.jobs.values()
    handing = job.handout.passes[(0,)]
    held = [split for group in (handing.handed, handing.read) for splits in group.values()
            for split in splits]
    waiting = [*handing.requeued, *handing.order]
    assert sorted(held + waiting) == list(range(SPLITS))
    for name in ("w1", "w3"):
        ready(state, name, now=100.5)
    drained = []
    while (got := split(state, "w3", tasks["w3"], now=100.5)) is not None:
        drained.append(got)
    assert drained == waiting


@pytest.mark.parametrize("torn", ["half a line", "all but its newline", "the only line"])
def test_a_torn_last_line_is_cut_when_the_journal_is_opened(tmp_path, caplog, torn):
    """A broker killed while writing a line leaves it torn, with no newline. The broker
    restarted on that work dir cuts it (counted, logged) before it appends anything: its
    next line starts a line of its own, so the next restart reads it (appended to the torn
    one, the two made one corrupt line, skipped, and that split was handed out again)."""
    tasks = _busy_journal(tmp_path)
    path = tmp_path / "journal.jsonl"
    whole = path.read_bytes()
    last = whole.splitlines(keepends=True)[-1]
    tail = {"half a line": last[:len(last) // 2], "all but its newline": last[:-1],
            "the only line": last[:30]}[torn]
    if torn == "the only line":
        path.write_bytes(tail)
        state = State(journal=Journal(tmp_path))
        assert state.journal.torn == 30
        assert _body(path.read_bytes()) == {"e": "journal", "version": VERSION}
        state.journal.close()
        return
    path.write_bytes(whole + tail)
    with caplog.at_level("WARNING", logger="zloader.broker"):
        state = State(journal=Journal(tmp_path))
    assert state.journal.torn == len(tail) and path.read_bytes() == whole
    assert f"journal {path}: its last line was torn ({len(tail)} bytes" in caplog.text
    state.restore(now=100.0)
    assert state.journal.skipped == []
    expected = _summary(state)
    ready(state, "w3", now=100.5)
    assert split(state, "w3", tasks["w3"], now=100.5) == 22  # a line appended
    state.journal.close()

    again = _restored(tmp_path)
    assert again.journal.skipped == [] and again.journal.torn == 0
    (job,) = again.jobs.values()
    assert 22 in again.jobs[job.id].handout.passes[(0,)].handed["w3"]
    assert 22 not in again.jobs[job.id].handout.passes[(0,)].order
    assert _summary(again) != expected
    _each_split_once(again, tasks)
    again.journal.close()


def test_a_journal_whose_last_events_are_reversed_is_replayed_in_their_order(tmp_path, caplog):
    """The last 25 lines of a journal in reverse order: each line's sequence number puts
    them back in order, so the restored state is the one the journal recorded (the split
    handed, re-queued and handed again is not handed twice), and one warning counts them;
    the journal is rewritten in order."""
    tasks = _busy_journal(tmp_path)
    expected = _summary(_restored(tmp_path))
    path = tmp_path / "journal.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-25] + lines[-25:][::-1]))
    with caplog.at_level("WARNING", logger="zloader.broker"):
        state = _restored(tmp_path)
    assert state.journal.reordered == 24 and state.journal.skipped == []
    assert _summary(state) == expected
    assert "replayed 24 lines that were out of place" in caplog.text
    assert "skipped" not in caplog.text
    state.journal.close()
    again = _restored(tmp_path)
    assert again.journal.reordered == 0 and _summary(again) == expected
    _each_split_once(again, tasks)
    again.journal.close()


def test_out_of_range_splits_in_split_and_requeue_events_are_skipped(tmp_path, caplog):
    """A `split` and a `requeue` event naming split 10**12 of a 40-split pass (with valid
    sequence numbers and checksums: only their meaning is wrong), and a split event
    whose number was edited (its checksum no longer holds): each is skipped and counted
    by kind, never applied, and the pass still hands out each split once, then ends
    (applied, split 10**12 was held by a worker and the epoch stalled one split short)."""
    tasks = _busy_journal(tmp_path)
    expected = _summary(_restored(tmp_path))
    path = tmp_path / "journal.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    top = max(_numbers(lines))
    (job,) = {_body(line)["id"] for line in lines if _body(line)["e"] == "job"}
    edited = next(i for i, line in enumerate(lines) if b'"split":2,' in line)
    lines[edited] = lines[edited].replace(b'"split":2,', b'"split":1000000000000,')
    lines += [line_of({"e": "split", "job": job, "pass": [0], "split": 10**12,
                       "worker": "w3"}, top + 1),
              line_of({"e": "requeue", "job": job, "pass": [0], "split": 10**12,
                       "skip": {}}, top + 2)]
    path.write_bytes(b"".join(lines))
    with caplog.at_level("WARNING", logger="zloader.broker"):
        state = _restored(tmp_path)
    assert sorted(state.journal.skipped) == [edited + 1, len(lines) - 1, len(lines)]
    assert state.journal.skipped_kinds == {"a split out of its pass's range": 2,
                                           "a wrong checksum": 1}
    assert caplog.text.count("skipped 3 lines") == 1
    assert "a split out of its pass's range: 2, a wrong checksum: 1" in caplog.text
    summary = _summary(state)
    assert summary != expected  # the edited line's split 2 is lost: in order again
    (passed,) = summary["jobs"][job][2].values()
    assert 2 in passed[0] and all(2 not in held for held in passed[3].values())
    _each_split_once(state, tasks)
    state.journal.close()


def test_a_line_lost_from_the_middle_of_a_journal_is_counted_as_missing(tmp_path, caplog):
    """A line gone from the middle of a journal (a split handed out): the replay finds its
    number missing and says so in its warning; the split waits in its pass again (it is
    read again, not lost), and the journal is rewritten without the gap."""
    tasks = _busy_journal(tmp_path)
    path = tmp_path / "journal.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    gone = next(i for i, line in enumerate(lines) if b'"split":5,' in line)
    path.write_bytes(b"".join(lines[:gone] + lines[gone + 1:]))
    with caplog.at_level("WARNING", logger="zloader.broker"):
        state = _restored(tmp_path)
    assert state.journal.missing == 1 and state.journal.skipped == []
    assert "found 1 sequence numbers missing" in caplog.text
    (job,) = state.jobs.values()
    assert 5 in job.handout.passes[(0,)].order
    _each_split_once(state, tasks)
    state.journal.close()
    again = _restored(tmp_path)
    assert again.journal.missing == 0
    again.journal.close()


def test_lines_older_than_a_compacted_snapshot_are_skipped(tmp_path, caplog):
    """A compacted journal (its snapshot numbered after every line it replaced) followed
    by a stale tail, lines from before the compaction: each is skipped as older than the
    snapshot (applied, they handed out splits a second time), counted in one warning."""
    tasks = _busy_journal(tmp_path)
    path = tmp_path / "journal.jsonl"
    before = path.read_bytes().splitlines(keepends=True)
    state = _restored(tmp_path)
    state.journal.compact(state.snapshot())
    state.journal.close()
    expected = _summary(_restored(tmp_path))
    snapshot = path.read_bytes().splitlines(keepends=True)
    assert min(_numbers(snapshot)) > max(_numbers(before))
    stale = before[8:]  # splits handed, a worker gone, re-queues
    path.write_bytes(b"".join(snapshot + stale))
    with caplog.at_level("WARNING", logger="zloader.broker"):
        state = _restored(tmp_path)
    assert state.journal.skipped == list(range(len(snapshot) + 1, len(snapshot) + len(stale) + 1))
    assert state.journal.skipped_kinds == {"older than the snapshot it follows": len(stale)}
    assert f"older than the snapshot it follows: {len(stale)}" in caplog.text
    assert _summary(state) == expected
    _each_split_once(state, tasks)
    state.journal.close()


def test_events_that_do_not_fit_the_replayed_state_are_skipped_by_kind(tmp_path, caplog):
    """Events with valid sequence numbers and checksums that the broker could not have
    written at their place: a split handed a second time, re-queued without having been
    handed out or while it waits already, a pass done that never started, events of a job,
    worker or task that does not exist, a job created twice, a pass kept twice. Each is
    skipped, counted by kind in one warning, and the state is the journal's without them."""
    tasks = _busy_journal(tmp_path)
    expected = _summary(_restored(tmp_path))
    path = tmp_path / "journal.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    bodies = [_body(line) for line in lines]
    job = next(body for body in bodies if body["e"] == "job")
    some_pass = {"e": "pass", "job": job["id"], "pass": [0], "order": [39], "requeued": [],
                 "handed": {}, "read": {}, "skips": {}, "origins": []}
    forged = [
        ({"e": "split", "job": job["id"], "pass": [0], "split": 0, "worker": "w3"},
         "a split handed twice"),  # w1 holds it
        ({"e": "split", "job": job["id"], "pass": [0], "split": 1, "worker": "w3",
          "origin": [0, 1]}, "a split handed twice"),  # no such pass re-queued it
        ({"e": "requeue", "job": job["id"], "pass": [0], "split": 39, "skip": {}},
         "a split re-queued without having been handed out"),  # still in order
        ({"e": "requeue", "job": job["id"], "pass": [0], "split": 0, "skip": {}},
         "a split re-queued while a worker holds it"),  # w1, alive (not exactly once)
        ({"e": "requeue", "job": job["id"], "pass": [3], "split": 0, "skip": {}},
         "a re-queue in a pass not started"),
        ({"e": "done", "job": job["id"], "pass": [4], "worker": "w1"},
         "a pass done before it started"),
        ({"e": "done", "job": job["id"], "pass": [0], "worker": "w2"},
         "a pass done by a worker not there"),  # w2 is gone
        ({"e": "split", "job": job["id"], "pass": [0], "split": 39, "worker": "w2"},
         "a split for a worker without a task of its job"),
        ({"e": "task", "job": job["id"], "task": "t" * 16, "worker": "w9", "index": 5},
         "a task for a worker not there"),
        ({"e": "task", "job": job["id"], "task": tasks["w1"], "worker": "w3", "index": 5},
         "a task given twice"),
        ({"e": "left", "job": job["id"], "task": tasks["w1"], "worker": "w3"},
         "a worker leaving a task it did not have"),
        ({"e": "gone", "worker": "w2", "died": True}, "a worker gone that was not there"),
        ({"e": "epoch", "job": "0" * 16, "epoch": 3}, "an event of a job not there"),
        (job, "a job created twice"),
        (some_pass, "a pass kept twice"),  # pass [0] exists
    ]
    top = max(_numbers(lines))
    lines += [line_of(event, top + 1 + i) for i, (event, _) in enumerate(forged)]
    path.write_bytes(b"".join(lines))
    with caplog.at_level("WARNING", logger="zloader.broker"):
        state = _restored(tmp_path)
    first = len(lines) - len(forged) + 1
    assert state.journal.skipped == list(range(first, len(lines) + 1))
    kinds = collections.Counter(why for _, why in forged)
    assert state.journal.skipped_kinds == kinds
    assert caplog.text.count("skipped") == 1
    assert all(f"{kind}: {count}" in caplog.text for kind, count in kinds.items())
    assert _summary(state) == expected
    _each_split_once(state, tasks)
    state.journal.close()


def test_a_fence_done_after_a_compaction_is_replayed_without_a_skip(tmp_path):
    """An exactly-once job's worker dies; its fence waits for the consumer while the
    journal is compacted (the snapshot no longer holds the worker nor its split); then
    the fence is done: its `gone` and the split's re-queue follow the snapshot. A restart
    applies them (nothing skipped: the worker's absence and the split held by no one are
    what the fence left), and the split waits to be read again, once."""
    state = State(journal=Journal(tmp_path))
    ready(state, "w1")
    ready(state, "w2")
    tasks = tasks_by_worker(state.register(b"c1", record(Command.REGISTER, nested({
        "consumer": "c1", "fingerprint": "f" * 64, "job_name": None, "sharding": "dynamic",
        "deterministic": False, "num_workers": 0, "on_error": "raise", "host_id": "h/boot/ns",
        "pid": 1, "exactly_once": True,
        "source": {"num_splits": 4, "shuffle_splits": False, "seed": None}}), [b"p"]), 0.0))
    assert split(state, "w1", tasks["w1"]) == 0
    assert split(state, "w2", tasks["w2"]) == 1
    state.seen(b"w2", 9.0)
    state.seen(b"c1", 9.0)
    state.tick(10.0)  # w1 silent past its expiry: dropped, its split fenced
    (job,) = state.jobs.values()
    (fence,) = state.job_view(job).fences
    state.journal.compact(state.snapshot())
    state.delivered(b"c1", record(Command.DELIVERED, {
        "job": job.id, "fence": fence["id"], "splits": []}), 10.5)  # it holds none
    assert list(job.handout.passes[(0,)].requeued) == [0] and not job.fences
    lines = (tmp_path / "journal.jsonl").read_bytes().splitlines()
    assert [_body(line)["e"] for line in lines[-2:]] == ["gone", "requeue"]
    state.journal.close()

    again = _restored(tmp_path)
    assert again.journal.skipped == []
    handing = again.jobs[job.id].handout.passes[(0,)]
    assert list(handing.requeued) == [0] and handing.handed == {"w2": [1]}
    again.journal.close()


def _as_version_3(line: bytes) -> bytes:
    """A journal line as version 3 wrote it: a job's options without ``shards``."""
    body = _body(line)
    number = json.loads(line)["n"]
    if body["e"] == "journal":
        body["version"] = 3
    if body["e"] == "job":
        body["options"].pop("shards")
    return line_of(body, number)


def _restored_as_written_by(tmp_path: Any, older: Callable[[bytes], bytes]
                            ) -> tuple[State, Any, dict[str, str]]:
    """A busy journal rewritten line by line as ``older`` says an older zloader wrote it,
    then restored; with the summary the original restored to and the busy journal's
    tasks by worker."""
    tasks = _busy_journal(tmp_path)
    expected = _summary(_restored(tmp_path))
    path = tmp_path / "journal.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(older(line) for line in lines))
    return _restored(tmp_path), expected, tasks


def test_a_version_3_journal_is_restored_with_no_shards_and_rewritten(tmp_path):
    """A journal of version 3 (job options without ``shards``) is restored, its jobs
    with 0 shards (as they ran), and rewritten as the current version."""
    state, expected, _ = _restored_as_written_by(tmp_path, _as_version_3)
    assert state.journal.skipped == [] and _summary(state) == expected
    assert all(job.options.shards == 0 for job in state.jobs.values())
    state.journal.close()
    assert _body((tmp_path / "journal.jsonl").read_bytes().splitlines()[0]) == {
        "e": "journal", "version": VERSION}


def _as_version_2(line: bytes) -> bytes:
    """A version 3 journal line as version 2 wrote it: no sequence number, no checksum."""
    body = _body(line)
    if body["e"] == "journal":
        body["version"] = 2
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


def test_a_version_2_journal_is_restored_and_rewritten_as_the_current_version(tmp_path):
    """A journal a zloader of version 2 wrote (no sequence numbers or checksums) is
    restored, in file order, and rewritten as version 3 at once."""
    state, expected, tasks = _restored_as_written_by(tmp_path, _as_version_2)
    assert state.journal.skipped == [] and _summary(state) == expected
    state.journal.close()
    assert _body((tmp_path / "journal.jsonl").read_bytes().splitlines()[0]) == {
        "e": "journal", "version": VERSION}
    again = _restored(tmp_path)
    assert again.journal.version == VERSION and again.journal.skipped == []
    assert _summary(again) == expected
    _each_split_once(again, tasks)
    again.journal.close()


def test_a_version_2_journal_with_reversed_events_hands_no_split_out_twice(tmp_path):
    """Without sequence numbers (version 2) the order of reversed lines cannot be told,
    but each event is checked against the state before it: those that do not fit (a
    split handed twice, re-queued before its worker left, handed to a worker gone) are
    skipped and counted, and no split is held or waiting twice. (Some may be lost: the
    re-queues of a worker's splits that came before its leave.)"""
    _busy_journal(tmp_path)
    path = tmp_path / "journal.jsonl"
    lines = [_as_version_2(line) for line in path.read_bytes().splitlines(keepends=True)]
    path.write_bytes(b"".join(lines[:-25] + lines[-25:][::-1]))
    state = _restored(tmp_path)
    assert state.journal.skipped and sum(state.journal.skipped_kinds.values()) == len(
        state.journal.skipped)
    assert {"a split handed twice", "a split re-queued while a worker holds it"} \
        <= set(state.journal.skipped_kinds)
    (job,) = state.jobs.values()
    handing = job.handout.passes[(0,)]
    placed = collections.Counter([*handing.order, *handing.requeued, *(
        split for group in (handing.handed, handing.read) for splits in group.values()
        for split in splits)])
    assert max(placed.values()) == 1
    state.journal.close()


_TEAR = '''"""Test shim (tests/test_journal.py): while the file named by $ZLOADER_TEST_TEAR
exists, this broker writes half of its next journal line and then stops there, to be
killed mid-write."""
import os
import threading

_write = os.write


def _write_torn(fd, data):
    if len(data) > 1 and os.path.exists(os.environ["ZLOADER_TEST_TEAR"]):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.endswith("journal.jsonl"):
            _write(fd, data[:len(data) // 2])
            threading.Event().wait()  # until SIGKILL
    return _write(fd, data)


os.write = _write_torn
'''


def _start_broker_with(address: str, work_dir: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([os.path.join(BIN, "zloader-broker"), "--bind", address,
                             "--heartbeat", str(HEARTBEAT), "--work-dir", work_dir,
                             "--log-level", "warning"], env=env)


def _an_exact_epoch(address: str, seen: list[int], step) -> None:
    """Read an epoch of 1,600 slow elements from the broker at ``address`` into ``seen``
    while ``step`` runs (:func:`_read_while`): every element once, within a minute."""
    def slow(x):
        time.sleep(0.003)
        return x

    start = time.monotonic()
    with Loader(Pipeline.range(1600, split_size=20).map(slow), broker=address,
                timeout=30) as loader:
        _read_while(loader, seen, step)
    assert time.monotonic() - start < 60
    counts = collections.Counter(seen)
    assert sorted(counts) == list(range(1600)), counts.most_common(3)
    assert len(seen) == 1600, [x for x, n in counts.items() if n > 1]


def _read_while(loader, seen: list[int], step) -> None:
    """Read ``loader``'s epoch into ``seen`` while ``step`` (kills, restarts) runs on a
    thread of its own; its failure fails the test."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            step()
        except BaseException as exc:  # reported below
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        for x in loader:
            seen.append(x)
    finally:  # (a Loader that raised: no broker is started after the test stops them)
        thread.join(60)
    assert not thread.is_alive(), "the kills and restarts did not finish"
    assert not failed, failed


@pytest.mark.slow  # (two broker restarts: over 3 s)
def test_a_broker_killed_mid_write_then_again_resumes_the_epoch_exactly(tmp_path):
    """A broker SIGKILLed halfway through writing a journal line (a test shim makes the
    write stop there), restarted on its work dir, then SIGKILLed again and restarted:
    every element of the epoch once. (Before: the first restart appended its next line to
    the torn one, the second skipped the two as one corrupt line, and the split that line
    handed out was read twice.)"""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(_TEAR)
    flag = tmp_path / "tear"
    env = {**os.environ, "ZLOADER_TEST_TEAR": str(flag),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(shim),
                                                       os.environ.get("PYTHONPATH")]))}
    address = f"tcp://127.0.0.1:{free_port()}"
    work_dir = str(tmp_path / "broker")
    journal = tmp_path / "broker" / "journal.jsonl"
    brokers = [_start_broker_with(address, work_dir, env)]
    workers: list[subprocess.Popen] = []
    try:
        wait_for(lambda: status(address, 1.0) is not None, what="the broker")
        workers += [start_worker(address) for _ in range(2)]
        wait_for(lambda: len(status(address)["workers"]) == 2, what="the workers")
        seen: list[int] = []

        def tear_kill_restart() -> None:
            wait_for(lambda: len(seen) >= 300, 30, "progress")
            flag.touch()
            wait_for(lambda: not journal.read_bytes().endswith(b"\n"), 30,
                     "the broker to stop halfway through a journal line")
            brokers[-1].kill()
            brokers[-1].wait()
            flag.unlink()
            brokers.append(_start_broker_with(address, work_dir, env))
            wait_for(lambda: len(seen) >= 800, 30, "progress after the first restart")
            brokers[-1].kill()
            brokers[-1].wait()
            brokers.append(_start_broker_with(address, work_dir, env))

        _an_exact_epoch(address, seen, tear_kill_restart)
        log_text = (tmp_path / "broker" / "broker.log").read_text()
        assert log_text.count("its last line was torn") == 1
        assert "skipped" not in log_text
    finally:
        for process in [*workers, *brokers]:
            stop(process)


@pytest.mark.slow  # (two broker restarts: over 3 s)
def test_a_broker_restarted_on_a_tampered_journal_resumes_the_epoch_exactly(tmp_path):
    """A broker SIGKILLed mid-epoch; its journal compacted; the broker restarted, then
    SIGKILLed again. Its journal then tampered with: the last 25 lines reversed, a stale
    tail (lines from before the compaction) appended, and a `split` and a `requeue`
    event of split 10**12 (valid lines: only their meaning is wrong). The broker
    restarted on it replays the reversed lines in order and skips the others (one
    warning), and the Loader's epoch is exact: every element once, no stall (before: the
    reversed lines and the stale tail read splits twice, and split 10**12 left the epoch
    one split short until the Loader's timeout)."""
    address, work_dir, broker, workers = start_journaled(tmp_path, 2)
    journal = pathlib.Path(work_dir) / "journal.jsonl"
    brokers = [broker]
    seen: list[int] = []
    stale: list[bytes] = []

    def compact_tamper_restart() -> None:
        wait_for(lambda: len(seen) >= 300, 30, "progress")
        brokers[-1].kill()
        brokers[-1].wait()
        before = journal.read_bytes().splitlines(keepends=True)
        state = State(journal=Journal(work_dir))
        state.restore(now=time.monotonic())
        state.journal.compact(state.snapshot())
        state.journal.close()
        brokers.append(start_broker(address, work_dir))
        wait_for(lambda: len(seen) >= 800, 30, "progress after the first restart")
        brokers[-1].kill()
        brokers[-1].wait()
        lines = journal.read_bytes().splitlines(keepends=True)
        handed = _body(next(line for line in reversed(lines) if b'"e":"split"' in line))
        stale.extend(before[len(before) // 3:])
        journal.write_bytes(b"".join(lines[:-25] + lines[-25:][::-1] + stale))
        tampered = Journal(work_dir)
        for event in ({**handed, "split": 10**12},
                      {"e": "requeue", "job": handed["job"], "pass": handed["pass"],
                       "split": 10**12, "skip": {}}):
            event.pop("origin", None)
            assert tampered.record(event)
        tampered.close()
        brokers.append(_start_broker_with(address, work_dir, dict(os.environ)))

    try:
        _an_exact_epoch(address, seen, compact_tamper_restart)
        log_text = (pathlib.Path(work_dir) / "broker.log").read_text()
        assert log_text.count("skipped") == 1
        assert f"skipped {len(stale) + 2} lines" in log_text
        assert f"older than the snapshot it follows: {len(stale)}" in log_text
        assert "a split out of its pass's range: 2" in log_text
        assert "replayed 24 lines that were out of place" in log_text
    finally:
        for process in [*workers, *brokers]:
            stop(process)


def test_a_restored_job_waits_for_its_consumer_longer_than_an_expiry(tmp_path):
    """A restarted broker knows a job's consumers only once each registers again, which
    takes its socket's reconnect (ZeroMQ backs off up to 2 s) and a heartbeat or two:
    past one expiry on a loaded host. The job waits for them as for silent consumers
    (FENCE_GRACE expiries); collected sooner, the consumer's REGISTER made a new job
    that handed the whole epoch out again (every element twice,
    test_generated[broker-restart])."""
    state = State(journal=Journal(tmp_path))  # heartbeat 1 s: expiry 3 s, grace 30 s
    ready(state, "w1")
    tasks = {o.identity.decode(): o.body["task"] for o in register(state, "c1", splits=4)
             if o.command is Command.TASK}
    assert [split(state, "w1", tasks["w1"]) for _ in range(4)] == [0, 1, 2, 3]
    state.journal.close()

    again = State(journal=Journal(tmp_path))
    assert again.restore(now=100.0) == 1
    (job,) = again.jobs.values()
    ready(again, "w1", now=100.5)
    for now in (101.0, 102.0, 103.0, 104.0, 105.0, 106.0):
        again.seen(b"w1", now)
        again.tick(now)
    assert list(again.jobs) == [job.id]  # kept past one expiry
    view = _registered_again(again, job.id, 4, 106.5)
    assert view["job"] == job.id and list(again.jobs) == [job.id]
    # nothing handed out again: the splits were all read before the restart
    assert split(again, "w1", tasks["w1"], now=106.5) is None


def test_a_restored_job_nobody_comes_back_to_is_collected_after_the_grace(tmp_path):
    state = State(journal=Journal(tmp_path))
    ready(state, "w1")
    task_of(register(state, "c1"))
    state.journal.close()
    again = State(journal=Journal(tmp_path))
    assert again.restore(now=100.0) == 1
    again.tick(120.0)
    assert len(again.jobs) == 1
    again.tick(131.0)  # past FENCE_GRACE expiries
    assert not again.jobs
