"""Splits: each pass of a job's input hands its splits out one at a time (SPLIT_REQ ->
SPLIT), takes back those a leaving worker had not delivered (re-queued, ahead of new ones),
and, for an exactly-once job, remembers which were read and what to skip when one is read
again.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from zloader.broker.events import MixWeighed, PassRead, SplitHanded, SplitRequeued
from zloader.broker.records import Job, Out, Pass, PassKey, Tables, Worker
from zloader.lineage import pack
from zloader.mixing import input_of
from zloader.sources import split_order
from zloader.transport.messages import PassDone, Release, Split, SplitReq, Weighed

__all__ = ["dispenser", "epochs_of", "held_by", "holds", "mark_read", "origin_at",
           "pass_done", "pending", "read_splits", "readers", "requeue", "skip", "split_range",
           "split_request", "starting", "take"]


def split_request(state: Tables, identity: bytes, msg: SplitReq, now: float) -> list[Out]:
    """SPLIT_REQ: the next split of a pass for a worker's task (null: none left), and the
    ``ahead`` after it (``have``: the place of each among the splits this worker was
    handed in the pass), up to the first null: a SPLIT for the first, carrying in
    ``then`` those after it that are read whole, a SPLIT of its own for any other; a
    split re-queued in this epoch comes first, whichever pass it was taken in. Splits
    already handed at those places (their answers were lost: a broker restart, a
    reconnect) are sent again."""
    worker = state.worker_at(identity)
    task, key = msg.task, msg.pass_
    job = state.job_of(task)
    if worker is None or job is None or worker.task != task:
        return [Out(identity, Release(task=task))]
    handing = dispenser(state, job, key)
    have = msg.have
    handed = handing.handed.get(worker.id, [])
    if have and have <= len(handed):
        # A worker asks for its next split while it reads the last one it got: that is
        # the split it is reading (a death now is that split's, see failures.leave).
        worker.current = (key, handed[have - 1])
    answers: list[Split] = []
    for at in range(1 + msg.ahead if have is not None else 1):
        place = have + at if have is not None else None
        handed = handing.handed.get(worker.id, [])
        if place is not None and place < len(handed):
            # Its answer was lost (a broker restart or a reconnect): the same split again.
            origin = origin_at(handing, key, worker.id,
                               len(handing.read.get(worker.id, ())) + place)
            answers.append(_answer(job, task, key, handed[place], origin, place))
            continue
        split, origin = _hand(state, job, worker, key, handing, first=not have and at == 0)
        answers.append(_answer(job, task, key, split, origin, place))
        if split is None:
            break
    return [Out(identity, answer) for answer in _folded(answers)]


def _folded(answers: list[Split]) -> list[Split]:
    """``answers`` (at consecutive places) in as few SPLITs as they go: each one that
    hands a split of the pass to be read whole goes into the ``then`` of the one before."""
    out: list[tuple[Split, list[int]]] = []
    for answer in answers:
        if out and out[-1][0].split is not None and answer.split is not None \
                and answer.origin in (None, answer.pass_) and not answer.skip \
                and answer.expect is None and not answer.groups:
            out[-1][1].append(answer.split)
        else:
            out.append((answer, []))
    return [dataclasses.replace(first, then=tuple(then)) if then else first
            for first, then in out]


def _hand(state: Tables, job: Job, worker: Worker, key: PassKey, handing: Pass,
          first: bool) -> tuple[int | None, PassKey]:
    """The next split of pass ``key`` for ``worker`` (``first``: its first of the pass,
    read at once), handed and journaled, with the pass it belongs to; None when the pass
    has none left for it."""
    split: int | None = None
    origin = key
    # Re-queued splits of this epoch come first, whichever pass they were taken in: the
    # live workers may have moved past that pass (an endless repeat) and never ask
    # for it again. A split reads the same in any pass of its epoch that reads the same
    # input: a mix's passes of another input run that input's stages, not this split's.
    which = input_of(key)
    for waiting_key, waiting in [(key, handing), *((k, p) for k, p in job.handout.passes.items()
                                                   if k[0] == key[0] and k != key
                                                   and input_of(k) == which)]:
        if waiting.requeued:
            split, origin = waiting.requeued.popleft(), waiting_key
            break
    if split is None and handing.order:
        split = handing.order.popleft()
    if split is not None:
        handing.over.discard(worker.id)
        _note(handing, worker.id, split, origin if origin != key else None)
        if first:  # its first of the pass: read at once
            worker.current = (key, split)
        state.record(SplitHanded.checked({"job": job.id, "pass_": key, "split": split,
                                          "worker": worker.id,
                                          "origin": origin if origin != key else None}))
    else:
        handing.over.add(worker.id)  # its pass ends: it asks for no other split
        if first:
            worker.current = None
    return split, origin


def _note(handing: Pass, worker_id: str, split: int, origin: PassKey | None) -> None:
    """``split`` handed to ``worker_id`` in ``handing``; ``origin``: the other pass it
    belongs to (a re-queued split)."""
    held = handing.handed.setdefault(worker_id, [])
    if origin is not None:
        place = len(handing.read.get(worker_id, ())) + len(held)
        handing.origins.setdefault(worker_id, {})[place] = origin
    held.append(split)


def origin_at(handing: Pass, key: PassKey, worker_id: str, place: int) -> PassKey:
    """The pass the split handed to ``worker_id`` at ``place`` of pass ``key`` belongs to
    (places count its read splits, then those being read)."""
    return handing.origins.get(worker_id, {}).get(place, key)


def held_by(handing: Pass, key: PassKey, worker_id: str) -> list[tuple[int, PassKey]]:
    """The splits ``worker_id`` was handed in pass ``key`` (read, then being read), each
    with the pass it belongs to."""
    origins = handing.origins.get(worker_id, {})
    return [(split, origins.get(place, key)) for place, split
            in enumerate([*handing.read.get(worker_id, ()), *handing.handed.get(worker_id, ())])]


def _answer(job: Job, task: str, key: PassKey, split: int | None, origin: PassKey,
            have: int | None) -> Split:
    """The SPLIT that hands ``split`` (None: none left) of pass ``key`` to ``task``; for
    an exactly-once job with the pass the split belongs to (``origin``) and what to skip
    in it."""
    # (one per split handed, hundreds per request: made as known good, Body.checked)
    if not job.track or split is None:
        return Split.checked({"task": task, "pass_": key, "split": split, "have": have})
    handing = job.handout.passes.get(origin)
    info = handing.skips.get(split, {}) if handing is not None else {}
    expect = info.get("expect")
    return Split.checked({"task": task, "pass_": key, "split": split, "have": have,
                          "origin": origin, "skip": info.get("skip", ""),
                          "expect": tuple(expect) if expect is not None else None,
                          "groups": info.get("groups")})


def dispenser(state: Tables, job: Job, key: PassKey) -> Pass:
    """Pass ``key`` of ``job``, started (its splits in order, :func:`starting`) on first
    use."""
    handing = job.handout.passes.get(key)
    if handing is None:
        handing = job.handout.passes[key] = starting(job, key)
        _prune(job, key[0])
    return handing


def starting(job: Job, key: PassKey) -> Pass:
    """Pass ``key`` of ``job`` as it starts, not kept: its splits in order; a resumed
    Loader's epoch leaves out what it had yielded."""
    handout = job.handout
    order = (handout.layout.order(key, job.entropy) if handout.layout is not None
             else split_order(handout.num_splits, handout.shuffle_splits, handout.seed,
                              job.entropy, key))
    skips: dict[int, dict[str, Any]] = {}
    if handout.resume is not None and handout.resume[0] == key[0]:
        ledger = handout.resume[1]  # what a resumed Loader had yielded: not again
        done = ledger.done.get(key, set())
        order = [split for split in order if split not in done]
        skips = {split: skip(ledger.info(key, split)) for k, split in ledger.open if k == key}
    return Pass(deque(order), skips=skips)


def split_range(job: Job, key: PassKey) -> range:
    """The splits pass ``key`` of ``job`` reads: its source's, or for a mix the splits
    of the input the pass reads (numbered across inputs)."""
    layout = job.handout.layout
    if layout is None:
        return range(job.handout.num_splits)
    which = input_of(key)
    if which is None or which >= len(layout.inputs):
        return range(0)
    return range(layout.offsets[which], layout.offsets[which + 1])


def holds(job: Job, key: PassKey, split: int) -> bool:
    """Whether a worker holds ``split`` of pass ``key`` (handed in that pass or, re-queued,
    in another of its epoch; being read, or read and remembered)."""
    return any((split, key) in held_by(handing, k, worker_id)
               for k, handing in job.handout.passes.items() if k[0] == key[0]
               for worker_id in {*handing.handed, *handing.read})


def _prune(job: Job, epoch: int) -> None:
    """Forget the passes of epochs before the one before ``epoch``."""
    for key in [k for k in job.handout.passes if k[0] < epoch - 1]:
        del job.handout.passes[key]
    for old in [e for e in job.handout.requeues if e < epoch - 1]:
        del job.handout.requeues[old]
    for switched in job.handout.switches.values():
        for key in [k for k in switched if k[0] < epoch - 1]:
            del switched[key]


def weighed(state: Tables, identity: bytes, msg: Weighed, now: float) -> list[Out]:
    """WEIGHED: a shared job's worker's mix draws a pass with new weights from a draw on.
    Noted (should the worker die, its elements are made again with them:
    failures.leave), journaled and echoed: the worker draws nothing with them before."""
    worker = state.worker_at(identity)
    job = state.job_of(msg.task)
    if worker is None or job is None or job.tasks.get(msg.task) != worker.id:
        return []  # (a task that is over; a worker not registered asks again once it is)
    layout = job.handout.layout
    if job.share is not None and layout is not None \
            and len(msg.weights) == len(layout.inputs) \
            and note(job, worker.id, msg.pass_, msg.at, msg.weights):
        state.record(MixWeighed(job=job.id, worker=worker.id, pass_=msg.pass_, at=msg.at,
                                weights=msg.weights))
    return [Out(identity, msg)]


def note(job: Job, worker_id: str, key: PassKey, at: int,
         weights: tuple[float, ...] | list[float]) -> bool:
    """Note that ``worker_id``'s pass ``key`` draws with ``weights`` from draw ``at`` on;
    False if it was noted already (a WEIGHED sent again after a reconnect)."""
    switched = job.handout.switches.setdefault(worker_id, {}).setdefault(key, [])
    if switched and switched[-1][0] >= at:  # (each comes after the last)
        return False
    switched.append((at, tuple(weights)))
    return True


def pass_done(state: Tables, identity: bytes, msg: PassDone, now: float) -> list[Out]:
    """PASS_DONE: a worker read every split it was handed in a pass."""
    worker = state.worker_at(identity)
    key = msg.pass_
    job = state.job_of(msg.task)
    if worker is None or job is None or key not in job.handout.passes:
        return []
    mark_read(job, key, worker.id)
    if worker.current and worker.current[0] == key:
        worker.current = None
    state.record(PassRead(job=job.id, pass_=key, worker=worker.id))
    return []


def mark_read(job: Job, key: PassKey, worker_id: str) -> None:
    """The splits ``worker_id`` was handed in pass ``key`` are read."""
    handing = job.handout.passes[key]
    handed = handing.handed.pop(worker_id, [])
    # Read, but its elements may wait in the worker: in its buffers and in records its
    # consumers have not given credit for yet (a paused training loop), or in its window (a
    # shared job: not yet sent to a trainer that lags behind the faster one). A forced leave
    # (a move at once, a death) reads them again (failures.leave), a clean one does not.
    # Not a coordinated job's: its rounds not yet committed are lost (docs/coordinated.md).
    if job.rounds is None:
        handing.read.setdefault(worker_id, []).extend(handed)
    elif worker_id in handing.origins:  # (the places those splits had are gone)
        kept = len(handing.read.get(worker_id, ()))
        handing.origins[worker_id] = {place: origin for place, origin
                                      in handing.origins[worker_id].items() if place < kept}


def requeue(state: Tables, job: Job, key: PassKey, split: int, skip: dict[str, Any]) -> None:
    """Hand ``split`` of pass ``key`` out again (to skip ``skip``), ahead of new ones."""
    state.record(SplitRequeued(job=job.id, pass_=key, split=split, skip=skip))
    handing = dispenser(state, job, key)
    handing.requeued.append(split)
    if skip:
        handing.skips[split] = skip
    job.handout.requeues[key[0]] = job.handout.requeues.get(key[0], 0) + 1


def take(state: Tables, job: Job, worker_id: str, key: PassKey, split: int,
         origin: PassKey | None = None) -> None:
    """Replay one split handed to a worker: taken from the splits re-queued in pass
    ``origin`` (one of the same epoch), or else from pass ``key``'s re-queued or its
    order."""
    handing = dispenser(state, job, key)
    source = job.handout.passes.get(origin) if origin is not None else None
    borrowed = None
    if source is not None and split in source.requeued:
        source.requeued.remove(split)
        borrowed = origin
    elif split in handing.requeued:
        handing.requeued.remove(split)
    elif split in handing.order:
        handing.order.remove(split)
    _note(handing, worker_id, split, borrowed)
    worker = state.workers.get(worker_id)
    if worker is not None:
        worker.current = (key, split)


def epochs_of(job: Job, worker_id: str) -> set[int]:
    """The epochs in which ``worker_id`` was handed splits (being read, or read and
    remembered: an exactly-once or shared job's)."""
    return {key[0] for key, handing in job.handout.passes.items()
            if worker_id in handing.handed or worker_id in handing.read}


def readers(job: Job, epoch: int) -> set[str]:
    """The workers that will ask for another split of ``epoch``: handed one in a pass of it
    and not told yet that none is left. A split re-queued now is read by one of them; with
    none, it waits for a worker that starts the epoch later."""
    return {worker_id for key, handing in job.handout.passes.items() if key[0] == epoch
            for worker_id in handing.handed if worker_id not in handing.over}


def read_splits(job: Job, epoch: int) -> dict[PassKey, set[int]]:
    """Pass -> the splits of ``epoch`` handed out to live workers (being read or read),
    by the pass they belong to (a re-queued split may be read in a later pass)."""
    read: dict[PassKey, set[int]] = {}
    for key, handing in job.handout.passes.items():
        if key[0] != epoch:
            continue
        for worker_id in {*handing.handed, *handing.read}:
            for split, origin in held_by(handing, key, worker_id):
                read.setdefault(origin, set()).add(split)
    return read


def pending(job: Job) -> dict[str, int]:
    """Epoch -> splits waiting to be read again (taken by a worker that died)."""
    waiting: dict[str, int] = {}
    for key, handing in job.handout.passes.items():
        count = len(handing.requeued)
        if count:
            waiting[str(key[0])] = waiting.get(str(key[0]), 0) + count
    return waiting


def skip(info: dict[str, Any]) -> dict[str, Any]:
    """What a worker skips in a split read again, from a consumer's ``Ledger.info``."""
    have = info.get("have", "")
    out: dict[str, Any] = {"skip": have if isinstance(have, str) else pack(have)}
    if info.get("expect") is not None:
        out["expect"] = info["expect"]
    # Groups whose rows are to be made again (zloader/groups.py); one of which only rows
    # are known (every consumer that knew its elements is gone) cannot be.
    groups = [group for group in info.get("groups") or () if group[4] >= 0]
    if groups:
        out["groups"] = groups
    return out
