"""The worker pool's policy (zloader/broker/pool.py) and the broker state that applies it, as plain
calls: which job each worker serves when several jobs share one pool (docs/pool.md)."""

from __future__ import annotations

import pytest

from tests.test_state import nested, ready, record, split
from zloader._defaults import MOVE_DRAIN_SECONDS, SLICE_SECONDS
from zloader.broker import placement, pool
from zloader.broker.journal import Journal
from zloader.broker.state import State
from zloader.transport.protocol import Command, ProtocolError


def claim(job: str, held: int, weight: float = 1.0, wants: int = pool.UNBOUNDED,
          hungry: bool = True, movable: bool = True, exact: bool = True) -> pool.Claim:
    return pool.Claim(job, weight, held, wants, hungry, movable, exact)


def settle(claims: dict[str, pool.Claim], holdings: list[pool.Holding], now: float = 100.0,
           eligible=lambda worker, job: True) -> dict[str, int]:
    """Apply moves until none is left; returns workers per job."""
    for _ in range(100):
        move = pool.next_move(claims.values(), holdings, eligible, now)
        if move is None:
            break
        worker, taker = move
        holding = next(h for h in holdings if h.worker == worker)
        holdings[holdings.index(holding)] = pool.Holding(worker, taker, now)
        for job in (holding.job, taker):
            held = sum(1 for h in holdings if h.job == job)
            claims[job] = pool.Claim(job, claims[job].weight, held, claims[job].wants,
                                     claims[job].hungry, claims[job].movable,
                                     claims[job].exact)
    else:
        raise AssertionError("the moves did not settle")
    return {job: sum(1 for h in holdings if h.job == job) for job in claims}


def held_by(job: str, workers: int, start: int = 0, since: float = 0.0) -> list[pool.Holding]:
    return [pool.Holding(f"w{start + i}", job, since) for i in range(workers)]


# --- the policy, alone ---------------------------------------------------------------------

def test_shares_are_weighted_and_capped_by_what_a_job_can_use():
    assert pool.shares([claim("a", 0), claim("b", 0)], 8) == {"a": 4.0, "b": 4.0}
    assert pool.shares([claim("a", 0, weight=3), claim("b", 0)], 8) == {"a": 6.0, "b": 2.0}
    # b can use 1 (its autoscaler's desired count): a gets the rest
    assert pool.shares([claim("a", 0), claim("b", 0, wants=1)], 8) == {"a": 7.0, "b": 1.0}
    # between epochs a job is entitled to nothing
    assert pool.shares([claim("a", 0), claim("b", 0, wants=0)], 8) == {"a": 8.0, "b": 0.0}
    assert pool.shares([claim("a", 0), claim("b", 0), claim("c", 0)], 2)["c"] == \
        pytest.approx(2 / 3)


def test_jobs_arriving_one_by_one_end_with_equal_shares():
    claims = {"a": claim("a", 8)}
    holdings = held_by("a", 8)
    for job in ("b", "c", "d"):
        claims[job] = claim(job, 0)
        counts = settle(claims, holdings)
    assert counts == {"a": 2, "b": 2, "c": 2, "d": 2}


def test_weights_skew_the_split():
    claims = {"a": claim("a", 8, weight=3), "b": claim("b", 0)}
    assert settle(claims, held_by("a", 8)) == {"a": 6, "b": 2}


def test_a_job_between_epochs_gives_its_workers_to_a_hungry_one():
    claims = {"a": claim("a", 4, wants=0, hungry=False), "b": claim("b", 0)}
    assert settle(claims, held_by("a", 4)) == {"a": 0, "b": 4}


def test_a_job_above_what_its_autoscaler_wants_gives_the_excess():
    claims = {"a": claim("a", 4, wants=1), "b": claim("b", 0, weight=0.01)}
    assert settle(claims, held_by("a", 4)) == {"a": 1, "b": 3}


def test_a_job_that_is_not_waiting_takes_nothing():
    claims = {"a": claim("a", 2), "b": claim("b", 0, hungry=False)}
    assert pool.next_move(claims.values(), held_by("a", 2), lambda w, j: True, 100.0) is None


def test_more_jobs_than_workers_time_slice():
    claims = {"a": claim("a", 1), "b": claim("b", 0)}
    fresh = [pool.Holding("w0", "a", since=100.0)]
    assert pool.next_move(claims.values(), fresh, lambda w, j: True, 100.0) is None
    later = 100.0 + SLICE_SECONDS
    assert pool.next_move(claims.values(), fresh, lambda w, j: True, later) == ("w0", "b")


def test_static_jobs_and_workers_that_cannot_run_a_job_do_not_move():
    claims = {"a": claim("a", 4, movable=False), "b": claim("b", 0)}
    assert pool.next_move(claims.values(), held_by("a", 4), lambda w, j: True, 100.0) is None
    claims = {"a": claim("a", 4), "b": claim("b", 0)}
    only_w3 = settle(claims, held_by("a", 4), eligible=lambda w, j: w == "w3" or j == "a")
    assert only_w3 == {"a": 3, "b": 1}


# --- the broker state, as plain calls --------------------------------------------------------

def register(state: State, consumer: str, now: float = 0.0, weight: float = 1.0,
             exactly_once: bool = True, fingerprint: str | None = None, splits: int = 8,
             sharding: str = "dynamic"):
    return state.register(consumer.encode(), record(Command.REGISTER, nested({
        "consumer": consumer, "fingerprint": fingerprint or consumer * 64,
        "job_name": None, "sharding": sharding, "deterministic": False, "num_workers": 0,
        "on_error": "raise", "host_id": "h/boot/ns", "pid": 1, "weight": weight,
        "exactly_once": exactly_once,
        "source": {"num_splits": splits, "shuffle_splits": False, "seed": None}}),
        [b"pipeline"]), now)


def epoch(state: State, consumer: str, now: float, number: int = 0):
    return state.epoch_started(consumer.encode(), record(Command.EPOCH, {"epoch": number}),
                               now)


def beat(state: State, consumer: str, now: float, active: int = 1, wait: float = 0.0):
    return state.consumer_heartbeat(consumer.encode(), now, record(Command.HEARTBEAT, {
        "stats": {"elements": 0, "wait_seconds": wait, "active": active}}))


def workers_of(state: State) -> dict[str, int]:
    counts = {c.job: 0 for c in state.consumers.values()}
    names = {c.job: c.id for c in state.consumers.values()}
    for worker in state.workers.values():
        job = next((j for j in state.jobs.values() if worker.task in j.tasks), None)
        if job is not None:
            counts[job.id] += 1
    return {names[job]: n for job, n in counts.items()}


def pool_of(size: int) -> State:
    state = State(heartbeat=1.0)
    for i in range(size):
        ready(state, f"w{i}")
    return state


def test_a_job_that_starts_reading_takes_workers_from_one_that_holds_all():
    state = pool_of(4)
    register(state, "a")
    epoch(state, "a", 0.1)
    assert workers_of(state) == {"a": 4}
    register(state, "b", now=0.2)
    assert workers_of(state) == {"a": 4, "b": 0}  # b has not asked for data yet
    out = epoch(state, "b", 0.3)
    assert workers_of(state) == {"a": 2, "b": 2}
    released = {o.identity for o in out if o.command is Command.RELEASE}
    started = {o.identity for o in out if o.command is Command.TASK}
    assert len(released) == 2 and released == started  # the same two workers move
    assert state.status(0.3)["jobs"][1]["share"] == 2.0


def test_a_non_exactly_once_jobs_worker_drains_then_moves_and_repeats_no_split():
    """A job without a fence (shared, balanced, coordinated, exactly_once=False) would
    repeat a split moved mid-read: its worker finishes the splits it took (RELEASE.drain)
    and moves once it says it is done (HEARTBEAT.drained)."""
    state = pool_of(2)
    out = register(state, "a", splits=4, exactly_once=False)  # (b holds none: it moves)
    epoch(state, "a", 0.1)
    tasks = {o.identity.decode(): o.body["task"] for o in out if o.command is Command.TASK}
    for name, task in tasks.items():
        split(state, name, task)
    register(state, "b", now=0.2)
    out = epoch(state, "b", 0.3)
    (drain,) = [o for o in out if o.command is Command.RELEASE]
    assert drain.body == {"task": tasks[drain.identity.decode()], "drain": True}
    assert not [o for o in out if o.command is Command.TASK]
    state.tick(0.4 + SLICE_SECONDS)  # it counts as b's already: nothing else moves
    assert workers_of(state) == {"a": 2, "b": 0}
    moving = drain.identity.decode()
    stayed = next(name for name in tasks if name != moving)
    assert [split(state, stayed, tasks[stayed]) for _ in range(3)] == [2, 3, None]
    state.pass_done(moving.encode(), record(Command.PASS_DONE, {
        "task": tasks[moving], "pass": [0]}), 1.0)
    out = state.worker_heartbeat(moving.encode(), record(Command.HEARTBEAT, {
        "drained": tasks[moving]}), 1.1)
    assert [o.identity.decode() for o in out if o.command is Command.TASK] == [moving]
    assert workers_of(state) == {"a": 1, "b": 1}
    # a's view drops the moved worker and says it left cleanly: a reads it until its END
    (view,) = [o.body for o in out if o.command is Command.JOB and o.identity == b"a"]
    assert view["drained"] == [{"task": tasks[moving]}]  # (no handover: not shared)
    assert moving not in [w["worker"] for w in view["workers"]]
    assert not state.jobs[state.consumers["a"].job].handout.passes[(0,)].requeued


def test_a_worker_that_does_not_drain_in_time_moves_anyway():
    state = pool_of(2)
    out = register(state, "a", splits=4, exactly_once=False)
    epoch(state, "a", 0.1)
    tasks = {o.identity.decode(): o.body["task"] for o in out if o.command is Command.TASK}
    taken = {name: split(state, name, task) for name, task in tasks.items()}
    register(state, "b", now=0.2)
    moving = next(o.identity.decode() for o in epoch(state, "b", 0.3)
                  if o.command is Command.RELEASE)
    state.workers[moving].moving_since -= MOVE_DRAIN_SECONDS  # its user code is stuck
    out = state.tick(0.4)
    assert {(o.identity.decode(), o.command) for o in out
            if o.command in (Command.RELEASE, Command.TASK)} == {
        (moving, Command.RELEASE), (moving, Command.TASK)}
    assert workers_of(state) == {"a": 1, "b": 1}
    stayed = next(name for name in tasks if name != moving)
    assert split(state, stayed, tasks[stayed]) == taken[moving]  # read again: repeats


def test_an_exactly_once_jobs_moved_worker_is_fenced_until_its_consumers_answer():
    state = pool_of(2)
    out = register(state, "a", exactly_once=True)
    epoch(state, "a", 0.1)
    for o in out:
        if o.command is Command.TASK:
            split(state, o.identity.decode(), o.body["task"])
    a_job = state.consumers["a"].job
    register(state, "b", now=0.2)
    epoch(state, "b", 0.3)
    (fence,) = state.jobs[a_job].fences.values()
    assert fence.waiting == {"a"} and fence.event is not None and fence.event.KIND == "left"
    assert workers_of(state) == {"a": 1, "b": 1}  # the worker moved at once


def test_a_job_between_epochs_gives_its_workers_back_and_takes_them_again():
    state = pool_of(2)
    register(state, "train")
    epoch(state, "train", 0.1)
    register(state, "val", now=0.2)
    beat(state, "train", 0.5, active=0)  # its epoch ended; validation starts
    epoch(state, "val", 0.6)
    assert workers_of(state) == {"train": 0, "val": 2}
    beat(state, "val", 1.5, active=0)  # validation over
    epoch(state, "train", 2.0, number=1)
    assert workers_of(state) == {"train": 2, "val": 0}


def test_a_static_job_gives_its_workers_up_only_between_epochs():
    state = pool_of(2)
    register(state, "static", sharding="static")
    epoch(state, "static", 0.1)
    register(state, "b", now=0.2)
    epoch(state, "b", 0.3)
    state.tick(0.3 + 2 * SLICE_SECONDS)
    assert workers_of(state) == {"static": 2, "b": 0}  # mid-epoch: its indices are fixed
    beat(state, "static", 3.0, active=0)
    beat(state, "b", 3.0, wait=2.5)  # b waits for data all along
    state.tick(3.0)
    assert workers_of(state) == {"static": 0, "b": 2}


def test_when_a_job_leaves_the_others_take_its_workers():
    state = pool_of(4)
    register(state, "a")
    epoch(state, "a", 0.1)
    register(state, "b", now=0.2)
    epoch(state, "b", 0.3)
    assert workers_of(state) == {"a": 2, "b": 2}
    state.bye(b"b", 0.4)
    assert workers_of(state) == {"a": 4}


def test_a_job_that_does_not_wait_gives_what_its_autoscaler_does_not_want():
    state = pool_of(4)
    register(state, "a")
    epoch(state, "a", 0.1)
    register(state, "b", now=0.2)
    epoch(state, "b", 0.3)
    a, b = (state.jobs[state.consumers[c].job] for c in ("a", "b"))
    # a's consumers do not wait and its autoscaler wants one worker; b's wait all along
    a.metrics.hungry_until, a.metrics.starvation = 0.0, 0.0
    a.metrics.desired, a.metrics.sampled = 1, True
    b.metrics.hungry_until, b.metrics.starvation = 0.0, 1.0
    placement.assign(state, 5.0)
    assert workers_of(state) == {"a": 1, "b": 3}


def test_a_fleet_that_joins_is_spread_over_jobs_whose_hunger_is_not_known_yet():
    """Workers that join while one job has started an epoch and another's consumers have
    not reported yet: the other is not held to the one worker its autoscaler set when it
    had none (nobody knows yet whether its consumers wait), so the fleet is spread evenly
    rather than given to the first job and moved back worker by worker. Once its reports
    say it does not wait, it gives what its autoscaler does not want."""
    from zloader.broker import status

    state = State(heartbeat=1.0)
    register(state, "a")
    register(state, "b", now=0.1)
    status.sample(state, 1.0)  # no worker yet: the autoscalers start at one
    epoch(state, "a", 1.1)  # a reads: hungry for two heartbeats
    for i in range(8):
        ready(state, f"w{i}", now=1.2)
    assert workers_of(state) == {"a": 4, "b": 4}
    beat(state, "b", 1.5)  # b's consumer does not wait
    state.tick(2.0)
    assert workers_of(state) == {"a": 7, "b": 1}


def test_a_hungry_job_with_no_worker_gets_one_after_a_time_slice():
    state = pool_of(1)
    register(state, "a")
    epoch(state, "a", 0.0)
    register(state, "b", now=0.1)
    epoch(state, "b", 0.2)
    assert workers_of(state) == {"a": 1, "b": 0}  # a's worker just started
    state.tick(0.2 + SLICE_SECONDS)
    assert workers_of(state) == {"a": 0, "b": 1}


def test_weights_from_register_skew_the_pool_and_are_checked():
    state = pool_of(4)
    register(state, "a", weight=3.0)
    epoch(state, "a", 0.1)
    register(state, "b", now=0.2)
    epoch(state, "b", 0.3)
    assert workers_of(state) == {"a": 3, "b": 1}
    shares = {j["weight"]: j["share"] for j in state.status(0.3)["jobs"]}
    assert shares == {3.0: 3.0, 1.0: 1.0}
    for bad in (0, -1, "2", True, 10**6):
        with pytest.raises(ProtocolError, match="weight"):
            register(state, "c", weight=bad)  # type: ignore[arg-type]


def test_a_job_sampled_hungry_stays_hungry_for_a_few_beats():
    """One low sample of a job's starvation (a busy broker reads its consumers' heartbeats
    late) must not make the pool take its workers and give them back a second later."""
    from zloader._defaults import HUNGRY_HOLD_BEATS
    from zloader.broker import status

    state = pool_of(2)
    register(state, "a")
    epoch(state, "a", 0.0)
    job = state.consumers["a"].job
    status.sample(state, 5.0)
    beat(state, "a", 5.5, wait=0.5)  # waited half of the next interval
    status.sample(state, 6.0)
    beat(state, "a", 6.5, wait=0.5)  # no waiting in this one
    status.sample(state, 7.0)
    assert state.jobs[job].metrics.starvation == 0.0
    assert placement.claims(state, 7.0)[job].hungry
    assert not placement.claims(state, 6.0 + HUNGRY_HOLD_BEATS + 0.1)[job].hungry


def test_a_job_whose_reports_come_late_keeps_its_hunger():
    """A broker that reads its messages late (a fleet's worth of them queued) may sample
    a job before its consumers' next reports: no report is no news, not "they did not
    wait". The job keeps its starvation (so it keeps its workers), and the next sample
    spans the intervals it missed."""
    from zloader._defaults import HUNGRY_HOLD_BEATS
    from zloader.broker import status

    state = pool_of(2)
    register(state, "a")
    epoch(state, "a", 0.0)
    job = state.jobs[state.consumers["a"].job]
    status.sample(state, 5.0)
    beat(state, "a", 5.5, wait=0.5)
    status.sample(state, 6.0)
    for now in range(7, 12):  # five ticks and no report read
        status.sample(state, float(now))
    assert job.metrics.starvation == 0.5
    assert placement.claims(state, 11.0 + HUNGRY_HOLD_BEATS)[job.id].hungry
    beat(state, "a", 11.5, wait=1.5)  # it waited one more second in the six since 6.0
    status.sample(state, 12.0)
    assert job.metrics.starvation == pytest.approx(1 / 6)


def test_the_pool_moves_at_most_its_rate_of_workers_a_second():
    """A job that wants fewer workers than it holds gives them to a hungry one at
    ``MOVES_PER_SECOND``, not all at once: one decision (or a late broker's misreading)
    never moves a fleet in one tick."""
    from zloader._defaults import MOVES_PER_SECOND

    rate = int(MOVES_PER_SECOND)
    state = pool_of(3 * rate)
    register(state, "train")
    epoch(state, "train", 0.1)
    register(state, "val", now=0.2)
    assert workers_of(state) == {"train": 3 * rate, "val": 0}
    beat(state, "train", 0.5, active=0)  # its epoch ended; validation starts
    out = epoch(state, "val", 0.6)
    assert workers_of(state) == {"train": 2 * rate, "val": rate}
    # each consumer gets its job's last view only, however many workers moved
    views = [o.identity for o in out if o.command is Command.JOB]
    assert sorted(views) == [b"train", b"val"]
    state.tick(0.6 + 0.5)  # half a second later: half the rate more
    assert workers_of(state) == {"train": 3 * rate // 2, "val": 3 * rate // 2}
    state.tick(0.6 + 1.5)
    assert workers_of(state) == {"train": rate // 2, "val": 5 * rate // 2}
    beat(state, "val", 2.8, wait=1.0)  # it waits for data: still hungry
    state.tick(2.9)
    assert workers_of(state) == {"train": 0, "val": 3 * rate}


def test_each_jobs_view_says_how_many_workers_run_other_jobs():
    """``busy_elsewhere`` (what a consumer that no worker serves says when it times out),
    counted once per heartbeat for all the views."""
    from zloader.broker import status

    state = pool_of(5)
    register(state, "a")
    epoch(state, "a", 0.1)
    register(state, "b", now=0.2)
    epoch(state, "b", 0.3)
    counts = workers_of(state)
    views = {o.identity.decode(): o.body for o in status.heartbeats(state)
             if o.command is Command.JOB}
    assert views["a"]["busy_elsewhere"] == counts["b"] and counts["b"] > 0
    assert views["b"]["busy_elsewhere"] == counts["a"] and counts["a"] > 0
    job = state.jobs[state.consumers["a"].job]
    assert state.job_view(job).to_body() == views["a"]


def test_a_restarted_broker_replays_moves(tmp_path):
    state = State(heartbeat=1.0, journal=Journal(str(tmp_path)))
    for name in ("w0", "w1"):
        ready(state, name)
    register(state, "a", splits=4)
    epoch(state, "a", 0.1)
    register(state, "b", now=0.2)
    epoch(state, "b", 0.3)
    before = {w.id: w.task for w in state.workers.values()}
    state.journal.close()
    restored = State(heartbeat=1.0, journal=Journal(str(tmp_path)))
    assert restored.restore(1.0) == 2
    assert {w.id: w.task for w in restored.workers.values()} == before
    for job in restored.jobs.values():
        assert sorted(job.tasks.values()) == sorted(state.jobs[job.id].tasks.values())
    restored.journal.close()


def test_a_job_that_would_repeat_a_moved_split_gives_only_to_a_job_holding_none():
    """Shared, balanced, coordinated or exactly_once=False: a move mid-epoch would repeat
    the split under way, so it does not even out shares; it still gives a starving job
    its first worker (rule 3's turn)."""
    claims = {"a": claim("a", 3, exact=False), "b": claim("b", 1)}
    assert settle(claims, held_by("a", 3) + held_by("b", 1, start=3)) == {"a": 3, "b": 1}
    claims = {"a": claim("a", 4, exact=False), "b": claim("b", 0)}
    assert settle(claims, held_by("a", 4)) == {"a": 3, "b": 1}
    claims = {"a": claim("a", 3), "b": claim("b", 1)}  # exactly-once: evened out
    assert settle(claims, held_by("a", 3) + held_by("b", 1, start=3)) == {"a": 2, "b": 2}
