"""What the broker tells: every heartbeat, each job's view for its consumers (JOB, made
in ``views.py``), ``zloader status`` (STATUS), the metrics snapshot (``zloader-broker
--metrics-port``), and each job's starvation and desired workers sampled on the way
(``zloader/broker/autoscale.py``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from zloader._defaults import (
    ACTUATOR_EXPIRY,
    AUTOSCALE_MAX_WORKERS,
    HUNGRY_HOLD_BEATS,
    HUNGRY_STARVATION,
    MAX_ACTUATOR_CAP,
    MAX_NAME,
    STATUS_LIST_ITEMS,
    STATUS_REPLY_BYTES,
)
from zloader.broker import coordinated, placement, pool
from zloader.broker.records import Job, Out, Tables, Worker
from zloader.broker.views import busy_workers, job_view
from zloader.transport.messages import Heartbeat
from zloader.transport.messages import Job as JobView
from zloader.transport.protocol import ProtocolError

__all__ = ["fleet_cap", "heartbeats", "metrics", "note_actuator", "sample", "status"]

log = logging.getLogger("zloader.broker")


def heartbeats(state: Tables) -> list[Out]:
    """What the broker sends every heartbeat interval: each job's view made once for all
    its consumers (a fleet's every consumer, every second)."""
    beat = Heartbeat()  # one record for all (the loop encodes it once)
    out = [Out(w.identity, beat) for w in state.workers.values()]
    busy = busy_workers(state)
    views: dict[str, JobView] = {}
    for consumer in state.consumers.values():
        job = state.jobs.get(consumer.job)
        if job is not None:
            view = views.get(job.id)
            if view is None:
                view = views[job.id] = job_view(state, job, busy)
            out.append(Out(consumer.identity, view))
    return out


def status(state: Tables, now: float, start: Mapping[str, Any] | None = None
           ) -> dict[str, Any]:
    """One STATUS reply (what ``zloader status --json`` prints), bounded whatever the
    broker holds: its ``summary`` (counts), then its workers and jobs from ``start``
    (``{"workers": i, "jobs": j}``, offsets into each list, as the last reply's ``next``
    gave them; None: from the first), as many as fit in ``STATUS_REPLY_BYTES``.
    ``left_off`` counts those after the reply's; ``next`` is where the next reply starts,
    or None once the reply holds the last. ``surplus`` marks the workers an actuator should
    drain (see :func:`_surplus`).

    Raises:
        ProtocolError: ``start`` is not such an object.
    """
    first_worker, first_job = _start(start)
    surplus = _surplus(state, now)
    claims = placement.claims(state, now)
    entitled = pool.shares(claims.values(), len(state.workers))

    budget = [STATUS_REPLY_BYTES]
    workers = _fill(list(state.workers.values()), first_worker,
                    lambda w: _worker_entry(state, w, surplus), budget)
    jobs = _fill(list(state.jobs.values()), first_job,
                 lambda j: _job_entry(state, j, claims, entitled),
                 budget) if first_worker + len(workers) >= len(state.workers) else []
    end_workers, end_jobs = first_worker + len(workers), first_job + len(jobs)
    done = end_workers >= len(state.workers) and end_jobs >= len(state.jobs)
    return {"summary": {"workers": len(state.workers), "jobs": len(state.jobs),
                        "busy_workers": busy_workers(state),
                        "consumers": len(state.consumers), "refused": state.refused,
                        "rejected": state.rejected, "worker_deaths": state.deaths,
                        "worker_cap": fleet_cap(state, now)},
            "workers": workers, "jobs": jobs,
            "left_off": {"workers": max(0, len(state.workers) - end_workers),
                         "jobs": max(0, len(state.jobs) - end_jobs)},
            "next": None if done else {"workers": end_workers, "jobs": end_jobs},
            "rejected": state.rejected}


def _worker_entry(state: Tables, w: Worker, surplus: set[str]) -> dict[str, Any]:
    """A worker's entry in a STATUS reply (``surplus``: the workers to drain)."""
    return {"worker": w.id, "host": w.host, "host_id": w.host_id, "pid": w.pid,
            "endpoint": w.endpoint, "surplus": w.id in surplus,
            "tasks": 1 if w.task else 0, "job": state.task_job(w.task),
            "elements_per_second": round(w.rate, 1),
            "elements": w.stats.get("elements", 0),
            "cpu_seconds": w.stats.get("cpu_seconds", 0.0),
            "rejected": w.stats.get("rejected", 0), "warm": list(w.warm)}


def _job_entry(state: Tables, j: Job, claims: dict[str, pool.Claim],
               entitled: dict[str, float]) -> dict[str, Any]:
    """A job's entry in a STATUS reply, its lists cut at STATUS_LIST_ITEMS (``claims``:
    what each job asks of the pool; ``entitled``: each job's share of it, in workers)."""
    hosts = sorted(state.hosts(j))
    entry = {"job": j.id, "fingerprint": j.fingerprint, "name": j.name,
             "sharding": j.sharding, "consumers": len(j.consumers),
             "workers": len(j.tasks), "consumer_hosts": hosts[:STATUS_LIST_ITEMS],
             "elements": j.metrics.elements, "bytes": j.metrics.bytes,
             "shared": j.share is not None,
             "starvation": round(j.metrics.starvation, 3),
             "desired_workers": j.metrics.desired,
             "weight": j.weight, "share": round(entitled[j.id], 2),
             "active": claims[j.id].wants > 0, "hungry": claims[j.id].hungry,
             "stage_seconds": {k: round(v, 3) for k, v in j.metrics.stages.items()},
             "trainers": _trainers(state, j) if j.share is not None else [],
             "rounds": _rounds(j), "state": "failed" if j.error else "running",
             "unconfirmed_stuck": j.metrics.unconfirmed}
    if len(hosts) > STATUS_LIST_ITEMS:
        entry["consumer_hosts_left_off"] = len(hosts) - STATUS_LIST_ITEMS
    if j.share is not None and len(j.consumers) > STATUS_LIST_ITEMS:
        entry["trainers_left_off"] = len(j.consumers) - STATUS_LIST_ITEMS
    return entry


def note_actuator(state: Tables, entry: Any, now: float) -> None:
    """A STATUS request's ``actuator``, ``{id, cap, workers}``: an actuator of the fleet,
    the most workers it runs and the ids of those it runs now (a malformed one is counted
    and ignored)."""
    workers = entry.get("workers") if isinstance(entry, Mapping) else None
    if not (isinstance(entry, Mapping) and isinstance(entry.get("id"), str)
            and 0 < len(entry["id"]) <= MAX_NAME
            and isinstance(entry.get("cap"), int) and not isinstance(entry["cap"], bool)
            and 1 <= entry["cap"] <= MAX_ACTUATOR_CAP
            and isinstance(workers, list) and len(workers) <= MAX_ACTUATOR_CAP
            and all(isinstance(w, str) and len(w) <= MAX_NAME for w in workers)):
        state.rejected += 1
        log.warning("dropped a malformed STATUS.actuator (must be {id, cap >= 1, workers: "
                    "[worker ids]})")
        return
    state.actuators[entry["id"]] = (entry["cap"], now, frozenset(workers))


def fleet_cap(state: Tables, now: float) -> int | None:
    """The most workers the fleet can have: the caps of the actuators heard from in the
    last ACTUATOR_EXPIRY seconds, plus the workers none of them runs (fixed ones); None
    without an actuator (a fixed pool: an addition it does not carry out is given up,
    autoscale.py)."""
    for gone in [a for a, (_, seen, _) in state.actuators.items()
                 if now - seen > ACTUATOR_EXPIRY]:
        del state.actuators[gone]
    if not state.actuators:
        return None
    theirs = frozenset().union(*(ids for _, _, ids in state.actuators.values()))
    return (sum(cap for cap, _, _ in state.actuators.values())
            + sum(1 for w in state.workers if w not in theirs))


def _start(start: Mapping[str, Any] | None) -> tuple[int, int]:
    """The offsets of a STATUS request's ``from``: (workers, jobs)."""
    if start is None:
        return 0, 0
    if not isinstance(start, Mapping):
        raise ProtocolError("STATUS: field 'from' must be {workers, jobs}, two offsets")
    offsets = []
    for name in ("workers", "jobs"):
        value = start.get(name, 0)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise ProtocolError(f"STATUS: field 'from.{name}' must be an integer >= 0, got "
                                f"{str(value)[:40]!r}")
        offsets.append(value)
    return offsets[0], offsets[1]


T = TypeVar("T")


def _fill(items: Sequence[T], first: int, entry: Callable[[T], dict[str, Any]],
          budget: list[int]) -> list[dict[str, Any]]:
    """The entries of ``items`` from ``first`` on that fit in ``budget[0]`` bytes of JSON
    (taken from it), and at least one while any is left: each entry is bounded (its lists
    are cut at STATUS_LIST_ITEMS), so a reply always moves on and stays below a message."""
    out: list[dict[str, Any]] = []
    for item in items[first:]:
        made = entry(item)
        size = len(json.dumps(made, separators=(",", ":"))) + 1
        if size > budget[0] and (out or budget[0] < STATUS_REPLY_BYTES):
            budget[0] = 0
            break
        budget[0] -= size
        out.append(made)
    return out


def _rounds(job: Job) -> dict[str, Any] | None:
    """A coordinated job's rounds, its list of vacant indices cut at STATUS_LIST_ITEMS."""
    if job.rounds is None:
        return None
    rounds = coordinated.round_status(job.rounds, job.epoch)
    vacant = rounds["vacant"]
    if len(vacant) > STATUS_LIST_ITEMS:
        rounds["vacant"] = vacant[:STATUS_LIST_ITEMS]
        rounds["vacant_left_off"] = len(vacant) - STATUS_LIST_ITEMS
    return rounds


def metrics(state: Tables, now: float) -> dict[str, Any]:
    """A snapshot for ``zloader-broker --metrics-port`` (zloader/broker/metrics.py); updates
    each job's starvation ratio over the time since the last snapshot."""
    sample(state, now)
    entitled = pool.shares(placement.claims(state, now).values(), len(state.workers))
    jobs = []
    for job in state.jobs.values():
        jobs.append({"job": job.id, "name": job.name or "", "elements": job.metrics.elements,
                     "bytes": job.metrics.bytes, "wait_seconds": job.metrics.wait_seconds,
                     "starvation": job.metrics.starvation, "skipped": job.metrics.skipped,
                     "failed_splits": len(job.handout.failed), "consumers": len(job.consumers),
                     "workers": len(job.tasks), "stages": dict(job.metrics.stages),
                     "desired_workers": job.metrics.desired, "weight": job.weight,
                     "share_workers": entitled[job.id]})
    workers = [{"worker": w.id, "host": w.host, "job": state.task_job(w.task) or "",
                **{k: w.stats.get(k, 0) for k in ("elements", "bytes", "cpu_seconds",
                                                   "rejected", "credits", "ring_fill")}}
               for w in state.workers.values()]
    return {"jobs": jobs, "workers": workers, "rejected": state.rejected,
            "worker_deaths": state.deaths}


def sample(state: Tables, now: float) -> None:
    """Each job's starvation over the time since the last sample (the share of it its
    consumers waited for data), and its autoscaler's ``desired_workers``.

    A job with consumers none of which reported since the last sample is not sampled: the
    silence says nothing of their waiting (a broker that reads its messages late, a tick
    that came before the reports), so it keeps its starvation and the next sample spans
    both intervals. Read as "they did not wait", a late broker would take the job for
    one that no longer needs its workers and move them (docs/pool.md)."""
    cap = fleet_cap(state, now)
    for job in state.jobs.values():
        metrics = job.metrics
        metrics.scaler.max_workers = cap if cap is not None else AUTOSCALE_MAX_WORKERS
        if metrics.waited_at is not None and (now <= metrics.waited_at[1]
                                              or (job.consumers and not metrics.reported)):
            continue
        metrics.reported = False
        if metrics.waited_at is not None and job.consumers:
            metrics.starvation = min(1.0, max(0.0, (metrics.wait_seconds - metrics.waited_at[0])
                                              / ((now - metrics.waited_at[1])
                                                 * len(job.consumers))))
            metrics.sampled = True
            if metrics.starvation > HUNGRY_STARVATION:
                metrics.hungry_until = max(metrics.hungry_until,
                                           now + HUNGRY_HOLD_BEATS * state.heartbeat)
        metrics.waited_at = (metrics.wait_seconds, now)
        metrics.desired = _desired(job, now)


def _desired(job: Job, now: float) -> int:
    """The workers the job should have (zloader/broker/autoscale.py); static and
    deterministic jobs keep the ones they have, and so does a job nobody reads."""
    if job.fixed or not job.consumers:
        return len(job.tasks)
    scaler = job.metrics.scaler
    desired = min(scaler.max_workers, scaler.update(now, len(job.tasks), job.metrics.starvation))
    if desired != job.metrics.desired and job.metrics.desired:
        log.info("job %s: desired_workers %d -> %d (it has %d; consumers waited %.0f%% "
                 "of the time)", job.name or job.id, job.metrics.desired, desired, len(job.tasks),
                 100 * job.metrics.starvation)
    return desired


def _deficit(job: Job) -> int:
    """Workers the job lacks for its ``desired_workers`` (negative: it has too many);
    0 before the autoscaler's first decision and for jobs that keep their workers."""
    if job.metrics.desired == 0 or job.fixed:
        return 0
    return job.metrics.desired - len(job.tasks)


def _surplus(state: Tables, now: float) -> set[str]:
    """Workers to drain: for each job with more than it wants, the excess, remote
    ones (no consumer of the job on their host) before local ones, the last assigned
    first; and workers idle for a cooldown while no job lacks any."""
    out: set[str] = set()
    for job in state.jobs.values():
        excess = -_deficit(job)
        if excess <= 0:
            continue
        hosts = state.hosts(job)
        held = sorted(((state.workers[w], job.indices.get(t, 0))
                       for t, w in job.tasks.items() if w in state.workers),
                      key=lambda pair: (pair[0].host_id in hosts, -pair[1]))
        out.update(worker.id for worker, _ in held[:excess])
    if not any(_deficit(j) > 0 for j in state.jobs.values()):
        out.update(w.id for w in state.workers.values()
                   if w.task is None and now - w.idle_since > state.cooldown)
    return out


def _trainers(state: Tables, job: Job) -> list[dict[str, Any]]:
    """A shared job's trainers (the first STATUS_LIST_ITEMS): pid, lag (elements produced
    that it has not been sent, the most over the job's workers), elements skipped
    (summed) and, when trainers share a prefix of their pipelines, the stages its branch
    shares with the job's own pipeline (``prefix``) and its own (``suffix``)."""
    out = []
    for cid in sorted(job.consumers)[:STATUS_LIST_ITEMS]:
        consumer = state.consumers.get(cid)
        seen = [w.trainers[cid] for t in job.tasks.values()
                if (w := state.workers.get(t)) is not None and cid in w.trainers]
        out.append({"consumer": cid, "pid": consumer.pid if consumer else None,
                    "lag": max((s.get("lag", 0) for s in seen), default=0),
                    "skipped": sum(s.get("skipped", 0) for s in seen)})
        if job.branches is not None and consumer is not None:
            out[-1].update(job.branches.view(consumer.branch))
    return out
