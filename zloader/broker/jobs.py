"""Jobs: consumers register a pipeline (REGISTER) and join a job, new or running; start
epochs (EPOCH); leave (BYE, or silence); a job whose pipeline fails (TASK_FAILED) ends
with an error; and a job without consumers is collected.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from typing import Any

from zloader._defaults import UNHEARD_BEATS
from zloader._host import gone, host_id, running
from zloader.broker import (
    admission,
    coordinated,
    failures,
    peers,
    placement,
    splits,
    status,
    views,
)
from zloader.broker.events import (
    BranchAdded,
    ConsumerLeft,
    EpochStarted,
    JobCreated,
    JobEnded,
    JobFailed,
    JobResumed,
    RoundsSet,
)
from zloader.broker.journal import branch_file
from zloader.broker.records import (
    FENCE_GRACE,
    INHERITED,
    Consumer,
    Handout,
    Job,
    Out,
    Tables,
)
from zloader.broker.rounds import Rounds
from zloader.lineage import Ledger, pack
from zloader.mixing import layout_of
from zloader.options import JobOptions
from zloader.sharing.options import KEY_OPTIONS
from zloader.sharing.prefix import Branches, Member
from zloader.transport.messages import ConsumerGone, Epoch, Error, Register, Release, TaskFailed
from zloader.transport.messages import Job as JobView
from zloader.transport.protocol import Command, ProtocolError

__all__ = ["bye", "drop_consumer", "epoch_started", "register", "release", "resume",
           "task_failed", "tick", "unheard"]

log = logging.getLogger("zloader.broker")


def register(state: Tables, identity: bytes, msg: Register, now: float) -> list[Out]:
    """REGISTER: a consumer joins the job its pipeline and options name (a new one, a
    shared one with the same fingerprint, the one of its ``job_name``, or the one it had
    before a restart); answered with the job's view, last."""
    consumer_id, name = msg.consumer, msg.job_name
    try:  # the rules between the options, as the Loader applies them
        msg.options.check(name)
    except ValueError as exc:
        raise ProtocolError(f"REGISTER: {exc}") from None
    options = msg.options.applied()  # exactly_once as the job would run it
    coordinated_at = _place(msg)
    found = _choose(state, identity, msg, options, coordinated_at, now)
    if isinstance(found, list):  # refused
        return found
    job, branch, out = found
    joined: dict[str, int] | None = None
    if job.rounds is not None and coordinated_at:
        why = job.rounds.replaced.get(consumer_id)
        if why:
            return [Out(identity, Error(message=why))]
        holder = job.rounds.members.get(coordinated_at[1])
        if holder is not None and holder != consumer_id:
            out += _replace(state, job, holder, coordinated_at[1], msg, now)
        joined = job.rounds.join(consumer_id, coordinated_at[1], job.epoch)
    _join(state, job, identity, consumer_id, msg, now)
    state.consumers[consumer_id].branch = branch
    # The answer comes last and is the only JOB this consumer gets now (a consumer reads
    # ``joined`` from its first JOB); job views must reach a consumer in order. A free
    # worker may take the job now; moving busy ones waits for its EPOCH or the tick
    # (weighing the pool costs O(jobs): a flood of REGISTERs would pay it each time).
    assigned = [o for o in placement.assign(state, now, rebalance=False)
                if o.identity != identity or o.command is not Command.JOB]
    view = views.job_view(state, job)
    if joined is not None:
        view = dataclasses.replace(view, joined=joined)
    if branch:
        view = dataclasses.replace(view, branch=branch)
    return [*out, *assigned, Out(identity, view)]


def _choose(state: Tables, identity: bytes, msg: Register, options: JobOptions,
            coordinated_at: tuple[int, int] | None, now: float
            ) -> tuple[Job, int, list[Out]] | list[Out]:
    """The job a REGISTER joins (the one it had before a restart, a shared one with the
    same fingerprint or a prefix of it, the one of its ``job_name``, or a new one), the
    branch it reads (a shared job's) and what the job's workers are told of it; or the
    answer that refuses it."""
    consumer_id, fingerprint, name = msg.consumer, msg.fingerprint, msg.job_name
    job = _named_job(state, name) if name else None
    previous = state.jobs.get(msg.job or "")  # it registers again (a restart)
    known = state.consumers.get(consumer_id)
    if previous is None and known is not None:
        # A REGISTER repeated while the answer was on its way (those a Loader queued
        # before the broker was up arrive together): the same consumer, the same job.
        previous = state.jobs.get(known.job)
    if previous is not None and previous.error is None:
        branch = 0 if previous.fingerprint == fingerprint else \
            previous.branches.index_of(fingerprint) if previous.branches is not None else None
        if branch is not None:
            return previous, branch, []
    if options.shared:
        return _shared_job(state, identity, msg, options, now)
    if job is not None:
        mismatch = _mismatch(job, fingerprint, options)
        if mismatch and not job.consumers and job.idle_since is not None:
            remaining = max(state.expiry, job.linger) - (now - job.idle_since)
            mismatch += (f" (its consumers went silent: it is kept for them "
                         f"{max(0.0, remaining):.0f} s more, then released)")
        if mismatch:
            return [Out(identity, Error(message=mismatch))]
        return job, 0, []
    refused = admission.admit(state, identity, len(msg.blob), now)
    if refused:
        return refused
    job = _new_job(state, identity, msg, name, options, now)
    resume(state, job, msg.resume)
    if coordinated_at:
        job.rounds = Rounds(coordinated_at[0])
        state.record(RoundsSet(job=job.id, size=coordinated_at[0]))
    return job, 0, []


def _shared_job(state: Tables, identity: bytes, msg: Register, options: JobOptions,
                now: float) -> tuple[Job, int, list[Out]] | list[Out]:
    """The running shared job a shared REGISTER joins (the same key options, and the same
    fingerprint as one of its branches; else the most stages in common: a new branch,
    zloader/sharing/prefix.py), else a new one; or the answer that refuses it."""
    alike = [j for j in state.jobs.values() if j.share is not None and j.error is None
             and all(getattr(j.options, k) == getattr(options, k) for k in KEY_OPTIONS)]
    for job in alike:
        branch = 0 if job.fingerprint == msg.fingerprint else \
            job.branches.index_of(msg.fingerprint) if job.branches is not None else None
        if branch is not None:
            return job, branch, []
    if msg.prefixes and _pipeline(msg) != INHERITED:  # (workers elsewhere can load it)
        fits = [(j.branches.fit(msg.prefixes, msg.first_tap), j) for j in alike
                if j.branches is not None]
        if fits:
            shared, best = max(fits, key=lambda f: f[0])
            if shared:
                return best, *_branch(state, best, msg, shared)
    refused = admission.admit(state, identity, len(msg.blob), now)
    if refused:
        return refused
    branches = Branches(_member(msg, len(msg.prefixes) - 1)) \
        if msg.prefixes and _pipeline(msg) != INHERITED else None
    return _new_job(state, identity, msg, None, options, now, branches), 0, []


def _member(msg: Register, tap: int) -> Member:
    return Member(msg.fingerprint, msg.prefixes, msg.stage_names, msg.blob, _pipeline(msg),
                  msg.source_data, msg.first_tap, tap)


def _branch(state: Tables, job: Job, msg: Register, shared: int) -> tuple[int, list[Out]]:
    """Add ``msg``'s pipeline to ``job`` as a branch sharing ``shared`` stages: its
    index, and the BRANCH that tells each of the job's workers."""
    assert job.branches is not None
    index = job.branches.add(_member(msg, shared))
    if state.journal is not None:
        state.journal.save_pipeline(branch_file(job.id, index), msg.blob)
    state.record(BranchAdded.of(job, index))
    log.info("job %s: a pipeline sharing its first %d stages joins it as branch %d",
             job.id, shared, index)
    out = []
    for task, worker_id in job.tasks.items():
        worker = state.workers.get(worker_id)
        if worker is not None and worker.task == task:
            out.append(placement.branch_message(worker, job, index))
    return index, out


def _place(msg: Register) -> tuple[int, int] | None:
    """A coordinated consumer's (num_consumers, consumer_index), or None.

    Raises:
        ProtocolError: coordinated reads without a ``consumer_index`` below
            ``options.num_consumers``; a ``consumer_index`` without them. (Their
            ``job_name`` is ``JobOptions.check``'s rule.)
    """
    size, index = msg.options.num_consumers, msg.consumer_index
    if not size:
        if index is not None:
            raise ProtocolError("REGISTER: field 'consumer_index' needs "
                                "options.num_consumers >= 1")
        return None
    if index is None or not index < size:
        raise ProtocolError(f"REGISTER: field 'consumer_index' must be an integer from 0 to "
                            f"{size - 1} (options.num_consumers {size}), got {index!r}")
    return size, index


def _join(state: Tables, job: Job, identity: bytes, consumer_id: str, msg: Register,
          now: float) -> None:
    """Record the consumer as ``job``'s (one that moved from another job leaves it)."""
    old = state.consumers.get(consumer_id)
    if old is not None:
        state.peers.pop(old.identity, None)
        left = state.jobs.get(old.job)
        if left is not None and left is not job:  # it moved: no ghost in the old job
            left.consumers.discard(consumer_id)
            if not left.consumers:
                left.idle_since = now
    state.consumers[consumer_id] = Consumer(consumer_id, identity, job.id,
                                            msg.host_id, msg.pid, now, joined=now)
    state.peers[identity] = ("consumer", consumer_id)
    job.consumers.add(consumer_id)
    job.silent.pop(consumer_id, None)
    job.idle_since = None


def resume(state: Tables, job: Job, value: Any) -> None:
    """A resumed Loader's ``{"epoch", "delivered"}`` (``Loader.state_dict()``): the
    epoch's splits hand out only what it had not yielded."""
    if value is None:
        return
    if not (isinstance(value, dict) and isinstance(value.get("epoch"), int)
            and value["epoch"] >= 0):
        raise ProtocolError("REGISTER: resume must be {epoch, delivered}")
    if not job.track:
        raise ProtocolError("REGISTER: resume needs an exactly-once job (dynamic "
                            "sharding, no share, balanced or num_consumers)")
    ledger = Ledger()
    try:
        ledger.merge_json(value.get("delivered"))
    except ValueError as exc:
        raise ProtocolError(f"REGISTER: resume: {exc}") from None
    job.handout.resume = (value["epoch"], ledger)
    job.epoch = max(job.epoch, value["epoch"])
    # (journaled as it came, merged without error: a replay merges it to the same ledger;
    # a state's JSON made again would cost the loop as much as the merge)
    state.record(JobResumed(job=job.id, epoch=value["epoch"], delivered=value["delivered"]))


def _replace(state: Tables, job: Job, holder: str, index: int, msg: Register,
             now: float) -> list[Out]:
    """A restarted consumer takes over ``index`` from ``holder``, which is dropped and,
    should it still be alive, refused from now on."""
    assert job.rounds is not None
    old = state.consumers.get(holder)
    where = f"pid {old.pid}" if old is not None else "an earlier consumer"
    job.rounds.replaced[holder] = (
        f"consumer_index {index} of job_name {job.name!r} was taken over by another "
        f"consumer (pid {msg.pid}), as a restarted consumer does; if this "
        f"one ({where}) is still meant to run, two consumers were given the same "
        "consumer_index")
    return [Out(o.identity, dataclasses.replace(o.message, replaced=True), o.payload)
            if isinstance(o.message, ConsumerGone) else o
            for o in drop_consumer(state, holder, now)]


def _named_job(state: Tables, name: str) -> Job | None:
    return next((j for j in state.jobs.values() if j.name == name), None)


_MUST_AGREE = ("sharding", "deterministic", "on_error", "balanced", "num_consumers",
               "exactly_once")
"""The options every consumer of a named job must give as its first one did."""


def _mismatch(job: Job, fingerprint: str, options: JobOptions) -> str:
    """Why a REGISTER for ``job``'s name cannot join it ("" if it can)."""
    theirs = {"fingerprint": fingerprint,
              **{k: getattr(options, k) for k in _MUST_AGREE}}
    ours = {"fingerprint": job.fingerprint,
            **{k: getattr(job.options, k) for k in _MUST_AGREE}}
    diff = [k for k in ours if ours[k] != theirs[k]]
    if not diff:
        return ""
    return (f"job_name {job.name!r} already runs another pipeline or options "
            f"({', '.join(f'{k}: {ours[k]!r} vs {theirs[k]!r}' for k in diff)}); "
            "use another job_name, or the same pipeline and options")


def _pipeline(msg: Register) -> dict[str, Any] | None:
    """REGISTER's ``pipeline``: None (the pipeline is the payload), ``{inherited: true}``
    (embedded: the Loader's forked workers hold it) or ``{endpoint, sha256, bytes}`` (the
    Loader serves it; docs/protocol.md).

    Raises:
        ProtocolError: neither a payload nor a reference, or a digest that is not one.
    """
    ref = msg.pipeline
    if ref is None:
        if not msg.blob:
            raise ProtocolError("REGISTER: an empty pipeline payload and no 'pipeline' "
                                "field")
        return None
    if ref == INHERITED:
        return dict(INHERITED)
    if len(ref["sha256"]) != 64:
        raise ProtocolError("REGISTER: pipeline.sha256 must be 64 hex digits")
    return {"endpoint": ref["endpoint"], "sha256": ref["sha256"], "bytes": ref["bytes"]}


def _new_job(state: Tables, identity: bytes, msg: Register, name: str | None,
             options: JobOptions, now: float, branches: Branches | None = None) -> Job:
    source = msg.source
    live = sum(1 for w in state.workers.values() if w.task is None)
    width = options.num_workers or max(1, live)
    handout = Handout(source["num_splits"], bool(source.get("shuffle_splits", False)),
                      source.get("seed"), layout_of(source.get("inputs")))
    job = Job(os.urandom(8).hex(), msg.fingerprint, name, options, msg.blob, handout,
              width, msg.source_data, random.SystemRandom().getrandbits(63), now)
    job.pipeline = _pipeline(msg)
    job.branches = branches
    job.owner = identity
    job.metrics.scaler.cooldown = state.cooldown
    entropy = msg.entropy  # a resumed Loader's: its shuffles draw the same
    if entropy is not None and 0 <= entropy < 2**63:
        job.entropy = entropy
    state.jobs[job.id] = job
    if state.journal is not None:
        state.journal.save_pipeline(job.id, job.blob)
    state.record(JobCreated.of(job))
    return job


def task_failed(state: Tables, identity: bytes, msg: TaskFailed, now: float) -> list[Out]:
    """TASK_FAILED: the job's pipeline raised; the job fails, its workers are released."""
    job = state.job_of(msg.task)
    if job is None:
        return []
    error = msg.error
    job.error = {k: str(error.get(k, "")) for k in ("stage", "exc_type", "builtin",
                                                    "message", "traceback", "context")}
    state.record(JobFailed(job=job.id, error=job.error))
    return release(state, job, now) + views.tell_consumers(state, job)


def epoch_started(state: Tables, identity: bytes, msg: Epoch, now: float) -> list[Out]:
    """EPOCH: a consumer starts an epoch; answered with its job's view (for an
    exactly-once job, with the splits of that epoch handed out so far)."""
    consumer = state.consumer_at(identity)
    job = state.jobs.get(consumer.job) if consumer is not None else None
    epoch = msg.epoch
    out: list[Out] = []
    if job is not None and epoch is not None:
        if epoch > job.epoch:
            state.record(EpochStarted(job=job.id, epoch=epoch))
        job.epoch = max(job.epoch, epoch)
        job.metrics.hungry_until = now + 2 * state.heartbeat  # it has nothing yet
        if consumer is not None:
            consumer.active = consumer.heard = True
        if job.rounds is not None and consumer is not None:
            out += coordinated.announce(state, job, {},
                                        job.rounds.epoch_started(consumer.id, epoch))
            job.rounds.prune(job.epoch)
            if splits.pending(job).get(str(epoch)):
                job.rounds.order_rerun(epoch, job.handout.requeues.get(epoch, 0))
    # A job with no worker may take one from another now (broker/pool.py); other moves
    # wait for the next tick (weighing the pool costs O(workers), and every consumer's
    # every epoch would pay it). The answer below is the only JOB this consumer gets
    # now, as for REGISTER.
    starving = job is not None and not job.tasks
    out += [o for o in placement.assign(state, now, rebalance=starving)
            if o.identity != identity or o.command is not Command.JOB]
    answer = peers.consumer_heartbeat(state, identity, now)
    if job is not None and job.track and epoch is not None:
        # what the consumer checks its epoch against
        read = tuple([list(key), pack(handed)] for key, handed
                     in sorted(splits.read_splits(job, epoch).items()))
        answer = [Out(r.identity, dataclasses.replace(r.message, read=read), r.payload)
                  if isinstance(r.message, JobView) else r for r in answer]
    return out + answer


def bye(state: Tables, identity: bytes, now: float,
        left: dict[str, Any] | None = None) -> list[Out]:
    """BYE: a worker or a consumer leaves; a job whose last consumer left ends now. A
    consumer that ``left`` in (or after its part of) an epoch said what it had yielded of it
    (:func:`note_left`)."""
    kind, pid = state.peers.get(identity, ("", ""))
    if kind == "worker":  # (a worker says BYE once it drained)
        return failures.drop_worker(state, pid, died=False, now=now, clean=True)
    if kind == "consumer":
        consumer = state.consumers.get(pid)
        job = state.jobs.get(consumer.job) if consumer is not None else None
        if left is not None and job is not None and job.track:
            try:  # (before it is dropped: a fence waiting for its answer completes then)
                note_left(state, job, left.get("epoch"), left.get("delivered"))
            except ValueError as exc:
                log.warning("consumer %s left job %s saying what it yielded malformed "
                            "(%s): what it yielded may be read again for the others", pid,
                            job.name or job.id, exc)
        out = drop_consumer(state, pid, now)
        if job is not None and not job.consumers \
                and not any(now - t < state.expiry * FENCE_GRACE
                            for t in job.silent.values()):
            # Its last consumer left: nobody comes back to it, so its name and
            # workers are free now (not an expiry later) for the next job.
            out += _end(state, job, now)
            out += placement.assign(state, now)
        return out
    return []


def note_left(state: Tables, job: Job, epoch: Any, delivered: Any,
              record: bool = True) -> None:
    """What a consumer that left ``job`` in (or after its part of) ``epoch`` had yielded
    of it (``Loader.state_dict()``'s ``delivered``): kept with what others that left had, so
    that a dead worker's splits are read again for the consumers that stay less those
    (failures.complete_fences); only the latest two epochs are kept.

    Raises:
        ValueError: ``epoch`` or ``delivered`` is malformed.
    """
    if not (isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0):
        raise ValueError("epoch must be an int >= 0")
    if epoch < job.epoch - 1:
        return  # (an epoch whose splits are no longer re-queued)
    ledger = job.handout.left.get(epoch) or Ledger()
    ledger.merge_json(delivered)
    job.handout.left[epoch] = ledger
    for old in [e for e in job.handout.left if e < max(job.epoch, epoch) - 1]:
        del job.handout.left[old]
    if record:
        state.record(ConsumerLeft(job=job.id, epoch=epoch, delivered=ledger.to_json()))


def drop_consumer(state: Tables, consumer_id: str, now: float,
                  silent: bool = False) -> list[Out]:
    """Forget a consumer. One that went ``silent`` (not one that said BYE) may only be
    stalled: the fences of its job still wait for its answer until their deadline."""
    consumer = state.consumers.pop(consumer_id, None)
    if consumer is None:
        return []
    state.peers.pop(consumer.identity, None)
    job = state.jobs.get(consumer.job)
    if job is None:
        return []
    job.consumers.discard(consumer_id)
    if silent:
        job.silent[consumer_id] = now
    if not job.consumers:
        job.idle_since = now
        # Consumers that went silent may only be stalled (a loaded host): keep the job,
        # its workers and what it handed out, for them to come back to.
        grace = state.expiry * FENCE_GRACE
        job.linger = max((t + grace - now for t in job.silent.values()), default=0.0)
    if not silent:
        for fence in job.fences.values():
            fence.waiting.discard(consumer_id)
    out = failures.complete_fences(state, job)
    if job.rounds is not None:
        out += coordinated.announce(state, job, {}, job.rounds.leave(consumer_id))
    if silent and job.share is not None:
        # A shared job's workers keep a silent trainer's cursors until its grace ends
        # (tick): one that was only stalled (paused, swapping) goes on where it was when it
        # registers again; forgotten, it would join its epoch anew and be sent again what
        # it already had.
        return out
    return out + _tell_gone(state, job, consumer_id)


def _tell_gone(state: Tables, job: Job, consumer_id: str) -> list[Out]:
    """CONSUMER_GONE to each of ``job``'s workers: they drop the consumer's streams."""
    out: list[Out] = []
    for task, worker_id in job.tasks.items():
        worker = state.workers.get(worker_id)
        if worker is not None:
            out.append(Out(worker.identity, ConsumerGone(task=task, consumer=consumer_id)))
    return out


def tick(state: Tables, now: float) -> list[Out]:
    """Every heartbeat: purge peers silent for ``liveness`` heartbeats, give up on fences
    past their deadline, sample starvation, collect abandoned jobs, and place the
    workers."""
    out: list[Out] = []
    for worker in [w for w in state.workers.values() if now - w.last_seen > state.expiry]:
        if _busy(worker, "worker", now):  # (if it stays silent with a consumer's credits,
            continue                      # the consumer reports it stuck: failures.stuck)
        log.info("worker %s (pid %d on %s) silent for %.1f s: dropped", worker.id,
                 worker.pid, worker.host, now - worker.last_seen)
        out += failures.drop_worker(state, worker.id, died=True, now=now)
    for consumer in [c for c in state.consumers.values() if now - c.last_seen > state.expiry]:
        if _busy(consumer, "consumer", now):
            continue
        # (one whose process on this host has exited cannot come back: no grace for it)
        exited = consumer.host_id == host_id() and gone(consumer.pid)
        log.info("consumer %s (pid %d) silent for %.1f s%s: dropped", consumer.id,
                 consumer.pid, now - consumer.last_seen, ", exited" if exited else "")
        out += drop_consumer(state, consumer.id, now, silent=not exited)
    for job in state.jobs.values():
        for fence in job.fences.values():
            if now > fence.deadline and fence.waiting:
                failures.give_up(state, job, fence, now)
        out += failures.complete_fences(state, job)
        for consumer_id in [c for c, t in job.silent.items()
                            if now - t > state.expiry * FENCE_GRACE]:
            del job.silent[consumer_id]
            if job.share is not None:  # (its workers kept its cursors until now)
                out += _tell_gone(state, job, consumer_id)
    unheard(state, now)
    status.sample(state, now)
    for job in list(state.jobs.values()):
        if not job.consumers and job.idle_since is not None \
                and now - job.idle_since > max(state.expiry, job.linger):
            out += _end(state, job, now)
    return out + placement.assign(state, now)


def _busy(peer: Any, kind: str, now: float) -> bool:
    """Whether a silent ``peer`` (a worker or a consumer) is on this host with its process
    running: busy, not dead (user code holding the interpreter's lock stops a worker's
    heartbeats; a batch decoding for seconds, or a finalizer the collector runs there,
    holds a trainer's loop). A stopped one (SIGSTOP) is not."""
    if peer.host_id != host_id() or not running(peer.pid):
        return False
    log.debug("%s %s (pid %d) silent for %.1f s but running: kept", kind, peer.id, peer.pid,
              now - peer.last_seen)
    return True


def unheard(state: Tables, now: float) -> None:
    """Consumers that sent nothing since their REGISTER for UNHEARD_BEATS heartbeats are
    taken for ones that do not read (``active`` False): their jobs give their workers to
    jobs that read (the pool's rule 1, docs/pool.md), and have none of the free ones'
    share. Until then a new consumer is taken at its word, as one about to read. Its
    first HEARTBEAT saying it reads makes it active again (``peers.consumer_heartbeat``)."""
    grace = UNHEARD_BEATS * state.heartbeat
    for consumer in state.consumers.values():
        if consumer.active and not consumer.heard and now - consumer.joined > grace:
            consumer.active = False


def _end(state: Tables, job: Job, now: float) -> list[Out]:
    """Forget ``job``: its workers are released, its name is free."""
    out = release(state, job, now)
    del state.jobs[job.id]
    state.record(JobEnded(job=job.id))
    if state.journal is not None:
        state.journal.forget_pipeline(
            job.id, len(job.branches.members) if job.branches is not None else 0)
    return out


def release(state: Tables, job: Job, now: float) -> list[Out]:
    """Take every task of ``job`` off its workers (RELEASE); they are free."""
    out = []
    for task, worker_id in list(job.tasks.items()):
        worker = state.workers.get(worker_id)
        if worker is not None:
            worker.task = worker.moving_to = None
            worker.current = None
            worker.idle_since = now
            out.append(Out(worker.identity, Release(task=task)))
    job.tasks.clear()
    job.indices.clear()
    return out
