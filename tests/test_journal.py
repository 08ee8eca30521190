"""A broker with a work dir journals its state and resumes every job after a SIGKILL:
workers and Loaders reconnect by themselves and carry on where they were."""

from __future__ import annotations

import collections
import json
import os
import signal
import stat
import subprocess
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.service import BIN, HEARTBEAT, free_port, start_worker, status, stop, wait_for
from tests.test_state import nested, ready, record, register, split, task_of
from zloader import Loader, Pipeline, ZloaderError
from zloader.broker.state import State
from zloader.journal import Journal
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
    passed = job.dispatch.passes[(0,)]
    assert passed.handed == {"w2": [2]} and list(passed.order) == [3, 4, 5]
    # The workers come back under new connections and keep their tasks: the same TASK
    # again (a worker that runs it already ignores it), no new one.
    for name in ("w1", "w2"):
        out = ready(again, name, now=100.5)
        assert [o.command for o in out] == [Command.ACK, Command.TASK]
        assert out[0].body["task"] == out[1].body["task"] == tasks[name]
    # The consumer comes back too, naming its job: it gets that job, not a new one.
    (view,) = [o.body for o in again.register(b"c1", record(Command.REGISTER, nested({
        "consumer": "c1", "fingerprint": "f" * 64, "job_name": None, "job": job.id,
        "sharding": "dynamic", "deterministic": False, "num_workers": 0,
        "on_error": "raise", "host_id": "h/boot/ns", "pid": 1,
        "source": {"num_splits": 6, "shuffle_splits": False, "seed": None}}),
        [b"pipeline"]), 100.5) if o.command is Command.JOB]
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
    assert list(again.jobs[job.id].dispatch.passes[(0,)].requeued) == [2]


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
    before = list(job.dispatch.passes[(0,)].requeued)
    assert sorted(before) == [0, 1]
    state.journal.close()

    again = State(journal=Journal(tmp_path))
    assert again.restore(now=100.0) == 1 and again.journal.skipped == []
    assert list(again.jobs[job.id].dispatch.passes[(0,)].requeued) == before
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
                          pipeline={"inherited": True}, inputs=[[2, False, None], [2, True, 1]]),
        events.RoundsSet(job="j", size=2),
        events.TaskGiven(job="j", task="t", worker="w1", index=1),
        events.SplitHanded(job="j", pass_=key, split=3, worker="w1", origin=origin),
        events.SplitRequeued(job="j", pass_=key, split=3, skip={"skip": "", "expect": [1, 2]}),
        events.JobResumed(job="j", epoch=1, delivered={"done": []}),
        events.PassRead(job="j", pass_=key, worker="w1"),
        events.EpochStarted(job="j", epoch=2),
        events.PassKept(job="j", pass_=key, order=[0, 1], requeued=[3], handed={"w1": [2]},
                        read={"w2": [4]}, skips={"3": {"skip": ""}}, origins=[[3, [1, 2]]]),
        events.JobFailed(job="j", error={"message": "boom"}),
        events.JobEnded(job="j"),
        events.WorkerGone(worker="w1", died=True, fenced=True, clean=False),
        events.WorkerLeft(job="j", task="t", worker="w1", clean=True),
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
        body = json.loads(line)
        if body["e"] != "journal":
            assert events.parse(body).to_body() == body


def test_the_events_shapes_are_pinned_to_the_journal_version():
    """zloader.journal.VERSION names the events' shapes: a field added to, dropped from or
    renamed in an event (or in JobOptions, which the job event holds whole) changes what
    a journal written before it holds, and a restarted broker would skip those lines. So
    such a change comes with a new VERSION, and with this list."""
    import dataclasses

    from zloader.broker import events
    from zloader.journal import VERSION
    from zloader.options import JobOptions

    shapes = {kind: [wire for _, wire, *_ in cls.spec()] for kind, cls in events.KINDS.items()}
    shapes["job.options"] = [field.name for field in dataclasses.fields(JobOptions)]
    assert VERSION == 2 and shapes == {
        "worker": ["id", "host", "host_id", "pid", "endpoint", "prefer", "plain_data"],
        "job": ["id", "fingerprint", "name", "options", "num_splits", "shuffle_splits",
                "seed", "width", "source_data", "entropy", "pipeline", "inputs"],
        "job.options": ["sharding", "deterministic", "on_error", "num_workers", "balanced",
                        "num_consumers", "share", "exactly_once", "weight", "objects"],
        "rounds": ["job", "size"], "task": ["job", "task", "worker", "index"],
        "split": ["job", "pass", "split", "worker", "origin"],
        "requeue": ["job", "pass", "split", "skip"], "resume": ["job", "epoch", "delivered"],
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
def corrupt_line(draw, events: list[dict]) -> bytes:
    """A line that is not what the broker writes: bytes that are not UTF-8, or one of its
    events with a field of another type (or missing, or an extra one)."""
    if draw(st.booleans()):
        text = draw(st.binary(min_size=1, max_size=40))
        return text.replace(b"\n", b"") + b"\xff\xfe\n"
    event = dict(draw(st.sampled_from(events)))
    name = draw(st.sampled_from(sorted(event)))
    value = draw(json_values)
    if draw(st.booleans()):
        del event[name]
    else:
        event[name] = value
    return json.dumps(event).encode() + b"\n"


@given(st.data())
@settings(max_examples=150, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_corrupt_journal_lines_are_skipped_and_counted_never_fatal(tmp_path_factory, data):
    """Lines with invalid UTF-8, or events whose fields have the wrong type, among a real
    journal's: a broker restoring it skips them (counted, with their line numbers) and its
    state then works (ticks, status, metrics, a worker's return, a compaction)."""
    root = tmp_path_factory.mktemp("journal")
    lines = _journal_lines(root)
    events = [json.loads(line) for line in lines]
    bad = data.draw(st.lists(corrupt_line(events), min_size=1, max_size=6))
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
    """Invalid UTF-8, a job whose options are a number, a pass whose `handed` is a list:
    the restarted zloader-broker skips those three lines, says so once in its log (the
    count and the line numbers), and serves the job the other lines describe."""
    lines = _journal_lines(tmp_path)
    job = next(json.loads(line) for line in lines if b'"e":"job"' in line)
    compacted = next(json.loads(line) for line in lines if b'"e":"pass"' in line)
    lines.insert(1, b'{"e":"epoch","job":"\xff\xfe"}\n')
    lines.insert(3, json.dumps({**job, "id": "other", "options": 5}).encode() + b"\n")
    lines.append(json.dumps({**compacted, "handed": ["w1"]}).encode() + b"\n")
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
    this zloader (version 2: a job's whole JobOptions) refuses, naming both."""
    from zloader.journal import VERSION

    state = State(journal=Journal(tmp_path))
    ready(state, "w1")
    task_of(register(state, "c1"))

    def first_line() -> dict:
        return json.loads((tmp_path / "journal.jsonl").read_bytes().splitlines()[0])

    assert first_line() == {"e": "journal", "version": VERSION} and VERSION == 2
    state.journal.compact(state.snapshot())
    assert first_line() == {"e": "journal", "version": VERSION}
    state.journal.close()
    lines = (tmp_path / "journal.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "journal.jsonl").write_bytes(b"".join(lines[1:]))
    with pytest.raises(ZloaderError, match=f"{tmp_path}.*version 1.*version 2"):
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
    with pytest.raises(ZloaderError, match=f"{tmp_path}.*version 99.*version 2"):
        Journal(tmp_path)
    done = subprocess.run([os.path.join(BIN, "zloader-broker"), "--bind",
                           f"tcp://127.0.0.1:{free_port()}", "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert str(tmp_path) in done.stderr and "version 99" in done.stderr
    assert journal.read_bytes() == before
