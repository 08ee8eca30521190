"""The broker's state machine as plain calls: no sockets, no processes."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from zloader.broker.state import KILLS_TO_FAIL, State
from zloader.options import JobOptions
from zloader.transport import messages
from zloader.transport.protocol import Command, Message, ProtocolError


def record(command: Command, body: dict, payload: list | tuple = ()) -> messages.Record:
    """The record of a message, as the broker loop decodes it before calling a handler."""
    return messages.decode(Message(command, body, list(payload)))


def nested(body: dict) -> dict:
    """A REGISTER body written with the job's options beside the consumer's fields, as
    the wire has it: those options in one ``options`` object (the defaults of
    :class:`JobOptions` for any not given), ``coordinated`` as ``options.num_consumers``
    and the consumer's ``consumer_index``."""
    names = {f.name for f in dataclasses.fields(JobOptions)}
    options = {**JobOptions().to_body(), **{k: v for k, v in body.items() if k in names}}
    rest = {k: v for k, v in body.items() if k not in names and k != "coordinated"}
    if body.get("coordinated"):
        options["num_consumers"] = body["coordinated"]["size"]
        rest["consumer_index"] = body["coordinated"]["index"]
    return {**rest, "options": options}


def ready(state: State, name: str, now: float = 0.0, prefer: str | None = None):
    return state.worker_ready(name.encode(), record(Command.READY, {
        "worker": name, "host": "h", "host_id": "h/boot/ns", "pid": 100 + len(state.workers),
        "endpoint": f"ipc:///tmp/{name}", "prefer": prefer}), now)


def register(state: State, consumer: str, now: float = 0.0, job_name: str | None = None,
             fingerprint: str = "f" * 64, sharding: str = "dynamic", splits: int = 4,
             num_workers: int = 0):
    return state.register(consumer.encode(), record(Command.REGISTER, nested({
        "consumer": consumer, "fingerprint": fingerprint, "job_name": job_name,
        "sharding": sharding, "deterministic": False, "num_workers": num_workers,
        "on_error": "raise", "host_id": "h/boot/ns", "pid": 1,
        "source": {"num_splits": splits, "shuffle_splits": False, "seed": None}}),
        [b"pipeline"]), now)


def split(state: State, worker: str, task: str, key=(0,), now: float = 0.0):
    (out,) = state.split_request(worker.encode(), record(Command.SPLIT_REQ, {
        "task": task, "pass": list(key)}), now)
    assert out.command is Command.SPLIT
    return out.body["split"]


def task_of(out) -> str:
    return next(o.body["task"] for o in out if o.command is Command.TASK)


def tasks_by_worker(out) -> dict[str, str]:
    return {o.identity.decode(): o.body["task"] for o in out if o.command is Command.TASK}


def test_idle_worker_gets_a_task_when_a_consumer_registers():
    state = State()
    assert [o.command for o in ready(state, "w1")] == [Command.ACK]  # no job yet
    out = register(state, "c1")
    commands = [o.command for o in out]
    assert Command.TASK in commands and Command.JOB in commands
    job = next(o.body for o in out if o.command is Command.JOB and o.identity == b"c1")
    assert [w["worker"] for w in job["workers"]] == ["w1"]


def test_a_worker_back_on_a_new_connection_gets_its_task_again():
    """A worker stopped (SIGSTOP, a paused VM) before it read its TASK reconnects on
    waking, and the TASK left on the old connection is lost: the broker sends it again,
    on the new identity, with the same task, index and pipeline."""
    state = State()
    ready(state, "w1")
    first = next(o for o in register(state, "c1") if o.command is Command.TASK)
    out = state.worker_ready(b"w1-again", record(Command.READY, {
        "worker": "w1", "host": "h", "host_id": "h/boot/ns", "pid": 100,
        "endpoint": "ipc:///tmp/w1", "prefer": None}), 1.0)
    assert [o.command for o in out] == [Command.ACK, Command.TASK]
    assert out[0].body["task"] == first.body["task"]
    again = out[1]
    assert again.identity == b"w1-again" and again.body == first.body
    assert again.payload == first.payload


def test_a_forked_worker_gets_the_task_index_it_was_forked_for_when_free():
    """READY.slot: a worker forked for a Loader seeded itself as that index at its fork
    (Source.forked), so the broker gives it that index whatever order the workers come
    in; one whose index is taken gets the lowest free one."""
    state = State()
    for name, slot in (("w1", 1), ("w0", 0), ("w9", 0)):
        state.worker_ready(name.encode(), record(Command.READY, {
            "worker": name, "host": "h", "host_id": "h/boot/ns", "pid": 100,
            "endpoint": f"ipc:///tmp/{name}", "slot": slot}), 0.0)
    out = register(state, "c1", num_workers=3)
    (job,) = state.jobs.values()
    index = {state.workers[worker].id: job.indices[task] for task, worker in job.tasks.items()}
    assert index == {"w1": 1, "w0": 0, "w9": 2}, out
    with pytest.raises(ProtocolError, match="slot"):
        record(Command.READY, {"worker": "w", "host": "h", "host_id": "h/boot/ns",
                               "pid": 1, "endpoint": "ipc:///tmp/w", "slot": -1})


def test_splits_are_handed_out_once_in_order_then_none():
    state = State()
    ready(state, "w1")
    task = task_of(register(state, "c1", splits=3))
    assert [split(state, "w1", task) for _ in range(4)] == [0, 1, 2, None]


def test_dead_worker_splits_go_to_the_others_first():
    state = State(heartbeat=1.0)
    ready(state, "w1")
    ready(state, "w2")
    out = register(state, "c1", splits=6)
    tasks = tasks_by_worker(out)
    assert split(state, "w1", tasks["w1"]) == 0
    assert split(state, "w1", tasks["w1"]) == 1
    assert split(state, "w2", tasks["w2"]) == 2
    for now in (1.0, 2.0, 3.5):  # w2 and the consumer keep talking, w1 falls silent
        state.seen(b"w2", now)
        state.seen(b"c1", now)
        state.tick(now)
    assert "w1" not in state.workers
    got = [split(state, "w2", tasks["w2"], now=3.5) for _ in range(5)]
    assert got == [0, 1, 3, 4, 5]


def test_a_split_that_kills_its_worker_three_times_is_reported_not_rerun():
    state = State()
    register(state, "c1", splits=2)
    now = 0.0
    for attempt in range(KILLS_TO_FAIL):
        name = f"w{attempt}"
        task = task_of(ready(state, name, now))
        assert split(state, name, task, now=now) == 0
        now += 10.0  # the worker dies mid-split: it never says goodbye
        state.seen(b"c1", now)
        state.tick(now)
        assert name not in state.workers
    job = next(iter(state.jobs.values()))
    assert len(job.handout.failed) == 1 and job.handout.failed[0]["split"] == 0
    task = task_of(ready(state, "survivor", now))
    assert split(state, "survivor", task, now=now) == 1
    assert split(state, "survivor", task, now=now) is None


def test_a_death_counts_against_the_split_being_read_not_the_one_asked_for_ahead():
    """A worker asks for its next split while it reads the last one (have = splits
    received): dying then, it was reading that last one."""
    state = State()
    register(state, "c1", splits=4)
    task = task_of(ready(state, "w1"))

    def ask(have: int) -> int:
        (out,) = state.split_request(b"w1", record(Command.SPLIT_REQ, {
            "task": task, "pass": [0], "have": have}), 0.0)
        return out.body["split"]

    assert [ask(0), ask(1)] == [0, 1]  # split 1 asked for while split 0 is read
    state.seen(b"c1", 10.0)
    state.tick(10.0)  # w1 died silent
    job = next(iter(state.jobs.values()))
    assert job.handout.kills == {0: 1}
    assert sorted(job.handout.passes[(0,)].requeued) == [0, 1]  # both read again


def test_splits_asked_ahead_come_in_one_answer_and_again_at_places_already_handed():
    """SPLIT_REQ.ahead: the split at ``have`` and the ``ahead`` after it, in one SPLIT (the
    later ones in its ``then``, at the places after its ``have``), up to the first null,
    which comes in a SPLIT of its own; places already handed (answers lost) are answered
    with the same splits again; the death of the worker counts against the split it
    reads, not those it holds ahead, and every one is read again."""
    state = State()
    register(state, "c1", splits=6)
    task = task_of(ready(state, "w1"))
    messages: list[int] = []

    def ask(have: int, ahead: int) -> list[tuple[int | None, int]]:
        out = state.split_request(b"w1", record(Command.SPLIT_REQ, {
            "task": task, "pass": [0], "have": have, "ahead": ahead}), 0.0)
        assert all(o.command is Command.SPLIT for o in out)
        messages.append(len(out))
        return [pair for o in out for pair in [
            (o.body["split"], o.body["have"]),
            *((split, o.body["have"] + 1 + at) for at, split in enumerate(o.body.get("then", [])))]]

    assert ask(0, 0) == [(0, 0)]
    assert ask(1, 3) == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert ask(2, 1) == [(2, 2), (3, 3)]  # (answers lost: the same splits again)
    assert ask(5, 4) == [(5, 5), (None, 6)]  # the pass ends: one null, then nothing
    assert messages == [1, 1, 1, 2]
    state.seen(b"c1", 10.0)
    state.tick(10.0)  # w1 died silent, reading split 4 (have 5)
    job = next(iter(state.jobs.values()))
    assert job.handout.kills == {4: 1}
    assert sorted(job.handout.passes[(0,)].requeued) == [0, 1, 2, 3, 4, 5]


def test_same_job_name_with_another_fingerprint_is_refused_naming_both():
    state = State()
    register(state, "c1", job_name="run", fingerprint="a" * 64)
    (out,) = [o for o in register(state, "c2", job_name="run", fingerprint="b" * 64)
              if o.command is Command.ERROR]
    assert "job_name 'run'" in out.body["message"] and "aaaa" in out.body["message"]
    assert len(state.jobs) == 1


def test_consumers_with_one_job_name_share_one_job():
    state = State()
    register(state, "c1", job_name="run")
    register(state, "c2", job_name="run")
    assert len(state.jobs) == 1 and len(next(iter(state.jobs.values())).consumers) == 2


def test_abandoned_job_is_collected_and_its_workers_released():
    state = State(heartbeat=1.0)
    ready(state, "w1")
    register(state, "c1")
    out = state.bye(b"c1", 1.0)  # its last consumer left: released at once
    assert [o.command for o in out] == [Command.CONSUMER_GONE, Command.RELEASE]
    assert not state.jobs and state.workers["w1"].task is None


def test_static_jobs_take_at_most_their_width():
    state = State()
    for name in ("w1", "w2", "w3"):
        ready(state, name)
    register(state, "c1", sharding="static", num_workers=2)
    assert sum(1 for w in state.workers.values() if w.task) == 2


def test_malformed_bodies_raise_protocol_error():
    state = State()
    with pytest.raises(ProtocolError, match="worker"):
        state.worker_ready(b"x", record(Command.READY, {"worker": 3}), 0.0)
    with pytest.raises(ProtocolError, match="sharding"):
        register(state, "c1", sharding="sideways")


def test_status_lists_workers_and_jobs():
    state = State()
    ready(state, "w1")
    register(state, "c1")
    status = state.status(0.0)
    assert len(status["workers"]) == 1 and status["workers"][0]["tasks"] == 1
    assert status["jobs"][0]["consumers"] == 1 and status["jobs"][0]["workers"] == 1


def test_requeued_splits_of_a_pass_others_left_behind_are_served_in_later_passes():
    state = State(heartbeat=1.0)
    ready(state, "w1")
    ready(state, "w2")
    out = register(state, "c1", splits=3)
    tasks = tasks_by_worker(out)
    assert split(state, "w1", tasks["w1"], key=(0, 0)) == 0
    assert split(state, "w2", tasks["w2"], key=(0, 0)) == 1
    assert split(state, "w2", tasks["w2"], key=(0, 0)) == 2
    assert split(state, "w2", tasks["w2"], key=(0, 0)) is None  # w2 moves on to pass (0, 1)
    for now in (1.0, 2.0, 3.5):  # w1 dies holding split 0 of pass (0, 0)
        state.seen(b"w2", now)
        state.seen(b"c1", now)
        state.tick(now)
    assert split(state, "w2", tasks["w2"], key=(0, 1), now=3.5) == 0  # re-read, not lost
    assert split(state, "w2", tasks["w2"], key=(0, 1), now=3.5) == 0  # then pass (0, 1)'s own


@pytest.mark.parametrize("restart", [False, True])
def test_a_pass_that_reads_another_pass_s_requeued_split_then_its_own_tags_each_right(
        tmp_path, restart):
    """Pass (0, 1) reads pass (0, 0)'s re-queued split 0 (with (0, 0)'s skip) and then its
    own split 0: the second is (0, 1)'s, skipping nothing. Both are remembered as read,
    each for its own pass (the broker kept one origin per split and pass: the second
    went out as (0, 0)'s, its first element skipped, a worker's death lost it), also
    after a broker restart from a compacted journal."""
    from zloader.broker.journal import Journal
    from zloader.broker.splits import holds, read_splits
    from zloader.lineage import pack

    state = State(heartbeat=1.0, journal=Journal(tmp_path))
    ready(state, "w1")
    ready(state, "w2")
    out = state.register(b"c1", record(Command.REGISTER, nested({
        "consumer": "c1", "fingerprint": "f" * 64, "job_name": None, "sharding": "dynamic",
        "deterministic": False, "num_workers": 0, "on_error": "raise",
        "host_id": "h/boot/ns", "pid": 1, "exactly_once": True,
        "source": {"num_splits": 3, "shuffle_splits": False, "seed": None}}), [b"p"]), 0.0)
    tasks = tasks_by_worker(out)

    def answer(key, now):
        (o,) = state.split_request(b"w2", record(Command.SPLIT_REQ, {
            "task": tasks["w2"], "pass": list(key)}), now)
        return o.body["split"], tuple(o.body.get("origin") or key), o.body.get("skip", "")

    assert split(state, "w1", tasks["w1"], key=(0, 0)) == 0
    assert [answer((0, 0), 0.0)[0] for _ in range(3)] == [1, 2, None]
    for now in (1.0, 2.0, 3.5):  # w1 dies holding split 0 of pass (0, 0)
        state.seen(b"w2", now)
        state.seen(b"c1", now)
        state.tick(now)
    (job,) = state.jobs.values()
    (fence,) = state.job_view(job).fences
    state.delivered(b"c1", record(Command.DELIVERED, {  # c1 holds its element 0
        "job": job.id, "fence": fence["id"], "splits": [[[0, 0], 0, {"have": pack([0])}]]}),
        3.6)
    assert answer((0, 1), 3.7) == (0, (0, 0), pack([0]))
    if restart:
        state.journal.compact(state.snapshot())
        state.journal.close()
        state = State(heartbeat=1.0, journal=Journal(tmp_path))
        state.restore(4.0)
        assert state.journal.skipped == []
        (job,) = state.jobs.values()
        ready(state, "w2", now=4.0)  # back, with its task
    assert answer((0, 1), 4.0) == (0, (0, 1), "")
    assert read_splits(job, 0) == {(0, 0): {0, 1, 2}, (0, 1): {0}}
    assert holds(job, (0, 0), 0) and holds(job, (0, 1), 0) and not holds(job, (0, 1), 1)
    state.journal.close()


def coordinated(state: State, consumer: str, index: int, size: int = 2, now: float = 0.0):
    return state.register(consumer.encode(), record(Command.REGISTER, nested({
        "consumer": consumer, "fingerprint": "f" * 64, "job_name": "sync",
        "sharding": "dynamic", "deterministic": False, "num_workers": 0,
        "on_error": "raise", "host_id": "h/boot/ns", "pid": 7,
        "coordinated": {"size": size, "index": index},
        "source": {"num_splits": 4, "shuffle_splits": False, "seed": None}}),
        [b"pipeline"]), now)


def ask_round(state: State, worker: str, task: str, members: list[str], epoch: int = 0):
    (out,) = state.round_request(worker.encode(), record(Command.ROUND_REQ, {
        "task": task, "epoch": epoch, "members": members}), 0.0)
    assert out.command is Command.ROUND
    return out.body["round"]


def received(state: State, consumer: str, rounds: list[int], epoch: int = 0):
    return state.rounds_received(consumer.encode(), record(Command.RECEIVED, {
        "epoch": epoch, "rounds": rounds}), 0.0)


def announced(out) -> dict[bytes, tuple[list[int], list[int]]]:
    """Rounds committed and lost, by consumer, over every COMMIT in ``out``."""
    seen: dict[bytes, tuple[list[int], list[int]]] = {}
    for o in out:
        if o.command is Command.COMMIT:
            rounds, lost = seen.setdefault(o.identity, ([], []))
            rounds += o.body["rounds"]
            lost += o.body["lost"]
    return seen


def test_a_round_commits_once_every_consumer_has_received_it():
    state = State()
    ready(state, "w1")
    task = task_of(coordinated(state, "c0", 0))
    coordinated(state, "c1", 1)
    assert ask_round(state, "w1", task, ["c0", "c1"]) == 0
    assert ask_round(state, "w1", task, ["c0", "c1"]) == 1
    assert announced(received(state, "c0", [0, 1])) == {}
    assert announced(received(state, "c1", [1])) == {b"c0": ([1], []), b"c1": ([1], [])}
    assert announced(received(state, "c1", [0])) == {b"c0": ([0], []), b"c1": ([0], [])}


def test_a_silent_workers_open_rounds_are_lost_for_every_consumer_alike():
    state = State()
    ready(state, "w1")
    ready(state, "w2")
    out = coordinated(state, "c0", 0)
    out += coordinated(state, "c1", 1)
    tasks = tasks_by_worker(out)
    assert ask_round(state, "w1", tasks["w1"], ["c0", "c1"]) == 0
    assert ask_round(state, "w2", tasks["w2"], ["c0", "c1"]) == 1
    received(state, "c0", [0, 1])  # c1 has neither yet
    for peer in (b"w2", b"c0", b"c1"):
        state.seen(peer, 9.0)
    out = state.tick(10.0)  # w1 has been silent for three heartbeats: dead
    assert announced(out) == {b"c0": ([], [0]), b"c1": ([], [0])}
    # c1 names round 0 too (it missed the news, say): it is told again, alone.
    assert announced(received(state, "c1", [0, 1])) == {b"c0": ([1], []), b"c1": ([1], [0])}


def test_dead_worker_loses_only_its_own_rounds():
    state = State()
    ready(state, "w1")
    ready(state, "w2")
    out = coordinated(state, "c0", 0) + coordinated(state, "c1", 1)
    tasks = tasks_by_worker(out)
    ask_round(state, "w1", tasks["w1"], ["c0", "c1"])  # round 0
    ask_round(state, "w2", tasks["w2"], ["c0", "c1"])  # round 1
    out = state.bye(b"w1", 0.0)
    assert announced(out) == {b"c0": ([], [0]), b"c1": ([], [0])}
    assert announced(received(state, "c0", [1]) + received(state, "c1", [1])) == {
        b"c0": ([1], []), b"c1": ([1], [])}
    view = next(o.body for o in state.consumer_heartbeat(b"c0", 0.0))
    assert view["rounds"]["lost"] == 1 and view["rounds"]["issued"] == {"0": 2}


def test_a_restarted_consumer_takes_over_its_index_and_the_old_one_is_refused():
    state = State()
    ready(state, "w1")
    task = task_of(coordinated(state, "c0", 0))
    coordinated(state, "c1", 1)
    for _ in range(3):
        number = ask_round(state, "w1", task, ["c0", "c1"])
        received(state, "c0", [number])
        received(state, "c1", [number])
    ask_round(state, "w1", task, ["c0", "c1"])  # round 3: c1 dies before receiving it
    out = coordinated(state, "c1-new", 1)
    view = next(o.body for o in out if o.command is Command.JOB and o.identity == b"c1-new")
    assert view["joined"] == {"epoch": 0, "round": 4, "missed": 3}
    assert announced(out)[b"c0"] == ([], [3])  # round 3 can no longer commit
    gone = [o for o in out if o.command is Command.CONSUMER_GONE]
    assert [o.body["consumer"] for o in gone] == ["c1"]
    # A group addressed to the old membership gets no number.
    assert ask_round(state, "w1", task, ["c0", "c1"]) is None
    assert ask_round(state, "w1", task, ["c0", "c1-new"]) == 4
    (refused,) = coordinated(state, "c1", 1)
    assert refused.command is Command.ERROR and "taken over" in refused.body["message"]


def test_status_shows_a_coordinated_jobs_rounds_and_vacancies():
    state = State()
    ready(state, "w1")
    task = task_of(coordinated(state, "c0", 0, size=3))
    coordinated(state, "c1", 1, size=3)
    (job,) = state.status(0.0)["jobs"]
    assert job["rounds"] == {"num_consumers": 3, "epoch": 0, "rounds": 0, "lost": 0,
                             "vacant": [2]}
    assert ask_round(state, "w1", task, ["c0", "c1", None]) is None  # not all there
    assert state.status(0.0)["jobs"][0]["rounds"]["lost"] == 1


def test_coordinated_registrations_are_checked():
    state = State()
    coordinated(state, "c0", 0, size=2)
    (out,) = coordinated(state, "c1", 1, size=3)
    assert out.command is Command.ERROR and "num_consumers" in out.body["message"]
    with pytest.raises(ProtocolError):
        coordinated(state, "c2", 2, size=2)


def test_a_job_whose_consumers_went_silent_lingers_and_one_they_left_does_not():
    from zloader.broker.state import FENCE_GRACE

    state = State(heartbeat=1.0)  # expiry 3 s
    ready(state, "w1")
    register(state, "c1", job_name="left")
    state.bye(b"c1", 0.0)
    state.seen(b"w1", 4.0)
    state.tick(4.0)
    assert not state.jobs  # left with BYE: collected after one expiry
    register(state, "c2", now=10.0, job_name="silent")
    (job,) = state.jobs.values()
    state.seen(b"w1", 14.0)
    state.tick(14.0)  # c2 silent for more than 3 s: dropped, but its job is kept
    assert "c2" not in state.consumers and job.id in state.jobs and job.tasks
    (refused,) = [o for o in register(state, "c3", now=15.0, job_name="silent",
                                      fingerprint="e" * 64) if o.command is Command.ERROR]
    assert "kept for them 29 s more" in refused.body["message"]  # the wait, said
    register(state, "c2", now=20.0, job_name="silent")  # it comes back to the same job
    assert list(state.jobs) == [job.id]
    state.tick(24.0)
    for now in (24.0 + 3 * FENCE_GRACE - 1, 24.0 + 3 * FENCE_GRACE + 1):
        state.seen(b"w1", now)
        state.tick(now)
    assert not state.jobs  # silent for longer than the grace: collected


def test_a_broker_stall_expires_nobody_and_a_fence_asks_live_consumers_again():
    """The broker's own clock jumps over a stall (SIGSTOP, a long GC): nobody it could not
    hear meanwhile is expired for it. A fence whose answer was lost keeps asking a consumer
    that is alive, past its deadline, instead of re-queueing what that consumer holds."""
    from zloader.broker.state import FENCE_GRACE

    state = State(heartbeat=1.0)  # expiry 3 s
    ready(state, "w1")
    ready(state, "w2")
    out = state.register(b"c1", record(Command.REGISTER, nested({
        "consumer": "c1", "fingerprint": "f" * 64, "job_name": None, "sharding": "dynamic",
        "deterministic": False, "num_workers": 0, "on_error": "raise", "host_id": "h/boot/ns",
        "pid": 1, "exactly_once": True,
        "source": {"num_splits": 4, "shuffle_splits": False, "seed": None}}), [b"p"]), 0.0)
    tasks = tasks_by_worker(out)
    assert split(state, "w1", tasks["w1"]) == 0
    state.stalled(5.0, 5.5)  # the broker was stopped from 0.5 s to 5.5 s
    state.tick(5.5)
    assert {"w1", "w2"} <= set(state.workers) and "c1" in state.consumers
    now = 5.5
    while "w1" in state.workers:  # now w1 really dies; w2 and c1 go on
        now += 1.0
        state.seen(b"w2", now)
        state.seen(b"c1", now)
        state.tick(now)
    (job,) = state.jobs.values()
    assert len(job.fences) == 1  # c1's answer is lost on its way
    for _ in range(3 * FENCE_GRACE + 5):  # past the fence's deadline
        now += 1.0
        state.seen(b"w2", now)
        state.seen(b"c1", now)
        state.tick(now)
    assert job.fences, "a live consumer's answer was not waited for"
    (listed,) = state.job_view(job).fences
    assert listed["waiting"] == ["c1"]  # asked again in every view
    state.delivered(b"c1", record(Command.DELIVERED, {
        "job": job.id, "fence": listed["id"], "splits": [[[0], 0, {"all": True}]]}), now)
    assert not job.fences and not job.handout.passes[(0,)].requeued  # it held split 0 whole


def test_exactly_once_is_one_rule_for_dynamic_jobs_without_share_order_or_rounds():
    """A job runs exactly-once when its Loader asks and it is dynamic, not shared,
    balanced, coordinated or deterministic: one named function (what REGISTER applies)."""
    from zloader.lineage import exactly_once

    plain = {"requested": True, "sharding": "dynamic", "shared": False,
             "deterministic": False, "coordinated": False, "balanced": 0}
    assert exactly_once(**plain)
    for change in ({"requested": False}, {"sharding": "static"}, {"sharding": "off"},
                   {"shared": True}, {"deterministic": True}, {"coordinated": True},
                   {"balanced": 2}):
        assert not exactly_once(**{**plain, **change}), change
    state = State()
    ready(state, "w1")
    out = state.register(b"c1", record(Command.REGISTER, nested({
        "consumer": "c1", "fingerprint": "f" * 64, "job_name": None, "sharding": "dynamic",
        "deterministic": False, "num_workers": 0, "on_error": "raise", "host_id": "h/boot/ns",
        "pid": 1, "exactly_once": True, "balanced": 2,
        "source": {"num_splits": 4, "shuffle_splits": False, "seed": None}}), [b"p"]), 0.0)
    assert next(o.body["options"]["exactly_once"] for o in out
                if o.command is Command.TASK) is False


def test_a_mix_s_requeued_split_is_served_only_to_a_pass_of_its_own_input():
    """A dead worker's split of mix input a is read again in input a's passes only: input
    b's passes run b's stages, and would read a's elements as b's (a lost, b repeated)."""
    from zloader.mixing import MIX_KEY

    state = State(heartbeat=1.0)
    ready(state, "w1")
    ready(state, "w2")
    out = state.register(b"c1", record(Command.REGISTER, nested({
        "consumer": "c1", "fingerprint": "f" * 64, "job_name": None, "sharding": "dynamic",
        "deterministic": False, "num_workers": 0, "on_error": "raise",
        "host_id": "h/boot/ns", "pid": 1,
        "source": {"num_splits": 4, "shuffle_splits": False, "seed": None,
                   "inputs": [[2, False, None], [2, False, None]]}}), [b"pipeline"]), 0.0)
    tasks = tasks_by_worker(out)
    a, b = (0, MIX_KEY), (0, MIX_KEY + 1)
    assert split(state, "w1", tasks["w1"], key=a) == 0
    assert split(state, "w2", tasks["w2"], key=a) == 1
    assert split(state, "w2", tasks["w2"], key=a) is None  # w2's input a is over
    assert split(state, "w2", tasks["w2"], key=b) == 2
    for now in (1.0, 2.0, 3.5):  # w1 dies holding split 0 of input a
        state.seen(b"w2", now)
        state.seen(b"c1", now)
        state.tick(now)
    assert 0 in state.jobs[state.consumers["c1"].job].handout.passes[a].requeued
    assert split(state, "w2", tasks["w2"], key=b, now=3.5) == 3  # b's own, not a's split 0
    assert split(state, "w2", tasks["w2"], key=b, now=3.5) is None
    assert split(state, "w2", tasks["w2"], key=a, now=3.5) == 0  # a's pass reads it again


@pytest.mark.parametrize("options,job_name,words", [
    ({"share": {"window_bytes": 1 << 20, "lag": "block", "block_seconds": 1.0}}, "j",
     "share=True and job_name do not mix"),
    ({"share": {"window_bytes": 1 << 20, "lag": "block", "block_seconds": 1.0},
      "balanced": 2}, None, "share=True and balanced do not mix"),
    ({"num_consumers": 2, "balanced": 2}, "j", "balanced and num_consumers do not mix"),
    ({"num_consumers": 2, "deterministic": True}, "j",
     "deterministic=True and num_consumers do not mix"),
    ({"num_consumers": 2}, None, "coordinated reads .* need a job_name"),
])
def test_a_hand_made_register_breaking_a_rule_between_options_gets_the_loader_s_words(
        options, job_name, words):
    """JobOptions.check is the one home of the rules between options: the broker refuses
    a REGISTER that breaks one with the words a Loader raises them in."""
    state = State()
    body = nested({"consumer": "c1", "fingerprint": "f" * 64, "job_name": job_name,
                   "host_id": "h/boot/ns", "pid": 1,
                   "source": {"num_splits": 4, "shuffle_splits": False, "seed": None}})
    body["options"].update(options)
    if "num_consumers" in options:
        body["consumer_index"] = 0
    with pytest.raises(ProtocolError, match=f"REGISTER: {words}"):
        state.register(b"c1", record(Command.REGISTER, body, [b"pipeline"]), 0.0)
    assert not state.jobs


@pytest.mark.parametrize("sharding, runs", [("dynamic", "static"), ("static", "static"),
                                            ("off", "off")])
def test_a_deterministic_job_runs_dynamic_sharding_as_static_whoever_registers_it(
        sharding, runs):
    """JobOptions.applied is the one place a deterministic job's dynamic sharding becomes
    static: a hand-made REGISTER gets the job a Loader's would, without exactly-once."""
    state = State()
    body = nested({"consumer": "c1", "fingerprint": "f" * 64, "job_name": "j",
                   "host_id": "h/boot/ns", "pid": 1,
                   "source": {"num_splits": 4, "shuffle_splits": False, "seed": None}})
    body["options"].update(deterministic=True, sharding=sharding, exactly_once=True)
    state.register(b"c1", record(Command.REGISTER, body, [b"pipeline"]), 0.0)
    (job,) = state.jobs.values()
    assert (job.options.sharding, job.options.exactly_once) == (runs, False)
    loader_options = JobOptions(sharding=sharding, deterministic=True).applied()
    assert loader_options.sharding == runs


def _shared_register(state: State, consumer: str, now: float = 0.0,
                     host: str = "h/boot/ns", pid: int = 1, splits: int = 6,
                     inputs: list | None = None):
    source = {"num_splits": splits, "shuffle_splits": False, "seed": None}
    if inputs is not None:  # (a mix: its inputs' splits)
        source["inputs"] = inputs
    return state.register(consumer.encode(), record(Command.REGISTER, nested({
        "consumer": consumer, "fingerprint": "f" * 64, "sharding": "dynamic",
        "job_name": None, "deterministic": False, "num_workers": 0,
        "share": {"window_bytes": 1 << 20, "lag": "block", "block_seconds": 1.0},
        "on_error": "raise", "host_id": host, "pid": pid, "source": source}),
        [b"pipeline"]), now)


@pytest.mark.parametrize("restart", [False, True])
def test_a_shared_job_s_last_worker_dead_is_made_again_by_the_next_one(tmp_path, restart):
    """A shared job's only worker dies: its splits are not re-queued (its trainers had
    elements of them); once each trainer said what it had, the fence waits, holding the
    epoch, for the job's next worker, which gets them to make again, with the trainers'
    places, right after its TASK. With ``restart``, the broker restarts on its journal
    before that worker comes: what waits for it is kept there."""
    from zloader.broker.journal import Journal
    from zloader.mixing import MIX_KEY

    state = State(journal=Journal(tmp_path))
    ready(state, "w1")
    mix = [[3, False, None], [3, False, None]]  # (a mix of two inputs of 3 splits)

    def register(consumer: str, now: float = 0.0):
        return _shared_register(state, consumer, now, inputs=mix)

    task = task_of(register("c1") + register("c2"))
    handed = [split(state, "w1", task, key=(0, MIX_KEY)) for _ in range(2)]
    # Its mix took new weights twice (the first sent again after a reconnect): the broker
    # echoes each WEIGHED and notes it once, for the segment. (Weights of another length
    # than the mix's inputs are echoed, not noted.)
    switches = [[[0], 0, [0.25, 0.75]], [[0], 40, [0.5, 0.5]], [[0], 0, [0.25, 0.75]],
                [[0], 50, [0.2, 0.3, 0.5]]]
    for key, at, weights in switches:
        weighed = record(Command.WEIGHED, {"task": task, "pass": key, "at": at,
                                           "weights": weights})
        (echo,) = state.weighed(b"w1", weighed, 1.0)
        assert echo.identity == b"w1" and echo.command is Command.WEIGHED
        assert echo.body == weighed.to_body()
    if restart:  # (the notes, journaled, survive a restart before the death too)
        state.journal.close()
        state = State(journal=Journal(tmp_path))
        state.restore(now=1.5)
        state.worker_ready(b"w1", record(Command.READY, {
            "worker": "w1", "host": "h", "host_id": "h/boot/ns", "pid": 100,
            "endpoint": "ipc:///tmp/w1", "prefer": None}), 1.6)
        for consumer in ("c1", "c2"):
            register(consumer, 1.7)
    state.seen(b"c1", 10.0)
    state.seen(b"c2", 10.0)
    state.tick(10.0)  # (w1 is silent: dead)
    assert "w1" not in state.workers
    (job,) = state.jobs.values()
    (token,) = job.fences
    for consumer, answer in (("c1", {"epoch": 0, "done": False, "count": 30,
                                     "ranges": [[0, 30]]}),
                             ("c2", {"epoch": 0, "done": False, "count": 12})):
        state.delivered(consumer.encode(), record(Command.DELIVERED, {
            "job": job.id, "fence": token, "splits": [], "shared": answer}), 10.0)
    assert not job.fences and [t for t, _ in job.orphans] == [token]
    assert not job.handout.passes[(0, MIX_KEY)].requeued  # not read again
    if restart:
        state.journal.close()
        state = State(journal=Journal(tmp_path))
        state.restore(now=10.5)
        (job,) = state.jobs.values()
        assert [t for t, _ in job.orphans] == [token]
        for consumer in ("c1", "c2"):  # (its trainers register again)
            register(consumer, 10.6)
    out = ready(state, "w2", 11.0)
    commands = [o.command for o in out if o.identity == b"w2"]
    assert commands.index(Command.TASK) < commands.index(Command.HANDOVER)
    (handover,) = [o.body for o in out if o.command is Command.HANDOVER
                   and o.body["segments"]]
    (segment,) = handover["segments"]
    assert handover["fence"] == token and segment["splits"] == handed
    assert segment["had"] == {"c1": [[0, 30]], "c2": 12} and segment["last"]
    assert segment["switches"] == switches[:2]
    assert not job.orphans
    state.journal.close()
    again = State(journal=Journal(tmp_path))
    again.restore(now=12.0)
    assert not next(iter(again.jobs.values())).orphans  # (adopted: forgotten)
    again.journal.close()


def test_a_shared_jobs_silent_trainer_keeps_its_cursors_for_the_grace_unless_it_exited():
    """A trainer of a shared job that goes silent may only be stopped: its workers are told
    to drop its cursors when the grace ends (one that comes back goes on where it was),
    at once when its process on this host has exited."""
    from zloader._host import host_id
    from zloader.broker.state import FENCE_GRACE

    def shared(consumer: str, now: float, host: str, pid: int):
        return _shared_register(state, consumer, now, host, pid, splits=4)

    def told_gone(out) -> list[str]:
        return [o.body["consumer"] for o in out if o.command is Command.CONSUMER_GONE]

    state = State(heartbeat=1.0)  # expiry 3 s, grace 30 s
    state.worker_ready(b"w1", record(Command.READY, {
        "worker": "w1", "host": "h", "host_id": "h/boot/ns", "pid": 100,
        "endpoint": "tcp://10.0.0.1:5555", "prefer": None}), 0.0)
    shared("remote", 0.0, "elsewhere/boot/ns", 1)
    exited = subprocess.Popen(["true"])
    exited.wait()
    shared("local", 0.0, host_id(), exited.pid)
    (job,) = state.jobs.values()
    assert job.tasks  # (a job that reads has its worker)
    state.seen(b"w1", 4.0)
    assert told_gone(state.tick(4.0)) == ["local"]  # both silent: the exited one at once
    state.seen(b"w1", 20.0)
    assert told_gone(state.tick(20.0)) == []
    grace_end = 4.0 + 3 * FENCE_GRACE + 1
    state.seen(b"w1", grace_end)
    assert told_gone(state.tick(grace_end)) == ["remote"]
    shared("back", grace_end, "elsewhere/boot/ns", 2)
    state.seen(b"w1", grace_end + 4)
    state.tick(grace_end + 4)
    shared("back", grace_end + 5, "elsewhere/boot/ns", 2)  # back within the grace
    for now in (grace_end + 20, grace_end + 40):
        state.seen(b"w1", now)
        state.seen(b"back", now)
        assert told_gone(state.tick(now)) == []  # never told gone: it came back


@pytest.mark.parametrize("restart", [False, True])
def test_a_dead_worker_s_split_is_read_again_less_what_a_consumer_that_left_had_yielded(
        tmp_path, restart):
    """Two consumers of a job_name; one leaves with BYE mid-epoch saying it yielded
    elements 0 and 1 of split 0 (``left``), and the other holds element 2. The worker that
    read split 0 dies: the split is read again skipping all three (before, the leaver's
    two came again to the other), also after a broker restart between the BYE and the
    death (the journal's ``bye`` event)."""
    from zloader.broker.journal import Journal
    from zloader.lineage import pack

    state = State(heartbeat=1.0, journal=Journal(tmp_path))
    ready(state, "w1")
    ready(state, "w2")

    def join(consumer: str) -> dict[str, str]:
        return tasks_by_worker(state.register(consumer.encode(), record(
            Command.REGISTER, nested({
                "consumer": consumer, "fingerprint": "f" * 64, "job_name": "j",
                "sharding": "dynamic", "deterministic": False, "num_workers": 0,
                "on_error": "raise", "host_id": "h/boot/ns", "pid": 1, "exactly_once": True,
                "source": {"num_splits": 3, "shuffle_splits": False, "seed": None}}),
            [b"p"]), 0.0))

    tasks = join("c1")
    join("c2")
    assert split(state, "w1", tasks["w1"]) == 0
    state.bye(b"c2", 0.5, {"epoch": 0, "delivered": [[[0], pack(()),
                                                       [[0, pack([0, 1]), -1, -1]]]]})
    if restart:
        state.journal.close()
        state = State(heartbeat=1.0, journal=Journal(tmp_path))
        state.restore(0.6)
        assert state.journal.skipped == []
        ready(state, "w1", now=0.6)
        ready(state, "w2", now=0.6)
        join("c1")  # (back, registering again)
    for now in (1.0, 2.0, 3.0, 4.0, 5.0):  # w1 dies holding split 0
        state.seen(b"w2", now)
        state.seen(b"c1", now)
        state.tick(now)
    (job,) = state.jobs.values()
    (fence,) = state.job_view(job).fences
    state.delivered(b"c1", record(Command.DELIVERED, {  # c1 holds element 2
        "job": job.id, "fence": fence["id"], "splits": [[[0], 0, {"have": pack([2])}]]}),
        5.1)
    (out,) = state.split_request(b"w2", record(Command.SPLIT_REQ, {
        "task": tasks["w2"], "pass": [0]}), 5.2)
    assert out.body["split"] == 0 and out.body["skip"] == pack([0, 1, 2])
    state.journal.close()


def test_a_shared_job_s_worker_that_leaves_cleanly_hands_its_splits_on_under_its_task_s_id():
    """A shared job's worker stopped with SIGTERM drains, hands its splits on and says
    BYE: the taker's HANDOVER names the leaving task (``HANDOVER.fence``), so the END of
    each trainer it makes them again for names it, which a trainer whose OPEN crossed the
    handover waits for (``END.handed``); and the trainers' view lists the task as drained
    (``JOB.drained``: they read it until its END), with the taker and the epochs handed
    on (a trainer that never opened one of them there waits for the taker's END naming
    the task, tests/test_receive.py). (Before, the HANDOVER named nothing,
    and a trainer the taker had ended before the handover came lost the splits.)"""
    state = State()
    for name in ("w1", "w2"):
        ready(state, name)
    tasks = tasks_by_worker(_shared_register(state, "c1"))
    assert set(tasks) == {"w1", "w2"}
    state.epoch_started(b"c1", record(Command.EPOCH, {"epoch": 0}), 0.1)
    read = split(state, "w2", tasks["w2"])
    state.worker_heartbeat(b"w2", record(Command.HEARTBEAT, {"leaving": True}), 0.2)
    entry = {"n": 0, "epoch": 0, "index": 1, "pass": [0], "splits": [read], "served": [],
             "had": {}, "last": False, "switches": []}
    state.worker_heartbeat(b"w2", record(Command.HEARTBEAT, {"handover": [entry]}), 0.3)
    out = state.bye(b"w2", 0.4)
    (handover,) = [o for o in out if o.command is Command.HANDOVER and o.body["segments"]]
    assert handover.identity == b"w1" and handover.body["fence"] == tasks["w2"]
    views = [o.body for o in out if o.command is Command.JOB and o.identity == b"c1"]
    # (a trainer that never opened epoch 0 on w2's task waits for w1's END naming it)
    assert views and views[-1]["drained"] == [{"task": tasks["w2"], "taker": "w1",
                                               "epochs": [0]}]
