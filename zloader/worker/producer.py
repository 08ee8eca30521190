"""The producer thread of a worker: runs the worker part of one epoch of the task's
pipeline and hands finished records to the worker's socket thread over an inproc pair.

It takes a :class:`ProducerSpec` (frozen, built from the task once). What it sends the
socket thread goes into :attr:`Producer.outbox` as ``(kind, body)``, in order, with one
frame on the pair (the :class:`LinkKind`'s byte) to wake that thread: no message is
serialized between two threads of one process. ``SPLIT_REQ {pass, have}`` asks for the
next split of a pass, having received ``have`` of them so far (the answer comes back the
same way: a :class:`SplitAnswer` in :attr:`Producer.inbox`, with the split as an exactly-once
job reads it, see zloader/lineage/, and a frame on the pair to wake the producer),
``PASS_DONE pass`` says a pass is finished, ``WEIGHED {pass, at, weights}`` that a shared
job's mix takes new weights (the producer waits for the broker's echo, a :class:`Noted` in
the inbox, before it draws with them: zloader/mixing.py ``Switches``),
``RECORD`` is one record (an :class:`Outgoing`: its :class:`Head` and its codec buffers,
the last one its origin block for an exactly-once job), ``END`` (an :class:`EndOut`) ends
the epoch (``origins``: the block of what no record carried), ``FAIL body`` reports an
error. Records take this path only when the producer waits for them anyway (large or
gathered ones) or its task's delivery mode is not credit delivery; otherwise the producer
delivers them itself under the worker's lock (:class:`Hand`).
A record is sent only after taking one permit from the producer's pool, so the records in
flight never exceed what the consumers granted. A record holding a
:class:`~zloader.codec.Gather` references the user's rows, which user code may overwrite
next: the producer waits until the socket thread has copied it out (:attr:`Outgoing.taken`)
before it goes on. So does a large record (``LARGE_RECORD_BYTES``), whatever credits the
consumers granted: the fresh arrays a pipeline makes for each record (a decoded batch) then
come from the few blocks of memory just freed, which the CPU's caches still hold, and are
copied into the ring from there. With a record per credit in flight (eight), each was made
in, and copied from, memory that had left the caches, and a record cost about twice the
CPU (bench.transport section h).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import zmq

from zloader import codec, handoff
from zloader._byfields import FrozenByFields
from zloader._defaults import (
    HAND_WAIT,
    LARGE_RECORD_BYTES,
    MAX_AHEAD,
    PART_RECORD_ELEMENTS,
    RECORD_BYTES,
    RECORD_ELEMENTS,
    RECORD_LINGER,
    SPLIT_AHEAD_SECONDS,
    SPLIT_AHEAD_WORK,
    STAGES,
)
from zloader.errors import CodecError, PipelineError
from zloader.lineage import Assigned
from zloader.mixing import LiveWeights, Switches
from zloader.runs import Context, Coverage, RunSettings
from zloader.sharing.branches import Branch, Tree
from zloader.sharing.handover import Switched
from zloader.transport.protocol import error_object
from zloader.transport.sockets import NOBLOCK, make_socket
from zloader.worker.dispatched import Dispatched
from zloader.worker.outgoing import EndOut, Head, Outgoing, weigh
from zloader.worker.permits import PartPool, Permits, Pool
from zloader.worker.spec import LinkKind, Noted, ProducerSpec, SplitAnswer

__all__ = ["RECORD_BYTES", "RECORD_ELEMENTS", "RECORD_LINGER", "STAGES", "Hand", "LinkKind",
           "Producer", "ProducerSpec", "SplitAnswer"]

T = TypeVar("T")


@dataclass(eq=False, repr=False)
class Hand(FrozenByFields):
    """How a producer delivers its records itself, instead of handing them to the worker's
    main thread over its pair (when its task's delivery mode allows it: credit delivery,
    see ``Delivery.inline``): under ``lock`` (the worker's: the main thread holds it
    whenever it is not waiting in its poll), ``deliver(producer, outgoing)`` does what
    the main thread would do with the record (its task's delivery sends it, or keeps it
    until a consumer has credit). ``busy()`` says whether records wait in the delivery
    (the next element then joins the record being made). A record costs the producer's
    thread one lock instead of a message to the main thread, a wake-up of it and a
    switch of the interpreter's lock between the two (bench/profile.py at 8 workers, base
    and after run alternately: the main threads' CPU per record went from 183 to 61 µs,
    bench/archive/before_after_26). Records the producer waits for
    anyway (``gathered`` or ``large``, see :class:`Outgoing`) still go through the main
    thread: their copy dwarfs the hop, and the main thread reads what the consumers sent
    first (a larger ring for records that outgrew theirs). ``refill(starve)`` (locked too)
    takes the credits given back in the rings' headers, or (``starve``) says there that
    the producer waits: whether any came."""

    lock: threading.Lock
    deliver: Callable[[Producer, Outgoing], None]
    busy: Callable[[], bool]
    refill: Callable[[bool], bool]


class Producer(threading.Thread):
    """Runs the worker part of one epoch and delivers its records (itself, see
    :class:`Hand`, or through the worker's main thread).

    Args:
        context: the worker's ZeroMQ context (the pair is inproc).
        address: where the socket thread's end of the pair is bound.
        spec: the task's :class:`ProducerSpec`.
        epoch: the epoch to produce.
        pool: one permit per record sent.
        draining: set when the worker leaves: dynamic passes end at once.
        epoch_input: what the consumer passed for this epoch (its OPEN's payload), if any.
        splits: the splits read, per pass, for a job that must be able to make its
            elements again (shared jobs: recorded here, in order); None: not recorded.
        switches: with ``splits``, when a mix drawn by weight took new weights, per pass
            (recorded here, the broker told before the draws use them; a replay takes
            them from there).
        replay: make the first ``replay`` elements of the epoch again, reading the splits
            recorded in ``splits`` (a shared job's late trainer); None: produce afresh.
        skip: of those, leave out the first ``skip``, or those at these places
            (``[[start, end], ...]``; made, not sent: what a trainer had of a dead
            worker's, zloader/sharing/handover.py).
        dispatched: the epoch's work items a consumer dispatches (a dispatched source's,
            see ``Source.dispatched``; handed to the pipeline as ``RunSettings.dispatched``).
        timing: where the time goes, by stage (shared by the worker's producers).
        after: producers stopped before this one, which it waits to leave (they exit at
            their next send) before it runs the pipeline: user code of two epochs never
            runs at once in one process.
        permits: a task whose records go by part (``plan.parts``: a mix its consumers
            draw, a deterministic job's shards): the permits per part, which replace
            ``pool`` (:meth:`_produce_parts`).
    """

    def __init__(self, context: zmq.Context[Any], address: str, spec: ProducerSpec,
                 epoch: int, pool: Pool, draining: threading.Event,
                 epoch_input: Any = None,
                 weights: LiveWeights | None = None,
                 dispatched: Dispatched | None = None,
                 splits: dict[tuple[int, ...], list[int]] | None = None,
                 switches: Switched | None = None,
                 replay: int | None = None,
                 skip: int | list[list[int]] = 0,
                 timing: dict[str, float] | None = None,
                 after: tuple[threading.Thread, ...] = (),
                 permits: Permits | None = None) -> None:
        super().__init__(name=f"zloader-producer-{epoch}", daemon=True)
        self.after = after  # stopped producers to wait for before running user code
        self.context, self.address, self.spec, self.epoch = context, address, spec, epoch
        self.stop = threading.Event()
        # Held while a record is sent: whoever stops this producer (a new epoch) takes it
        # after setting ``stop``, so that no record goes out after the stop and no permit
        # (a consumer's credit) the next producer needs is spent by this one.
        self.sending = threading.Lock()
        self.pool: Pool | PartPool = pool
        self.permits = permits  # per mix input, when the consumers draw the mix
        self.draining, self.epoch_input, self.weights = draining, epoch_input, weights
        self._part_weights: tuple[Any, list[float]] | None = None  # (_weights_of's)
        self.dispatched = dispatched
        self.link: Any = None  # the socket thread's end of the pair
        self.outbox: deque[tuple[LinkKind, Any]] = deque()  # one per frame sent, in order
        self.replay, self.skip = replay, skip
        self.splits, self.switches = splits, switches
        # Where the time goes (seconds, cumulative over the worker's producers): running
        # the pipeline, waiting for the broker's splits, encoding records, and blocked
        # for want of credits (the consumers are slower). Counted per record, not element.
        self.timing = timing if timing is not None else dict.fromkeys(STAGES, 0.0)
        self._mark, self._split_wait = 0.0, 0.0  # time accounted up to; split waits since
        # What it does now, for the heartbeat (read by the socket thread without a lock):
        # the stage (one of STAGES) and the split it last started (None before the first).
        self.stage = "pipeline"
        self.split: int | None = None
        self._permit = False  # a permit taken from the pool for the next record
        # The broker's answers about passes read at the same time (a mix's inputs), kept
        # for the pass's reader until it takes them: pass key -> answers, in order.
        self._answers: dict[tuple[int, ...], deque[SplitAnswer]] = {}
        self.inbox: deque[SplitAnswer | Noted] = deque()  # the main thread's, in order
        self.coverage: Coverage | None = None  # a dynamically sharded run's (stages.py)
        self.hand: Hand | None = None  # set by the worker: deliver records on this thread
        # A shared job's branches to add to the epoch's run (:meth:`attach`), and those
        # added (all of their epoch made here) or refused (the trunk's history is gone).
        self.attaching: deque[Branch] = deque()
        self.attached, self.refused = set[int](), set[int]()

    def answer(self, *answers: SplitAnswer | Noted) -> None:
        """Hand this producer the broker's answers (the worker's main thread calls it):
        they go into :attr:`inbox` at once, and a frame on the pair wakes the producer."""
        self.inbox.extend(answers)
        link = self.link
        if link is not None:
            with contextlib.suppress(zmq.Again):
                link.send(b"A", zmq.NOBLOCK)

    def attach(self, branch: Branch) -> None:
        """Add ``branch`` to this epoch's run of a shared job's branches, if it can still
        get all of the epoch (then it is in :attr:`attached` before its first record
        comes; else in :attr:`refused`). Any thread."""
        self.attaching.append(branch)

    def halt(self) -> None:
        """Ask this producer to stop, waking it where it waits for work items or for a
        permit of a part (it looks at ``stop`` at once, not after its wait's timeout)."""
        self.stop.set()
        if self.dispatched is not None:
            self.dispatched.wake()
        if self.permits is not None:
            self.permits.wake()
        self.pool.wake()

    def doing(self) -> dict[str, Any]:
        """``{epoch, split, stage}``: what this producer is doing now (the worker's
        heartbeat carries it, so that a consumer can say where a stuck worker is)."""
        return {"epoch": self.epoch, "split": self.split, "stage": self.stage}

    def run(self) -> None:
        for earlier in self.after:  # stopped, maybe still in user code: let it leave
            earlier.join()
        self.after = ()
        pair = make_socket(self.context, zmq.PAIR)
        pair.connect(self.address)
        try:
            self._produce(pair)
        except _Stopped:
            pass
        except BaseException as exc:  # user code (SystemExit too): reported as a value
            if self.stop.is_set() or isinstance(exc, zmq.ContextTerminated):
                return  # stopped (a new epoch, the worker leaving): nobody reads a report
            with contextlib.suppress(_Stopped, zmq.ContextTerminated):
                self._put(pair, LinkKind.FAIL, {"epoch": self.epoch,
                                                "error": error_object(exc)})
        finally:
            if self._permit:  # taken for a record that was not sent: the credit stays
                self._permit = False
                self.pool.release()
            pair.close(0)

    def _put(self, pair: zmq.Socket[Any], kind: LinkKind, body: Any) -> None:
        """Hand ``body`` to the main thread and wake it; never blocks forever (the main
        thread may have dropped this producer's pair after stopping it)."""
        entry = (kind, body)
        self.outbox.append(entry)
        while True:
            try:
                pair.send(kind.value, NOBLOCK)
                return
            except zmq.Again:
                if self.stop.wait(0.01):
                    if self.outbox and self.outbox[-1] is entry:
                        self.outbox.pop()
                    raise _Stopped from None

    def _produce(self, pair: zmq.Socket[Any]) -> None:
        spec = self.spec
        ctx = Context(RunSettings(
            entropy=spec.entropy, worker=spec.index, workers=spec.width,
            skip_errors=spec.skip_errors, track=spec.track, round_size=spec.round_size,
            epoch_input=self.epoch_input, mix_weights=self.weights,
            mix_switches=None if self.switches is None else Switches(
                self.switches, self.replay is not None,
                functools.partial(self._weighed, pair)),
            dispatched=self._take_dispatched))
        if spec.sharding == "dynamic":  # handed some splits of each pass, not all
            ctx.coverage = self.coverage = Coverage(spec.plan.pipeline.source.splits_in,
                                                    self.draining.is_set)
        if spec.plan.parts and self.permits is not None:
            self._produce_parts(pair, ctx, self.permits)
            return
        if spec.first_tap and self.replay is None:
            self._produce_branches(pair, ctx)
            return
        elements = spec.plan.run_worker(lambda key: self._feed(pair, key), self.epoch, ctx)
        if self.replay is not None:
            elements = _kept(elements, self.skip, self.replay)
        batch: list[Any] = []
        # Untracked elements: the source position each was taken at, to name one the
        # codec rejects (tracked ones carry their origins).
        places: list[Any] = []
        size = 0
        started = last = 0.0
        self._mark = time.perf_counter()
        # One element per record when they are dealt one by one (balanced, coordinated).
        limit = 1 if spec.one_per_record else RECORD_ELEMENTS
        track = ctx.settings.track  # (read once: this loop runs per element)
        for element in elements:
            now = time.monotonic()
            if not batch:
                started = now
            slow = now - last >= RECORD_LINGER / 2
            last = now
            batch.append(element)
            if not track:
                places.append(ctx.at)
            weight, gathered = weigh(element[0] if track else element)  # its value
            size += weight
            full = len(batch) >= limit or size >= RECORD_BYTES or gathered
            # A record is due at once when the elements come slowly, or once the first
            # has lingered; but while the last one is still on its way (in the outbox) or
            # no consumer credit is free, the next elements join it instead, up to a full
            # record: a consumer that falls behind gets fewer, larger records.
            if full or ((slow or now - started >= RECORD_LINGER) and self._ready()):
                self._send(pair, batch, places, ctx, size)
                batch, places, size = [], [], 0
                last = time.monotonic()  # waiting for credits is not production time
            # Sent or batched, it is held there: holding it here too while the pipeline
            # makes the next element would keep one more large array alive (docstring).
            element = None
        if batch:
            self._send(pair, batch, places, ctx, size)
        self._end(pair, ctx)

    def _end(self, pair: zmq.Socket[Any], ctx: Context) -> None:
        """The epoch is over here: its END, with the origins no record carried."""
        self._account(time.perf_counter())
        tally = ctx.tally
        origins = tally.block([]) if ctx.settings.track and (tally.loose or tally.ends) \
            else None  # (what no record carried)
        self._put(pair, LinkKind.END, EndOut(self.epoch, tally.skipped, tally.dropped, origins))

    def _produce_branches(self, pair: zmq.Socket[Any], ctx: Context) -> None:
        """A shared job that takes branches (``spec.first_tap``): branch 0's worker part
        with a tap at each boundary a branch may part at, each branch's own stages over
        its tap (zloader/sharing/branches.py ``Tree``), in records of one branch each,
        sent as :meth:`_produce`'s are (when full, when the first element has lingered,
        or at once while a record would go out at once)."""
        spec = self.spec
        self.attaching.extend(spec.branches)
        made = Tree(spec.plan, spec.first_tap, lambda key: self._feed(pair, key),
                    self.epoch, ctx, spec.history_bytes, self.attaching, self.attached,
                    self.refused)
        held: dict[int, tuple[list[Any], list[Any], int, float]] = {}
        self._mark = time.perf_counter()
        for which, element in made:
            batch, places, size, started = held.pop(which, ([], [], 0, time.monotonic()))
            batch.append(element)
            places.append(ctx.at)
            weight, gathered = weigh(element)
            size += weight
            element = None
            now = time.monotonic()
            if len(batch) >= RECORD_ELEMENTS or size >= RECORD_BYTES or gathered \
                    or now - started >= RECORD_LINGER or self._ready():
                self._send(pair, batch, places, ctx, size, branch=which)
            else:
                held[which] = (batch, places, size, started)
            for other in [k for k, h in held.items() if now - h[3] >= RECORD_LINGER]:
                batch, places, size, _ = held.pop(other)
                self._send(pair, batch, places, ctx, size, branch=other)
        for which, (batch, places, size, _) in held.items():
            self._send(pair, batch, places, ctx, size, branch=which)
        self._end(pair, ctx)

    def _produce_parts(self, pair: zmq.Socket[Any], ctx: Context, permits: Permits) -> None:
        """Streams of their own (``plan.parts``), in records of one stream each
        (``Head.part``): each input of a mix its consumers draw, or each shard of a
        deterministic job this worker runs (:meth:`_shards`). The next record is of a
        stream with a permit free (the consumers' credits for it), chosen among those by
        the mix's weights as last set (shards: alike), so that what is made follows what
        the consumers take (of a repeat after the mix, the earliest pass with one); an
        input of weight 0 is not made (they never draw it). A
        stream that ends here gets an END of its own (``part``), after its records; the
        epoch's END comes once all have."""
        plan = self.spec.plan
        if plan.mix is not None and not plan.shards:
            streams = dict(enumerate(plan.run_inputs(lambda key: self._feed(pair, key),
                                                     self.epoch, ctx)))
            contexts = dict.fromkeys(streams, ctx)
        else:
            contexts, streams = self._shards(ctx)
        live = list(streams)
        width = len(plan.mix.inputs) if plan.mix is not None and plan.passes else 0
        choose = np.random.default_rng()  # (which is made first: no effect on what is)
        self._mark = time.perf_counter()
        while live:
            weights = self._weights_of()
            free = set(permits.free())
            ready = [k for k in live if weights[k] > 0 and k in free]
            if ready and width:  # (a repeat after the mix: its earliest pass first)
                first = min(ready) // width
                ready = [k for k in ready if k // width == first]
            if not ready:
                self.stage = "blocked"
                permits.wait(0.1, self.stop)  # (or new weights: looked at again)
                if self.stop.is_set():
                    raise _Stopped
                continue
            shares = np.array([weights[k] for k in ready], np.float64)
            which = ready[int(choose.choice(len(ready), p=shares / shares.sum()))] \
                if len(ready) > 1 else ready[0]
            if not permits.take(which):
                continue
            self.pool, self._permit = PartPool(permits, which), True
            self.stage = "pipeline"
            if self._record_of(pair, streams[which], which, contexts[which]):
                live.remove(which)
                self._put(pair, LinkKind.END, EndOut(self.epoch, part=which))
        self._end(pair, ctx)

    def _weights_of(self) -> list[float]:
        """The weights the next record's stream is chosen by, one per part: a mix's as
        last set (its own when none were; a deterministic job's, the weight of the input
        of each shard's stream), or alike (a deterministic job's shards)."""
        plan = self.spec.plan
        mix, weights = plan.mix, None
        if mix is not None:
            latest = self.weights.value if self.weights is not None else None
            weights = latest if latest is not None and len(latest) == len(mix.inputs) \
                else mix.weights
        cached = self._part_weights  # (made again only when the weights change)
        if cached is None or cached[0] is not weights:
            by_part = [1.0] * plan.parts if weights is None else \
                [weights[plan.input_of(part)] for part in range(plan.parts)]
            cached = self._part_weights = (weights, by_part)
        return cached[1]

    def _shards(self, ctx: Context) -> tuple[dict[int, Context], dict[int, Iterator[Any]]]:
        """The shards of a deterministic job this worker runs (those of its index modulo
        the job's worker indices), each the worker part over the splits ``shard::shards``
        of each pass, seeded as worker ``shard`` of ``shards`` would be: the same stream
        whichever worker runs it; with a mix the consumer draws, each input's pipeline
        over its splits of the shard (part ``input * shards + shard``). Their runs share
        ``ctx``'s tally (skipped elements)."""
        spec, plan = self.spec, self.spec.plan
        shards = plan.shards
        contexts: dict[int, Context] = {}
        streams: dict[int, Iterator[Any]] = {}
        for shard in range(spec.index, shards, max(1, spec.width)):
            own = Context(dataclasses.replace(ctx.settings, worker=shard, workers=shards),
                          tally=ctx.tally)
            feed = functools.partial(self._shard_splits, shard=shard)
            if plan.mix is None:
                contexts[shard] = own
                streams[shard] = plan.run_worker(feed, self.epoch, own)
                continue
            for which, stream in enumerate(plan.run_inputs(feed, self.epoch, own)):
                contexts[which * shards + shard] = own
                streams[which * shards + shard] = stream
        return contexts, streams

    def _shard_splits(self, key: tuple[int, ...], shard: int) -> Iterator[int]:
        spec = self.spec
        order = spec.plan.pipeline.source.split_order(key, spec.entropy)
        for split in order[shard::spec.plan.shards]:
            if self.stop.is_set():
                raise _Stopped
            self.split = split
            handoff.poll()
            yield split

    def _record_of(self, pair: zmq.Socket[Any], stream: Iterator[Any], part: int,
                   ctx: Context) -> bool:
        """Make and send one record of mix input ``part`` from ``stream`` (its permit
        held), cut as :meth:`_produce` cuts records; whether the stream ended."""
        batch: list[Any] = []
        places: list[Any] = []
        size = 0
        track = ctx.settings.track
        started = last = time.monotonic()
        ended = True
        # One element per record when they are dealt one by one (balanced).
        limit = 1 if self.spec.one_per_record else PART_RECORD_ELEMENTS
        for element in stream:
            now = time.monotonic()
            batch.append(element)
            if not track:
                places.append(ctx.at)
            weight, gathered = weigh(element[0] if track else element)
            size += weight
            element = None  # (held by the record, not here: see _produce)
            if len(batch) >= limit or size >= RECORD_BYTES or gathered \
                    or now - started >= RECORD_LINGER or now - last >= RECORD_LINGER / 2:
                ended = False
                break
            last = now
        if batch:
            self._send(pair, batch, places, ctx, size, part)
        if self._permit:  # not spent (nothing to send, or every element was skipped)
            self._permit = False
            self.pool.release()
        return ended

    def _take_dispatched(self, count: int | None = None) -> Any:
        """The next work item a consumer dispatched (None: it sends no more), or with
        ``count`` a list of the next ``count`` (fewer: it sends no more), waiting for
        them (counted as ``"splits"``, the stage of waiting for work from outside the
        worker, not pipeline time); stops the producer when it is told to stop meanwhile."""
        if self.dispatched is None:
            return None if count is None else []
        self.stage = "splits"
        waited = time.perf_counter()
        item: Any = self.dispatched.take(self.stop) if count is None \
            else self.dispatched.take_many(count, self.stop)
        self._split_wait += time.perf_counter() - waited
        self.stage = "pipeline"
        if self.stop.is_set() and (item is None or (count is not None and len(item) < count)):
            raise _Stopped
        return item

    def _account(self, now: float) -> None:
        """Time since the last mark, less the waits for splits, went to the pipeline."""
        self.timing["pipeline"] += max(0.0, now - self._mark - self._split_wait)
        self._split_wait = 0.0
        self._mark = now

    def _send(self, pair: zmq.Socket[Any], batch: list[Any], places: list[Any],
              ctx: Context, size: int, part: int | None = None, branch: int = 0) -> None:
        """Encode ``batch`` (about ``size`` bytes, as :func:`weigh` finds; of mix input
        ``part``, when the consumers draw the mix; of a shared job's ``branch``) and hand
        its record to the socket thread once a permit allows."""
        clock = time.perf_counter
        entered = clock()
        self._account(entered)
        self.stage = "encode"
        outgoing = self._encode(batch, places, ctx, size >= LARGE_RECORD_BYTES)
        if outgoing is not None:
            outgoing.head.part, outgoing.head.branch = part, branch
        encoded = clock()
        self.timing["encode"] += encoded - entered
        if outgoing is None:  # every element was skipped: their origins go with the next
            self._mark = encoded
            self.stage = "pipeline"
            return
        self.stage = "blocked"
        while not self._permit and not self._take_permit():
            if self.stop.is_set():
                raise _Stopped
        self._permit = False
        try:
            if self.hand is not None and outgoing.taken is None:
                self._hand(outgoing, self.hand)
            else:
                with self.sending:
                    if self.stop.is_set():
                        raise _Stopped
                    self._put(pair, LinkKind.RECORD, outgoing)
        except _Stopped:
            self.pool.release()  # not spent: the credit is the next producer's
            raise
        if outgoing.taken is not None:  # gathered or large: see Outgoing
            while not outgoing.taken.wait(0.1):
                if self.stop.is_set():
                    raise _Stopped
        self._mark = clock()
        self.timing["blocked"] += self._mark - encoded
        self.stage = "pipeline"

    def _take_permit(self) -> bool:
        """A permit for the next record: a free one, one of the credits given back in the
        rings' headers (else the producer says there that it waits), or one that comes
        within 0.1 s (the caller looks at ``stop`` in between)."""
        if self.pool.acquire(blocking=False):
            return True
        hand = self.hand
        if hand is not None and self._held(hand, hand.refill, True) \
                and self.pool.acquire(blocking=False):
            return True
        return self.pool.acquire(timeout=0.1, stop=self.stop)

    def _hand(self, outgoing: Outgoing, hand: Hand) -> None:
        """Deliver ``outgoing`` on this thread, holding the worker's lock (see
        :class:`Hand`), and take the credits given back in the rings' headers meanwhile."""
        def deliver() -> None:
            with self.sending:
                if self.stop.is_set():
                    raise _Stopped
                hand.deliver(self, outgoing)
            hand.refill(hand.busy())  # (records left waiting for credit: say so)

        self._held(hand, deliver)

    def _held(self, hand: Hand, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)`` holding the worker's lock, waited for in short steps (a worker
        stopping this producer while holding it, for a new epoch, is not kept waiting)."""
        while not hand.lock.acquire(timeout=HAND_WAIT):
            if self.stop.is_set():
                raise _Stopped
        try:
            return call(*args)
        finally:
            hand.lock.release()

    def _ready(self) -> bool:
        """Whether a record sent now would go out at once: the worker's loop has taken
        everything handed to it, and a permit is free (then held for the record)."""
        hand = self.hand
        if self.outbox or (hand is not None and hand.busy()):
            return False
        if not self._permit:
            self._permit = self.pool.acquire(blocking=False) or (
                hand is not None and self._held(hand, hand.refill, False)
                and self.pool.acquire(blocking=False))
        return self._permit

    def _encode(self, batch: list[Any], places: list[Any], ctx: Context,
                large: bool) -> Outgoing | None:
        """The record of ``batch`` (``large``: see :class:`Outgoing`); None when every
        element was skipped because the codec rejects it (see :meth:`_encodable`)."""
        objects = self.spec.options.objects  # unknown leaves pickled (zloader/options.py)
        try:
            buffers = codec.encode(ctx.values_of(batch), objects)
        except CodecError:
            batch = self._encodable(batch, places, ctx)
            if not batch:
                return None
            buffers = codec.encode(ctx.values_of(batch), objects)
        head = Head(self.epoch, len(batch), ctx.tally.skipped, ctx.settings.track)
        gathered = any(isinstance(b, codec.Gather) for b in buffers)
        if ctx.settings.track:
            buffers.append(ctx.tally.block([t[1] for t in batch]))
        return Outgoing(head, buffers, gathered, large)

    def _encodable(self, batch: list[Any], places: list[Any], ctx: Context) -> list[Any]:
        """The elements of ``batch`` the codec accepts. A rejected one is skipped and
        counted (``on_error="skip"``) or raised as the PipelineError of the stage that made
        it, naming where in the input it came from (not its place in the record)."""
        stages = self.spec.plan.worker_stages
        stage = stages[-1].name if stages else self.spec.plan.pipeline.source.name
        kept = []
        for at, element in enumerate(batch):
            try:
                codec.encode(ctx.value(element), self.spec.options.objects)
            except CodecError as exc:
                if not ctx.settings.skip_errors:
                    where = ctx.where(element, len(stages) + 1,
                                      None if ctx.settings.track else places[at])
                    raise PipelineError.from_exception(exc, stage, where) from None
                ctx.tally.skipped += 1
                ctx.drop(element)
                continue
            kept.append(element)
        return kept

    def _feed(self, pair: zmq.Socket[Any], key: tuple[int, ...]) -> Iterator[Any]:
        if self.splits is None:
            yield from self._splits(pair, key)
            return
        if self.replay is not None:
            yield from list(self.splits.get(key, ()))
            return
        read = self.splits.setdefault(key, [])  # in order: a replay reads them again
        for split in self._splits(pair, key):
            read.append(split)
            yield split

    def _splits(self, pair: zmq.Socket[Any], key: tuple[int, ...]) -> Iterator[Any]:
        spec = self.spec
        if spec.sharding != "dynamic":
            order = spec.plan.pipeline.source.split_order(key, spec.entropy)
            mine = order if spec.sharding == "off" else order[spec.index::spec.width]
            for split in mine:
                if self.stop.is_set():
                    raise _Stopped
                self.split = split
                handoff.poll()
                yield split
            return
        self._answers.setdefault(key, deque())  # (passes read at once: a mix's inputs)
        try:
            yield from self._dealt(pair, key)
        finally:
            self._answers.pop(key, None)

    def _dealt(self, pair: zmq.Socket[Any], key: tuple[int, ...]) -> Iterator[Any]:
        """The splits the broker deals this worker in pass ``key`` (dynamic sharding).

        After a quick split (under SPLIT_AHEAD_SECONDS) the next is asked for as soon as
        the last one asked for arrives, while that one is read, so that short splits do
        not each wait for a round trip through the broker (which takes a request with
        ``have`` splits received as "reading the last of them"); after a very quick one
        (under SPLIT_AHEAD_WORK) as many more as it reads in that time. After a slow
        one none is asked ahead: the split asked for would wait behind it while other
        workers might read it."""
        spec = self.spec
        have = 0  # splits received in this pass: the broker re-sends one whose answer was lost
        due = 0  # answers still to come to the last request
        took: float | None = None  # how long the last split took to read
        while True:
            # The worker is leaving, or the run ended the pass early: the pass ends here.
            ending = self.draining.is_set() or (
                self.coverage is not None and self.coverage.ended(key))
            if not due:
                if ending:
                    self._put(pair, LinkKind.PASS_DONE, list(key))
                    return
                due = self._ask(pair, key, have, took)
            reply = self._answer(pair, key, have)
            if reply is None:
                due = 0  # an answer meant for a producer that was stopped: ask again
                continue
            due -= 1
            if reply.split is None:
                self._put(pair, LinkKind.PASS_DONE, list(key))
                return
            have += 1
            # (a leaving worker asks for no more; the split it has is read: it was handed)
            if not due and took is not None and took < SPLIT_AHEAD_SECONDS and not ending:
                due = self._ask(pair, key, have, took)
            self.split = reply.split
            handoff.poll()  # (the dataset's lists, packed since the last split)
            started = time.monotonic()
            if not spec.track:
                yield reply.split
            else:
                yield reply.assigned or Assigned(reply.split, key)
            took = time.monotonic() - started

    def _ask(self, pair: zmq.Socket[Any], key: tuple[int, ...], have: int,
             took: float | None) -> int:
        """Ask for the next split of pass ``key`` (``have`` received), and for as many
        after it as would be read in SPLIT_AHEAD_WORK at the pace of the last (``took``
        seconds), at most MAX_AHEAD; the number of answers that will come."""
        ahead = min(MAX_AHEAD, int(SPLIT_AHEAD_WORK / max(took, 1e-6))) - 1 \
            if took is not None else 0
        ahead = max(0, ahead)
        most = self.spec.plan.ahead_at_most(key)  # (a mix drawn here: zloader/plan.py)
        if most is not None:
            ahead = min(ahead, most)
        self._put(pair, LinkKind.SPLIT_REQ, {"pass": list(key), "have": have, "ahead": ahead})
        return 1 + ahead

    def _weighed(self, pair: zmq.Socket[Any], key: tuple[int, ...], at: int,
                 weights: tuple[float, ...]) -> None:
        """Tell the broker that pass ``key`` of the mix draws with ``weights`` from its
        draw ``at`` on, and wait until it has noted it (its echo): a worker that dies
        after sending an element drawn with them is made again with them."""
        self._put(pair, LinkKind.WEIGHED, {"pass": list(key), "at": at,
                                           "weights": list(weights)})
        noted = Noted(key, at)
        while (reply := self._next_answer(pair)) != noted:
            if not isinstance(reply, Noted) and reply.pass_key in self._answers:
                self._answers[reply.pass_key].append(reply)  # (for a pass read here)

    def _next_answer(self, pair: zmq.Socket[Any]) -> SplitAnswer | Noted:
        """The main thread's next answer, waiting for one.

        Raises:
            _Stopped: the producer is asked to stop meanwhile.
        """
        while not self.inbox:
            if pair.poll(100):
                pair.recv()  # (a wake-up: the answer is in the inbox)
            if self.stop.is_set():
                raise _Stopped
        return self.inbox.popleft()

    def _answer(self, pair: zmq.Socket[Any], key: tuple[int, ...],
                have: int) -> SplitAnswer | None:
        """The broker's answer to this producer's request (``have`` splits received):
        repeated answers to an earlier request (the worker asked again after reconnecting)
        are passed over; an answer about another pass being read is kept for its reader;
        None for an answer about a pass nobody reads (a stopped producer's)."""
        kept = self._answers.get(key)
        while True:
            if self.stop.is_set():  # (an answer that came ahead must not keep it going)
                raise _Stopped
            if kept:
                reply = kept.popleft()
                if reply.have in (None, have):
                    return reply
                continue
            asked = time.perf_counter()
            self.stage = "splits"
            got = self._next_answer(pair)
            self.stage = "pipeline"
            waited = time.perf_counter() - asked
            self._split_wait += waited
            self.timing["splits"] += waited
            if isinstance(got, Noted):  # (an echo of a WEIGHED that was sent again)
                continue
            reply = got
            if reply.pass_key != key:
                if reply.pass_key not in self._answers:
                    return None
                self._answers[reply.pass_key].append(reply)
                continue
            if reply.have in (None, have):
                return reply


def _kept(elements: Iterator[Any], skip: int | list[list[int]], limit: int
          ) -> Iterator[Any]:
    """A replay's elements: those before place ``limit`` but for ``skip`` (the first that
    many, or those at these places: ``[[start, end], ...]``, ascending)."""
    if isinstance(skip, int):
        yield from itertools.islice(elements, skip, limit)
        return
    ranges = iter(skip)
    start, end = next(ranges, (limit, limit))
    for place, element in enumerate(itertools.islice(elements, limit)):
        while place >= end:
            start, end = next(ranges, (limit, limit))
        if place < start:
            yield element


class _Stopped(Exception):
    """The producer was asked to stop."""
