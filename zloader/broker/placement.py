"""Placement: which worker runs which job. Free workers fill the jobs with consumers;
busy ones move where the pool's policy (``zloader/broker/pool.py``, docs/pool.md) says,
each leaving its job as a draining worker does (exactly once: ``failures.leave``).
"""

from __future__ import annotations

import dataclasses
import logging
import os

from zloader._defaults import HUNGRY_STARVATION, MOVE_DRAIN_SECONDS
from zloader._host import loopback
from zloader.broker import failures, pool, views
from zloader.broker.events import TaskGiven
from zloader.broker.records import INHERITED, Job, Out, Tables, Worker
from zloader.transport import messages
from zloader.transport.protocol import Command

__all__ = ["assign", "claims", "drained", "give", "preempt"]

log = logging.getLogger("zloader.broker")


def assign(state: Tables, now: float, rebalance: bool = True) -> list[Out]:
    """Give free workers to jobs, then (``rebalance``) move busy ones where the pool's
    policy says: every job with consumers gets its share."""
    out = _fill(state, now)
    return (out + _rebalance(state, now)) if rebalance else out


def _fill(state: Tables, now: float) -> list[Out]:
    """Give each free worker a job: its preferred job first, then the job furthest
    below its share of the pool, one whose consumers share the worker's host, the job
    with the fewest workers (static jobs take at most ``width``). Workers on a host
    with consumers go first (hybrid placement: shared memory is the cheapest path)."""
    out: list[Out] = []
    if views.busy_workers(state) >= len(state.workers):  # (counted per job: cheap)
        return out
    entitled = pool.shares(claims(state, now).values(), len(state.workers))
    job_hosts = {j.id: state.hosts(j) for j in state.jobs.values()}
    hosts = {c.host_id for c in state.consumers.values()}
    idle = sorted((w for w in state.workers.values() if w.task is None),
                  key=lambda w: w.host_id not in hosts)
    for worker in idle:
        open_jobs = [j for j in state.jobs.values() if j.error is None and j.consumers
                     and _has_room(j)]
        if not open_jobs:
            break
        open_jobs = [j for j in open_jobs if _can_serve(worker, j, job_hosts)]
        if not open_jobs:
            continue
        preferred = [j for j in open_jobs if j.id == worker.prefer]
        job = preferred[0] if preferred else min(open_jobs, key=lambda j: (
            len(j.tasks) - entitled.get(j.id, 0.0), worker.host_id not in job_hosts[j.id],
            len(j.tasks), j.created))
        out += give(state, worker, job, now)
    return out


def _has_room(job: Job) -> bool:
    """Whether ``job`` takes another worker (a static job takes at most ``width``)."""
    return not job.fixed or len(job.tasks) < job.width


def _active(state: Tables, job: Job) -> bool:
    """Whether ``job`` is read now (an epoch under way, not failed)."""
    return job.error is None and any(c.active for c in state.consumers_of(job))


def _can_serve(worker: Worker, job: Job, job_hosts: dict[str, set[str]]) -> bool:
    """Whether ``worker`` can run ``job`` at all: a pipeline only forked workers hold
    (embedded) runs on none other, and a worker whose data port is on loopback only
    serves consumers on its own host."""
    if job.pipeline == INHERITED and job.fingerprint not in worker.holds:
        return False
    return not loopback(worker.endpoint) or worker.host_id in job_hosts[job.id]


def give(state: Tables, worker: Worker, job: Job, now: float) -> list[Out]:
    """Start a task of ``job`` on the free ``worker``."""
    task = os.urandom(8).hex()
    used = set(job.indices.values())
    # A worker forked for a Loader takes the index it was made for (it may have prepared
    # that index's first epoch, see Source.forked); any other the lowest free one.
    index = worker.slot if worker.slot is not None and worker.slot not in used \
        else next(i for i in range(len(used) + 1) if i not in used)
    job.tasks[task] = worker.id
    job.indices[task] = index
    worker.task, worker.moving_to = task, None
    worker.since = now
    state.record(TaskGiven(job=job.id, task=task, worker=worker.id, index=index))
    return [*task_message(worker, job), *failures.adopt_orphans(state, job),
            *views.tell_consumers(state, job)]


def task_message(worker: Worker, job: Job) -> list[Out]:
    """The TASK that starts ``worker``'s task of ``job``, and a BRANCH for each branch of
    a shared job whose trainers share a prefix (sent again when the worker comes back on
    a new connection: the first may have been lost with the old one)."""
    assert worker.task is not None
    task = Out(worker.identity, messages.Task(
        task=worker.task, job=job.id, options=job.options, index=job.indices[worker.task],
        width=job.width, entropy=job.entropy, source_data=job.source_data,
        fingerprint=job.fingerprint, pipeline=job.pipeline,
        first_tap=job.branches.own.first_tap if job.branches is not None else 0),
        (job.blob,))
    branches = job.branches
    if branches is None:
        return [task]
    return [task, *(branch_message(worker, job, k)
                    for k in range(1, len(branches.members) + 1))]


def branch_message(worker: Worker, job: Job, index: int) -> Out:
    """The BRANCH that tells ``worker``'s task of ``job`` its branch ``index``."""
    assert worker.task is not None and job.branches is not None
    member = job.branches.members[index - 1]
    return Out(worker.identity, messages.Branch(
        task=worker.task, branch=index, tap=member.tap,
        fingerprint=member.fingerprint, pipeline=member.pipeline,
        source_data=member.source_data), (member.blob,))


def claims(state: Tables, now: float) -> dict[str, pool.Claim]:
    """What each job asks of the pool now. A worker draining to move counts as its new
    job's already."""
    moving: dict[str, int] = {}
    for worker in state.workers.values():
        if worker.moving_to is None:
            continue
        source = state.job_of(worker.task)
        if source is not None:
            moving[source.id] = moving.get(source.id, 0) - 1
            moving[worker.moving_to] = moving.get(worker.moving_to, 0) + 1
    out = {}
    for job in state.jobs.values():
        active = _active(state, job)
        hungry = active and (job.metrics.starvation > HUNGRY_STARVATION
                             or now < job.metrics.hungry_until)
        if not active:
            wants = 0
        elif job.fixed:
            wants = job.width
        elif hungry or not job.metrics.desired or not job.metrics.sampled:
            # its consumers wait, or nobody knows yet whether they do (none of their
            # reports was read between two samples): it can use more workers
            wants = pool.UNBOUNDED
        else:  # its autoscaler's count, once it has more than its consumers take
            wants = job.metrics.desired
        out[job.id] = pool.Claim(job.id, job.weight, len(job.tasks) + moving.get(job.id, 0),
                                 wants, hungry,
                                 movable=not job.fixed or not active,
                                 exact=job.track or not active)
    return out


def _rebalance(state: Tables, now: float) -> list[Out]:
    """Move busy workers to hungry jobs below their share, one at a time, each leaving
    its job as a draining worker does (exactly once: see ``failures.leave``), at most
    ``MOVES_PER_SECOND`` (the rest wait for the next tick). The claims and holdings are
    made once and follow the moves (a move changes two jobs' counts and one worker's
    holding: a fleet's every move must not weigh every worker again). Each consumer of
    a job that gave or took workers gets the job's last view only."""
    out = _overdue(state, now)
    budget = state.move_budget
    if budget.fill(now) < 1:
        return out
    wanted = claims(state, now)
    if not any(c.hungry and c.held < c.wants for c in wanted.values()):
        return out  # the usual case: no job waits for a worker it lacks
    job_hosts = {j.id: state.hosts(j) for j in state.jobs.values()}
    holdings: dict[str, pool.Holding] = {}
    for job in state.jobs.values():
        for task, worker_id in job.tasks.items():
            worker = state.workers.get(worker_id)
            if worker is not None and worker.moving_to is None:
                holdings[worker_id] = _holding(worker, job, task, job_hosts)

    def eligible(worker_id: str, job_id: str) -> bool:
        return _can_serve(state.workers[worker_id], state.jobs[job_id], job_hosts)

    while budget.fill(now) >= 1:
        move = pool.next_move(wanted.values(), holdings.values(), eligible, now)
        if move is None:
            break
        budget.tokens -= 1
        worker, job = state.workers[move[0]], state.jobs[move[1]]
        source = state.jobs[holdings.pop(worker.id).job]
        for changed, step in ((source.id, -1), (job.id, 1)):
            wanted[changed] = dataclasses.replace(wanted[changed],
                                                  held=wanted[changed].held + step)
        if _drains(state, worker, source):
            out += _drain(state, worker, job, now)
        else:
            out += preempt(state, worker, now)
            out += give(state, worker, job, now)
            assert worker.task is not None
            holdings[worker.id] = _holding(worker, job, worker.task, job_hosts)
    return _last_views(out)


def _holding(worker: Worker, job: Job, task: str,
             job_hosts: dict[str, set[str]]) -> pool.Holding:
    """``worker``'s task of ``job`` as the pool weighs it: remote ones (no consumer of the
    job on their host) and the last assigned move first."""
    return pool.Holding(worker.id, job.id, worker.since,
                        rank=(worker.host_id in job_hosts[job.id], -job.indices.get(task, 0)))


def _last_views(out: list[Out]) -> list[Out]:
    """``out`` less every JOB view that a later one to the same consumer supersedes (a
    view is the whole job as it is: the last one says all)."""
    last = {o.identity: n for n, o in enumerate(out) if o.command is Command.JOB}
    if len(last) == sum(1 for o in out if o.command is Command.JOB):
        return out
    return [o for n, o in enumerate(out)
            if o.command is not Command.JOB or last[o.identity] == n]


def _drains(state: Tables, worker: Worker, job: Job) -> bool:
    """Whether ``worker`` leaves ``job`` by draining (see :func:`_drain`) rather than at
    once: a job that does not run exactly-once, mid-epoch, with other workers. Not a
    coordinated job's (the broker numbers its rounds). A shared job's worker drains while
    another of its workers stays: every trainer reading then gets what it made, once, and
    a trainer that starts one of those epochs later gets it from the worker it hands its
    splits on to (zloader/sharing/handover.py). (Moved at once, its splits were read again
    and every trainer got them twice.)"""
    if job.track or job.rounds is not None or len(job.tasks) < 2 or not _active(state, job):
        return False
    if job.share is None:
        return True
    return any(w != worker.id and w in state.workers and state.workers[w].moving_to is None
               for w in job.tasks.values())


def _drain(state: Tables, worker: Worker, taker: Job, now: float) -> list[Out]:
    """Move ``worker`` off a job that does not run exactly-once without repeating a split:
    it finishes the splits it took and sends what they make (``RELEASE.drain``), then
    says it is done (``HEARTBEAT.drained``, see :func:`drained`). Its job has no fence to
    read a moved split again less what its consumers hold. (Not a job's last worker: its
    END would end the epoch for the consumers while splits nobody took remain, so it moves
    at once and its splits are read again when a worker comes back; see :func:`_drains`
    for the others that move at once.) A shared job's worker sends its window to every
    trainer before it says so."""
    assert worker.task is not None
    log.info("worker %s (pid %d on %s) drains its task to move to job %s (the pool's "
             "share for it)", worker.id, worker.pid, worker.host, taker.name or taker.id)
    worker.moving_to, worker.moving_since = taker.id, now
    job = state.job_of(worker.task)
    held = failures.holds(state, job) if job is not None else []  # (its handover comes)
    return [Out(worker.identity, messages.Release(task=worker.task, drain=True)), *held]


def drained(state: Tables, worker: Worker, task: str, now: float) -> list[Out]:
    """``worker`` finished its drained ``task``: off its job (nothing of it is left to
    read again), then on to the job it moves to, if that still wants it, or any."""
    job = state.job_of(task)
    if job is None or worker.task != task:
        worker.handover = []
        return []
    taker = state.jobs.get(worker.moving_to or "")
    worker.moving_to = None
    out = failures.leave(state, worker, job, task, died=False, now=now, stays=True,
                         clean=True)
    if taker is not None and _has_room(taker) \
            and _can_serve(worker, taker, {taker.id: state.hosts(taker)}):
        return out + give(state, worker, taker, now)
    return out + assign(state, now)


def _overdue(state: Tables, now: float) -> list[Out]:
    """Workers still draining MOVE_DRAIN_SECONDS after they were told: moved at once."""
    out: list[Out] = []
    for worker in list(state.workers.values()):
        if worker.moving_to is None or now - worker.moving_since < MOVE_DRAIN_SECONDS:
            continue
        taker = state.jobs.get(worker.moving_to)
        worker.moving_to = None
        if worker.task is None or state.job_of(worker.task) is None:
            continue
        log.warning("worker %s (pid %d on %s) did not drain its task in %.0f s: moved now "
                    "(its split under way is read again)", worker.id, worker.pid,
                    worker.host, MOVE_DRAIN_SECONDS)
        out += preempt(state, worker, now)
        if taker is not None:
            out += give(state, worker, taker, now)
    return out


def preempt(state: Tables, worker: Worker, now: float) -> list[Out]:
    """Take ``worker`` off its job for another: it drops the task (``RELEASE``) and
    its splits go to the job's other workers, as a dead worker's do (exactly once for
    an exactly-once job: a fence), but it stays registered."""
    task = worker.task
    job = state.job_of(task)
    assert task is not None and job is not None
    log.info("worker %s (pid %d on %s) moves off job %s (the pool's share for another "
             "job)", worker.id, worker.pid, worker.host, job.name or job.id)
    return [Out(worker.identity, messages.Release(task=task)),
            *failures.leave(state, worker, job, task, died=False, now=now, stays=True)]
