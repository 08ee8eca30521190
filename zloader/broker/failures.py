"""Failures and fences: a worker that dies, is stuck or moves leaves its job (``leave``),
and the splits it had not delivered are read again by the others; for an exactly-once job
only once every consumer has said what it holds of them (a :class:`Fence`). Also a
consumer's report of an epoch ended short (reread), and a broker that was itself stopped
(``stalled``). (A pipeline that fails, TASK_FAILED, ends its job: ``jobs.task_failed``.)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

from zloader._defaults import DRAINED_TASKS_KEPT
from zloader.broker import coordinated, splits, views
from zloader.broker.events import OrphanAdopted, Orphaned, WorkerGone, WorkerLeft
from zloader.broker.records import (
    FENCE_GRACE,
    KILLS_TO_FAIL,
    Consumer,
    Fence,
    Job,
    Out,
    PassKey,
    Tables,
    Worker,
)
from zloader.lineage import merge_info
from zloader.sharing.handover import Segment, to_wire
from zloader.transport.messages import Delivered, Handover, Release
from zloader.transport.protocol import ProtocolError

__all__ = ["adopt_orphans", "complete_fences", "delivered", "drop_worker", "give_up",
           "holds", "leave",
           "reread",
           "stalled", "stuck"]

log = logging.getLogger("zloader.broker")


def drop_worker(state: Tables, worker_id: str, died: bool, now: float,
                requeue: bool = True, clean: bool = False) -> list[Out]:
    """Forget a worker; its splits not yet delivered are read again by others (see
    :func:`leave`; ``clean``: it drained first)."""
    worker = state.workers.pop(worker_id, None)
    if worker is None:
        return []
    state.deaths += died
    state.peers.pop(worker.identity, None)
    job = state.job_of(worker.task)
    if job is None or worker.task is None:
        state.record(WorkerGone(worker=worker_id, died=died))
        return []
    return leave(state, worker, job, worker.task, died, now, requeue, clean=clean)


def leave(state: Tables, worker: Worker, job: Job, task: str, died: bool, now: float,
          requeue: bool = True, stays: bool = False, clean: bool = False) -> list[Out]:
    """Take a worker's ``task`` off ``job``: its splits not yet delivered are read
    again by the others, for an exactly-once job once its consumers have said what they
    hold (see :class:`Fence`). ``stays``: the worker is not gone, only moved to another
    job (``placement.preempt``). ``requeue=False`` replays a leave from the journal, where
    each re-queue follows as an event of its own. ``clean``: it drained first (a draining
    move, or a BYE after SIGTERM): it sent all it read, so a job without exactly-once reads
    again only the splits it held, not those it read; a forced leave (a move at once, a
    death) reads those again too, since their elements may have waited in the worker (a
    paused consumer's credits, a shared job's window; ``splits.mark_read``). A shared
    job's worker that leaves cleanly hands what it read on (:func:`_hand_on`)."""
    worker_id = worker.id
    index = job.indices.pop(task, None)
    job.tasks.pop(task, None)
    if clean:  # (its consumers read it on until its END: the view says so, JOB.drained)
        job.drained = [*job.drained, _drained(state, job, worker, task)][-DRAINED_TASKS_KEPT:]
    current = worker.current if worker.task == task else None
    if stays and worker.task == task:
        worker.task, worker.current, worker.idle_since = None, None, now
        worker.moving_to = None
    lost, order = _undelivered(job, worker, current, died, clean)
    switches = job.handout.switches.pop(worker_id, {})
    event = (WorkerLeft(job=job.id, task=task, worker=worker_id, clean=clean) if stays
             else WorkerGone(worker=worker_id, died=died, clean=clean))
    grace = state.expiry * FENCE_GRACE
    asked = job.consumers | {c for c, t in job.silent.items() if now - t < grace}
    if job.track and lost and asked and not state.replaying:
        job.fences[os.urandom(6).hex()] = Fence(worker_id, task, died, lost, asked,
                                                 now + grace, event=event)
        return views.tell_consumers(state, job)  # journaled once the fence is done
    takers = _takers(state, job) if job.share is not None else []
    if job.share is not None and not clean and order and index is not None \
            and not state.replaying and (takers or not stays):
        # Not read again (every trainer would get them twice): made again for each
        # trainer by a worker that stays, less what it had (handover.py); by the next
        # worker the job gets, when it was the last and died (adopt_orphans). (The pool
        # moving a last worker at once, a time slice, reads them again: made again, a
        # slice's work would be done twice in every slice.)
        job.fences[os.urandom(6).hex()] = Fence(
            worker_id, task, died, lost, asked, now + grace, event=event, index=index,
            order=order, taker=takers[0][1].id if takers else None, switches=switches)
        done = complete_fences(state, job)  # (at once when no trainer is to answer)
        return done or views.tell_consumers(state, job) + holds(state, job)
    return _left(state, worker, job, task, event, lost, requeue, clean)


def _drained(state: Tables, job: Job, worker: Worker, task: str) -> dict[str, Any]:
    """``JOB.drained``'s entry for ``task``, which left ``job`` cleanly: a shared job's that
    hands splits on names their taker and epochs. A trainer that never opened one of those
    epochs there waits for the taker's END that names the task: its OPEN may reach the
    taker before the handover does (docs/sharing.md, "Moves")."""
    takers = _takers(state, job) if job.share is not None and worker.handover else []
    if not takers:
        return {"task": task}
    return {"task": task, "taker": takers[0][1].id,
            "epochs": sorted({entry["epoch"] for entry in worker.handover})}


def _undelivered(job: Job, worker: Worker, current: tuple[PassKey, int] | None, died: bool,
                 clean: bool) -> tuple[list[tuple[PassKey, int]], dict[PassKey, list[int]]]:
    """Take off ``job``'s passes the splits ``worker`` was handed and those it read:
    the ones to read again (each under the pass it came from) and, per pass, what it had
    in order (read, then handed). The split it was reading when it ``died`` counts a
    kill; one that has ``KILLS_TO_FAIL`` is failed and skipped (see :func:`leave`)."""
    worker_id = worker.id
    lost: list[tuple[PassKey, int]] = []
    order: dict[PassKey, list[int]] = {}  # per pass, what it was handed, in order
    for key, handing in job.handout.passes.items():
        handed: list[int] = []
        read = handing.read.pop(worker_id, [])
        origins = handing.origins.pop(worker_id, {})
        for place, split in enumerate(handing.handed.pop(worker_id, []), len(read)):
            if died and current == (key, split):
                job.handout.kills[split] = job.handout.kills.get(split, 0) + 1
                if job.handout.kills[split] >= KILLS_TO_FAIL:
                    job.handout.failed.append({"split": split, "pass": list(key), "message": (
                        f"split {split} was being read when its worker died "
                        f"{KILLS_TO_FAIL} times (last: worker pid {worker.pid} on "
                        f"{worker.host}); it is skipped")})
                    continue
            handed.append(split)
            lost.append((origins.get(place, key), split))
        if job.track or not clean:
            lost += [(origins.get(place, key), split) for place, split in enumerate(read)]
        if read or handed:
            order[key] = read + handed
    return lost, order


def _left(state: Tables, worker: Worker, job: Job, task: str,
          event: WorkerGone | WorkerLeft, lost: list[tuple[PassKey, int]], requeue: bool,
          clean: bool) -> list[Out]:
    """A leave without a fence (see :func:`leave`): journal it, read ``lost`` again
    (``requeue``), tell the consumers and a coordinated job's rounds, and hand a shared
    job's worker's splits on when it drained (``clean``; under its ``task``'s id: a
    trainer whose OPEN crossed its handover waits for an END that names it)."""
    state.record(event)
    if requeue:
        for key, split in lost:
            splits.requeue(state, job, key, split, {})
    out = views.tell_consumers(state, job)
    if job.rounds is not None:
        out += coordinated.announce(state, job, {}, job.rounds.lose_worker(worker.id))
    handover, worker.handover = worker.handover, []
    worker.leaving = False
    if handover and clean and job.share is not None:
        out += _hand_on(state, job, handover,
                        f"worker {worker.id} (pid {worker.pid} on {worker.host})", token=task)
    return out + holds(state, job)  # (what it held for this worker's handover, released)


def _takers(state: Tables, job: Job) -> list[tuple[str, Worker]]:
    """The job's workers that stay (a shared job's handover goes to the first)."""
    return [(task, state.workers[w]) for task, w in job.tasks.items()
            if w in state.workers and state.workers[w].moving_to is None
            and not state.workers[w].leaving]


def _hand_on(state: Tables, job: Job, handover: list[dict[str, Any]], who: str,
             fence: tuple[str, Fence] | None = None, token: str | None = None) -> list[Out]:
    """A shared job's worker's splits (zloader/sharing/handover.py: it drained, or the
    broker made them of a dead one's) to another of the job's workers, which makes them
    again for the trainers that did not have them (and hands them on in turn when it
    leaves by draining). ``who``: the worker, in the log's words; ``fence``: the dead
    one's (its taker first, if it stays); ``token``: else what the taker's ENDs name
    (``HANDOVER.fence``: the drained task's id)."""
    takers = sorted(_takers(state, job), key=lambda t: fence is None
                    or t[1].id != fence[1].taker)
    if not takers:
        log.warning("%s left shared job %s with no other worker to hand its splits to: a "
                    "trainer that starts epoch(s) %s of it later misses what it made", who,
                    job.name or job.id, sorted({e["epoch"] for e in handover}))
        return []
    task, taker = takers[0]
    log.info("the splits of %s of shared job %s go to worker %s", who, job.name or job.id,
             taker.id)
    handover[-1] = {**handover[-1], "last": True}
    held, token = _held(state, job), fence[0] if fence is not None else token
    return [Out(taker.identity, Handover(task=task, segments=(entry,), held=held,
                                         fence=token))
            for entry in handover]


def _held(state: Tables, job: Job) -> tuple[int, ...]:
    """The epochs of a shared job whose end its workers hold back: a dead worker's fence
    waits for its trainers' answers, or a worker that drains will hand its splits on (a
    trainer that started the epoch on the others alone must not end it before)."""
    fenced = {key[0] for fence in (*job.fences.values(), *(f for _, f in job.orphans))
              if fence.index is not None for key in fence.order}
    draining = {epoch for w in job.tasks.values() if w in state.workers
                and (state.workers[w].moving_to is not None or state.workers[w].leaving)
                for epoch in splits.epochs_of(job, w)}
    return tuple(sorted(fenced | draining))


def holds(state: Tables, job: Job) -> list[Out]:
    """Tell every worker of a shared job that stays the epochs whose end it holds back
    now (:func:`_held`)."""
    if job.share is None:
        return []
    held = _held(state, job)
    return [Out(worker.identity, Handover(task=task, segments=(), held=held))
            for task, worker in _takers(state, job)]


def adopt_orphans(state: Tables, job: Job) -> list[Out]:
    """A shared job whose last worker died has a worker again: it
    makes the dead one's splits again for each trainer, less what each had (the fences'
    answers), and the epochs they held end once it has."""
    if not job.orphans or not _takers(state, job):
        return []
    orphans, job.orphans = job.orphans, []
    out: list[Out] = []
    for token, fence in orphans:
        state.record(OrphanAdopted(job=job.id, fence=token))
        out += _hand_on(state, job, _made_again(job, fence),
                        f"{'dead ' if fence.died else ''}worker {fence.worker}", (token, fence))
    return out + holds(state, job)


def _made_again(job: Job, fence: Fence) -> list[dict[str, Any]]:
    """A dead worker's handover, made by the broker from what it handed it (in order) and
    what each trainer said it got from it (``DELIVERED.shared``)."""
    segments = []
    for epoch in sorted({key[0] for key in fence.order}):
        segment = Segment(epoch, fence.index or 0,
                          {key: splits for key, splits in fence.order.items()
                           if key[0] == epoch},
                          switches={key: switched for key, switched in fence.switches.items()
                                    if key[0] == epoch})
        for consumer, answer in fence.answers.items():
            if epoch < answer["epoch"] or (epoch == answer["epoch"] and answer["done"]):
                segment.served.add(consumer)
            elif epoch == answer["epoch"]:  # (the places of what it had, else how many)
                segment.had[consumer] = answer["ranges"] if "ranges" in answer \
                    else answer["count"]
        segments.append(segment)
    return to_wire(segments)


def stuck(state: Tables, job: Job, consumer: Consumer,
          reports: Sequence[dict[str, Any]], now: float) -> list[Out]:
    """A consumer got nothing from these workers of its job for its ``timeout`` though
    they held its credits (``HEARTBEAT.stuck``): each is alive (it heartbeats) but its
    user code is blocked. It is told to drop the task (``RELEASE``; a worker whose
    producer does not stop replaces its process) and dropped from the broker as if it
    had died: its splits go to the other workers, exactly once for an exactly-once job
    (a :class:`Fence`), and a split that wedges ``KILLS_TO_FAIL`` workers is reported.
    The reports are ``{worker, task, seconds}``, checked by the HEARTBEAT record.

    A report is checked against what the broker sees first (:func:`confirmed`): one
    consumer of a job may get nothing from a worker that serves another consumer of the
    job well, or a consumer may be wrong. A report that is not confirmed is counted
    (``unconfirmed_stuck`` in the job's STATUS) and logged, and the worker stays."""
    out: list[Out] = []
    for report in reports:
        worker = state.workers.get(report["worker"])
        if worker is None or worker.task != report["task"] \
                or job.tasks.get(report["task"]) != worker.id:
            continue  # gone already, or not this consumer's job's worker
        why = confirmed(state, worker, float(report["seconds"]), now)
        if why:
            job.metrics.unconfirmed += 1
            log.info("consumer %s reported worker %s (pid %d on %s) stuck for %.1f s, but %s: "
                     "kept (%d reports not confirmed in job %s)", consumer.id, worker.id,
                     worker.pid, worker.host, float(report["seconds"]), why,
                     job.metrics.unconfirmed, job.id)
            continue
        log.warning("worker %s (pid %d on %s) sent consumer %s nothing for %.1f s though "
                    "it held credits (doing %s): dropped from job %s as stuck",
                    worker.id, worker.pid, worker.host, consumer.id,
                    float(report["seconds"]), worker.doing, job.id)
        out.append(Out(worker.identity, Release(task=report["task"])))
        out += drop_worker(state, worker.id, died=True, now=now)
    return out


def confirmed(state: Tables, worker: Worker, seconds: float, now: float) -> str:
    """Why the broker's own view contradicts a report that ``worker`` sent nothing for
    ``seconds``, or "" when it agrees. Its heartbeats say what it sent in all and what its
    producer does: elements sent within the second half of that silence, or within the
    last two heartbeats whatever the claim (to any consumer), or a producer waiting for
    credits (``blocked``: its user code is not stuck; a consumer holds them), contradict
    it. A worker truly stuck is confirmed at a later report (a consumer reports again
    every ``timeout``) once its heartbeats have shown no progress for that long."""
    since = now - worker.sent_at
    if since < max(seconds / 2, 2 * state.heartbeat):
        return f"its heartbeats show elements sent {since:.1f} s ago"
    if worker.doing is not None and worker.doing.get("stage") == "blocked":
        return "its producer waits for a consumer's credits"
    return ""


def reread(state: Tables, job: Job, consumer: Consumer,
           entries: Sequence[tuple[PassKey, int, dict[str, Any]]]) -> None:
    """The job's only consumer ended an epoch short (``HEARTBEAT.reread``): records of
    these splits never reached it (unmapped segments a worker unlinked while it was
    stalled, records taken by another peer with its token). Hand each out again, less
    the indices it holds, as after a worker's death; its next ``EPOCH`` finds them
    pending and runs the epoch again. Only splits the broker handed out in that pass
    and holds no fence or re-queue for are taken.

    Raises:
        ProtocolError: an entry's info is not one (zloader/lineage/intsets.py).
    """
    if not job.track or len(job.consumers | set(job.silent)) != 1:
        return  # with several consumers none can tell alone what is missing
    fenced = {at for fence in job.fences.values() for at in fence.splits}
    read: dict[int, dict[PassKey, set[int]]] = {}  # by epoch
    for key, split, info in entries:
        if key[0] not in read:
            read[key[0]] = splits.read_splits(job, key[0])
        if split not in read[key[0]].get(key, set()) \
                or (key, split) in fenced \
                or any(split in p.requeued
                       for k, p in job.handout.passes.items() if k[0] == key[0]):
            continue
        try:
            skip = splits.skip(merge_info(None, info, (key, split)))
        except ValueError as exc:
            raise ProtocolError(f"HEARTBEAT.reread: {exc}") from None
        log.warning("consumer %s ended epoch %d of job %s without all of split %d (pass "
                    "%s): read again", consumer.id, key[0], job.id, split, list(key))
        splits.requeue(state, job, key, split, skip)


def delivered(state: Tables, identity: bytes, msg: Delivered, now: float) -> list[Out]:
    """DELIVERED: a consumer says which elements of a dead worker's splits it holds (and
    that it reads nothing more from that worker)."""
    consumer = state.consumer_at(identity)
    job = state.jobs.get(consumer.job) if consumer is not None else None
    fence = job.fences.get(msg.fence) if job is not None else None
    if consumer is None or job is None or fence is None or consumer.id not in fence.waiting:
        return []
    if fence.index is not None and msg.shared is not None:
        fence.answers[consumer.id] = msg.shared
    wanted = set(fence.splits) if fence.index is None else set()
    for key, split, info in msg.splits:
        at = (key, split)
        if at in wanted:
            try:
                fence.replies[at] = merge_info(fence.replies.get(at), info, at)
            except ValueError as exc:
                raise ProtocolError(f"DELIVERED: {exc}") from None
    fence.waiting.discard(consumer.id)
    return complete_fences(state, job)


def complete_fences(state: Tables, job: Job) -> list[Out]:
    """Re-queue the splits of every fence all consumers answered, less what they hold; a
    shared job's go to a worker that stays, to make again (:func:`_made_again`)."""
    done = [token for token, fence in job.fences.items() if not fence.waiting]
    out: list[Out] = []
    for token in done:
        fence = job.fences.pop(token)
        if fence.event is not None:
            state.record(dataclasses.replace(fence.event, fenced=True))
        if fence.index is not None and _takers(state, job):
            out += _hand_on(state, job, _made_again(job, fence),
                            f"{'dead ' if fence.died else ''}worker {fence.worker}",
                            (token, fence)) + holds(state, job)
            continue
        if fence.index is not None:  # nobody stays: the next worker makes them again
            log.info("shared job %s has no worker left to make worker %s's splits again: "
                     "the next one it gets does", job.name or job.id, fence.worker)
            job.orphans.append((token, fence))
            state.record(Orphaned.of(job, token, fence))
            out += holds(state, job)
            continue
        for key, split in fence.splits:
            info = _with_left(job, key, split, fence.replies.get((key, split), {}))
            if not info.get("all") and (key[0] >= job.epoch - 1):
                splits.requeue(state, job, key, split, splits.skip(info))
    return out + views.tell_consumers(state, job) if done else []


def _with_left(job: Job, key: PassKey, split: int, info: dict[str, Any]) -> dict[str, Any]:
    """What the consumers hold of ``split`` of pass ``key`` (their answers' ``info``) and
    what consumers that left in that epoch had yielded of it (``Handout.left``)."""
    left = job.handout.left.get(key[0])
    if left is None:
        return info
    return merge_info(info or None, left.info(key, split), (key, split))


def give_up(state: Tables, job: Job, fence: Fence, now: float) -> None:
    """A fence's deadline passed: stop waiting for the consumers that are gone (what
    they held may repeat). Those still registered with the job are alive: their answer
    was lost or is late, and every ``JOB`` view asks them again, so the fence waits
    for them another grace period."""
    gone = {c for c in fence.waiting if c not in job.consumers}
    if gone:
        log.warning("consumers %s did not answer for the splits of dead worker %s: "
                    "they are read again (what they held may repeat)", sorted(gone),
                    fence.worker)
    fence.waiting -= gone
    if fence.waiting:
        log.warning("consumers %s of job %s have not answered for the splits of dead "
                    "worker %s yet: asking them again", sorted(fence.waiting),
                    job.name or job.id, fence.worker)
        fence.deadline = now + state.expiry * FENCE_GRACE


def stalled(state: Tables, seconds: float, now: float) -> None:
    """The broker itself did not run for ``seconds`` (SIGSTOP, a long GC, a slow
    disk) until ``now``: its peers could not be heard meanwhile, so that time is not
    held against them. Their silences, the jobs' idle times and the fences' deadlines
    move forward by it; a peer that really died is still dropped, an expiry later."""
    records: list[Worker | Consumer] = [*state.workers.values(), *state.consumers.values()]
    for record in records:
        record.last_seen = min(now, record.last_seen + seconds)
    for job in state.jobs.values():
        job.silent = {c: min(now, t + seconds) for c, t in job.silent.items()}
        if job.idle_since is not None:
            job.idle_since = min(now, job.idle_since + seconds)
        for fence in job.fences.values():
            fence.deadline += seconds
