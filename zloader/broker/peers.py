"""Peers: workers that register (READY), report (HEARTBEAT) and forward their user code's
output (LOG), and consumers' heartbeats (their stats, and the stuck workers and short
epochs they report).
"""

from __future__ import annotations

from typing import Any

from zloader._defaults import MAX_HANDOVER_ENTRIES, STAGES, WARM_PIPELINES
from zloader.broker import coordinated, failures, placement, views
from zloader.broker.events import WorkerReady
from zloader.broker.records import Consumer, Job, Out, Tables, Worker
from zloader.transport.messages import Ack, Heartbeat, Log, Ready
from zloader.transport.protocol import Command

__all__ = ["consumer_heartbeat", "seen", "worker_heartbeat", "worker_log", "worker_ready"]


def seen(state: Tables, identity: bytes, now: float) -> bool:
    """Note traffic from a peer; False when the peer is not registered."""
    kind, pid = state.peers.get(identity, ("", ""))
    record: Worker | Consumer | None = (state.workers.get(pid) if kind == "worker"
                                        else state.consumers.get(pid))
    if record is None:
        return False
    record.last_seen = now
    return True


def worker_ready(state: Tables, identity: bytes, msg: Ready, now: float) -> list[Out]:
    """READY: a worker registers, or comes back on a new connection (it keeps its task)."""
    worker_id = msg.worker
    old = state.workers.get(worker_id)
    if old is not None:  # a reconnect: keep its task, take the new identity
        state.peers.pop(old.identity, None)
        old.identity, old.last_seen = identity, now
        state.peers[identity] = ("worker", worker_id)
        out = [Out(identity, Ack(heartbeat=state.heartbeat, task=old.task))]
        job = state.job_of(old.task)
        if job is not None:
            # Its TASK may have been lost with the old connection (a worker stopped
            # before it read it reconnects on waking): send it again; a worker that runs
            # the task already ignores it.
            out += placement.task_message(old, job)
        if job is not None and job.rounds is not None:
            # Round numbers sent to its old connection may be lost: it asks again.
            out += coordinated.announce(state, job, {}, job.rounds.lose_worker(worker_id))
        return out
    worker = Worker(worker_id, identity, msg.host, msg.host_id, msg.pid, msg.endpoint,
                    msg.prefer, now, plain_data=msg.plain_data, idle_since=now,
                    holds=frozenset(msg.holds or ()), slot=msg.slot)
    state.workers[worker_id] = worker
    state.record(WorkerReady.of(worker))
    state.peers[identity] = ("worker", worker_id)
    # "task": None tells a worker the broker had forgotten that it must drop the task
    # it still runs (its splits went to others): nothing it still holds may reach a
    # consumer.
    # A new worker fills a free place; moving busy ones waits for the tick (a fleet that
    # joins would weigh the whole pool once per worker).
    return [Out(identity, Ack(heartbeat=state.heartbeat, task=None)),
            *placement.assign(state, now, rebalance=False)]


def worker_heartbeat(state: Tables, identity: bytes, msg: Heartbeat, now: float) -> list[Out]:
    """A worker's HEARTBEAT: its counters (summed into its job's), rate, what its
    producer is doing, and a shared job's trainers' lag; or that it finished the task it
    was told to drain (``drained``: it moves on, see ``placement.drained``), and before
    that, a shared job's, what it hands on (``handover``, kept on the worker until then)."""
    worker = state.worker_at(identity)
    if worker is not None and msg.leaving and not worker.leaving:
        worker.leaving = True  # (SIGTERM: it drains, then hands its splits on)
        job = state.job_of(worker.task)
        return failures.holds(state, job) if job is not None else []
    if worker is not None and msg.handover and worker.task is not None:
        room = MAX_HANDOVER_ENTRIES - len(worker.handover)
        worker.handover.extend(msg.handover[:max(0, room)])
    if worker is not None and msg.drained is not None:
        return placement.drained(state, worker, msg.drained, now)
    stats = msg.stats
    if worker is None or stats is None:
        return []
    elements = stats.get("elements")
    before = worker.stats.get("elements")
    if isinstance(elements, int) and (not isinstance(before, int) or elements > before):
        worker.sent_at = now  # it makes progress (failures.stuck checks reports by it)
    if isinstance(elements, int) and isinstance(before, int):
        elapsed = now - worker.stats.get("_at", now)
        if elapsed > 0:
            worker.rate = (elements - before) / elapsed
    job = state.job_of(worker.task)
    if job is not None:
        job.metrics.elements += _delta(stats, worker.stats, "elements")
        job.metrics.bytes += _delta(stats, worker.stats, "bytes")
        for stage in STAGES:
            job.metrics.stages[stage] = job.metrics.stages.get(stage, 0.0) + _delta(
                stats, worker.stats, f"{stage}_seconds")
    worker.stats = {**{k: v for k, v in stats.items() if isinstance(v, (int, float))},
                    "_at": now}
    worker.doing = msg.doing
    warm = stats.get("warm")
    worker.warm = tuple(f for f in warm[:WARM_PIPELINES] if isinstance(f, str) and
                        0 < len(f) <= 64 and f.isalnum()) if isinstance(warm, list) else ()
    trainers = stats.get("trainers")
    worker.trainers = {
        str(c): {k: int(v[k]) for k in ("lag", "skipped") if isinstance(v.get(k), int)}
        for c, v in trainers.items() if isinstance(v, dict)
    } if isinstance(trainers, dict) else {}
    return []


def worker_log(state: Tables, identity: bytes, msg: Log, now: float) -> list[Out]:
    """Pass what user code printed or logged on a worker to its job's consumers
    (zloader/forward.py); lines of a task the worker no longer runs are dropped."""
    worker = state.worker_at(identity)
    lines = msg.lines
    if worker is None or worker.task is None or msg.task != worker.task:
        return []
    if len(lines) > worker.log_budget.fill(now):  # not one of our workers: dropped
        state.rejected += 1
        return []
    worker.log_budget.tokens -= len(lines)
    job = state.job_of(worker.task)
    if job is None:
        return []
    forwarded = Log(lines=lines, host=worker.host, pid=worker.pid)
    return [Out(c.identity, forwarded) for c in state.consumers_of(job)]


def consumer_heartbeat(state: Tables, identity: bytes, now: float,
                       msg: Heartbeat | None = None) -> list[Out]:
    """A consumer's HEARTBEAT (or None: a JOB view asked for): its stats, the workers it
    reports stuck, the splits it missed; answered with its job's view."""
    consumer = state.consumer_at(identity)
    if consumer is None:
        return []
    job = state.jobs.get(consumer.job)
    stats = msg.stats if msg is not None else None
    out: list[Out] = []
    if job is not None and msg is not None and msg.stuck:
        out += failures.stuck(state, job, consumer, msg.stuck, now)
    if job is not None and msg is not None and msg.reread:
        failures.reread(state, job, consumer, msg.reread)
    if msg is not None:
        consumer.heard = True
    if stats is not None:
        stats = {k: v for k, v in stats.items() if isinstance(v, (int, float))
                 and not isinstance(v, bool) and v >= 0}
        if job is not None:
            job.metrics.reported = True
            job.metrics.wait_seconds += _delta(stats, consumer.stats, "wait_seconds")
            job.metrics.skipped += int(_delta(stats, consumer.stats, "skipped"))
        consumer.stats = stats
        began = not consumer.active and stats.get("active", 1) != 0
        consumer.active = stats.get("active", 1) != 0
        if began and job is not None:
            out += _began(state, job, identity, now)
    return out + ([Out(identity, views.job_view(state, job))] if job else [])


def _began(state: Tables, job: Job, identity: bytes, now: float) -> list[Out]:
    """A consumer's heartbeat says it reads an epoch the broker had not heard of (its
    EPOCH went before it knew its job, or was lost; or it was taken for one that does not
    read, ``jobs.unheard``): the job is hungry as after an EPOCH
    (``jobs.epoch_started``), and one without a worker may take one now. The consumer's
    view comes after, from the heartbeat's answer."""
    job.metrics.hungry_until = max(job.metrics.hungry_until, now + 2 * state.heartbeat)
    if job.tasks:
        return []
    return [o for o in placement.assign(state, now)
            if o.identity != identity or o.command is not Command.JOB]


def _delta(new: dict[str, Any], old: dict[str, Any], key: str) -> Any:
    """How much counter ``key`` grew between two stats reports (0 if it went back)."""
    value, before = new.get(key), old.get(key, 0)
    if isinstance(value, (int, float)) and isinstance(before, (int, float)) \
            and not isinstance(value, bool) and value >= before:
        return value - before
    return 0
