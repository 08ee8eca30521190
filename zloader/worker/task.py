"""The task a worker runs: the record of one job's run on this worker, and its life cycle.

A TASK from the broker is checked into an :class:`Assignment`; once its pipeline has loaded
the worker makes a :class:`Task` of it. The task holds its consumers' streams and its
epochs: which one its producer makes, which are finished, which are reruns. It starts a
producer for the oldest epoch a consumer reads, stops producing an epoch nobody reads any
more, and ends or fails epochs. How records reach the consumers is its
:class:`~zloader.worker.delivery.Delivery`'s business, one class per mode.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zloader import codec
from zloader._byfields import FrozenByFields
from zloader._defaults import KEPT_EPOCHS, PREFIX_HISTORY_BYTES
from zloader._native import fence
from zloader.lineage import Assigned
from zloader.mixing import LiveWeights
from zloader.options import JobOptions
from zloader.plan import Plan
from zloader.sharing.branches import Branch
from zloader.sharing.window import WindowSettings
from zloader.transport import messages
from zloader.transport.protocol import ProtocolError, error_object
from zloader.transport.ring import COUNT_MASK, credits_since, credits_word
from zloader.worker.broker_link import BrokerLink, assignment
from zloader.worker.delivery import Delivery, TaskPort
from zloader.worker.dispatched import Dispatched
from zloader.worker.links import Links
from zloader.worker.permits import Pool
from zloader.worker.producer import LinkKind, Producer, ProducerSpec, SplitAnswer
from zloader.worker.spec import Noted
from zloader.worker.streams import Outlet, Stream, unlink_handoffs

__all__ = ["Assignment", "Task", "keep_latest", "load_error"]


def keep_latest(by_epoch: dict[int, Any]) -> None:
    """Drop all but the :data:`KEPT_EPOCHS` latest epochs' entries of ``by_epoch``: what
    consumers send for epochs, in any order (a hostile one counting down included),
    stays bounded."""
    for old in sorted(by_epoch)[:-KEPT_EPOCHS]:
        del by_epoch[old]


@dataclass(eq=False, repr=False)
class Assignment(FrozenByFields):
    """A TASK, checked: the job this worker is to run (``options``: how, the job's
    :class:`~zloader.options.JobOptions`) and this worker's place in it."""

    id: str
    job: str
    options: JobOptions  # exactly_once: as the job runs it
    index: int  # this worker's index in the job
    width: int  # the job's number of worker indices
    entropy: int
    share: WindowSettings | None = None  # a shared job's window (zloader/sharing)
    first_tap: int = 0  # a shared job that takes branches: where one may part (0: none)

    @classmethod
    def decode(cls, task: messages.Task) -> Assignment:
        """The assignment a TASK carries (its record checked every field)."""
        share = task.options.share
        return cls(id=task.task, job=task.job, options=task.options, index=task.index,
                   width=task.width, entropy=task.entropy,
                   share=WindowSettings.from_body(share) if share is not None else None,
                   first_tap=task.first_tap if share is not None else 0)

    @property
    def sharding(self) -> str:
        return self.options.sharding

    @property
    def balanced(self) -> int:
        """Consumers to deal to one element at a time, round-robin (0: off)."""
        return self.options.balanced

    @property
    def coordinated(self) -> int:
        """The consumers of a round, in a coordinated job (0: off)."""
        return self.options.num_consumers

    def spec(self, plan: Plan) -> ProducerSpec:
        """What its producers need to know."""
        history = PREFIX_HISTORY_BYTES if self.share is None \
            else min(PREFIX_HISTORY_BYTES, self.share.window_bytes)
        return ProducerSpec(plan=plan, options=self.options, index=self.index,
                            width=self.width, entropy=self.entropy,
                            first_tap=0 if plan.parts else min(self.first_tap,
                                                                len(plan.worker_stages)),
                            history_bytes=history)


class Task:
    """One job's run on this worker (see the module's docstring).

    Args:
        assignment: the checked TASK.
        plan: its pipeline, loaded.
        outlet: sends to consumers.
        links: starts producer threads.
        broker: the worker's connection to the broker.
        delivery: makes the delivery mode, given the task as its port (the worker picks
            the mode, ``process.delivery_for``).
    """

    def __init__(self, assignment: Assignment, plan: Plan, outlet: Outlet, links: Links,
                 broker: BrokerLink, delivery: Callable[[TaskPort], Delivery]) -> None:
        self.assignment = assignment
        self.id = assignment.id
        self.job = assignment.job
        self.spec = assignment.spec(plan)
        self.outlet = outlet
        self.links = links
        self.broker = broker
        self.streams: dict[bytes, Stream] = {}
        self.producer: Producer | None = None
        self.producing: int | None = None  # the epoch its producer makes
        self.finished: set[int] = set()
        self.reruns: dict[int, int] = {}  # epoch -> latest rerun asked
        self.inputs: dict[int, Any] = {}  # epoch -> the consumer's input
        self.weights = LiveWeights()  # a mix's, as a consumer last set them (every producer)
        self.dispatched: dict[int, Dispatched] = {}  # epoch -> its work items (DISPATCH)
        self.draining = threading.Event()  # take no more splits
        self.moving = False  # drained to move (RELEASE.drain): say so once all is sent
        # A shared job's branches by index (0: its own pipeline), each with the stages it
        # shares with it, when trainers with other pipelines share a prefix of it
        # (BRANCH): each epoch's producer runs those known and read when it starts
        # (zloader/sharing/branches.py).
        self.branches: dict[int, Branch] = {0: Branch(0, plan, len(plan.worker_stages))}
        self.waiting_branches = 0  # BRANCHes whose pipelines load: no new epoch meanwhile
        self.delivery = delivery(self)

    # --- consumers ------------------------------------------------------------------------

    def open(self, identity: bytes, opened: messages.Open, payload: list[Any]) -> None:
        """OPEN: a consumer starts (or re-opens) an epoch (``payload``: its input).

        Raises:
            ProtocolError: the OPEN is malformed.
        """
        epoch = opened.epoch
        if opened.weights is not None:
            self.weights.offer(opened.weights, opened.weights_stamp)
        if payload and epoch not in self.inputs:
            self.inputs[epoch] = codec.decode([f.buffer for f in payload])
            keep_latest(self.inputs)
        stream = self.streams.get(identity)
        if stream is None:
            stream = Stream(identity, opened.consumer, epoch)
            self.streams[identity] = stream
            if opened.ring is not None:
                stream.attach(opened.ring, opened.ring_id, opened.notify)
        self.delivery.open(stream, opened)

    def dispatch(self, identity: bytes, record: messages.Dispatch) -> None:
        """DISPATCH: work items of an epoch, for its producer to take (see
        :class:`~zloader.worker.dispatched.Dispatched`), and the credits that came with
        them, as a CREDIT gives them.

        Raises:
            ProtocolError: too many would wait.
        """
        self.dispatched_for(record.epoch).put(record.items)
        if record.credits:
            self.credit(identity, messages.Credit.checked(
                {"epoch": record.epoch, "credits": record.credits, "mapped": (),
                 "part": None}))

    def dispatched_for(self, epoch: int) -> Dispatched:
        """``epoch``'s work items (made on first use; only the two latest epochs' are
        kept)."""
        found = self.dispatched.get(epoch)
        if found is None:
            found = self.dispatched[epoch] = Dispatched()
            keep_latest(self.dispatched)
        return found

    def open_epoch(self, stream: Stream, opened: messages.Open) -> None:
        """Put ``stream`` on ``epoch`` with the OPEN's credits (the credit-fed modes):
        an epoch finished here ends at once, unless the OPEN asks for a rerun of it (a
        dead worker's splits wait to be read) or sends its work items again."""
        epoch, rerun = opened.epoch, opened.rerun
        self.delivery.withdraw(stream)
        stream.epoch = epoch
        stream.window = opened.window
        stream.flight.clear()  # (granted afresh)
        stream.flight_bytes = 0
        if opened.redispatched and self.spec.plan.pipeline.source.dispatched:
            self._redispatched(epoch)
        self.abandon_stale()
        self.delivery.credit(stream, opened.credits)
        self._count_from(stream, opened.counter if self.delivery.counts else None)
        if rerun > self.reruns.get(epoch, 0):
            self.reruns[epoch] = rerun
            if epoch != self.producing:
                self.finished.discard(epoch)
        elif epoch in self.finished and epoch != self.producing:
            self.outlet.send(stream, messages.End(epoch=epoch,
                                                  rerun=self.reruns.get(epoch, 0)))
        self.maybe_produce()
        self.delivery.deliver()

    def credit(self, identity: bytes, granted: messages.Credit) -> None:
        """CREDIT: more credits for the consumer's epoch, and the segments it mapped."""
        stream = self.streams.get(identity)
        if stream is None:
            return
        mapped = list(granted.mapped)
        unlink_handoffs(stream, mapped)
        self.delivery.mapped(stream, mapped)
        if granted.epoch == stream.epoch:
            self._granted(stream, granted.credits, granted.part)
        if not self.refill():  # (a CREDIT of none wakes this worker for the rings' credits)
            self.delivery.deliver()

    def _granted(self, stream: Stream, credits: int, part: int | None = None) -> None:
        """``stream``'s consumer gave back ``credits`` (of mix input ``part``): its oldest
        records' bytes leave its window, and the delivery has the credits."""
        stream.returned(credits)
        self.delivery.credit(stream, credits, part)

    def ring(self, identity: bytes, ring: messages.Ring) -> None:
        """RING: write into this (larger) ring from now on."""
        stream = self.streams.get(identity)
        if stream is not None:
            stream.attach(ring.ring, ring.ring_id)
            self._count_from(stream, stream.counter, stream.counted)
            self.refill()

    # --- credits given back in the rings' headers (transport/ring.py) ---------------------

    def _count_from(self, stream: Stream, counter: int | None, counted: int = 0) -> None:
        """Take ``stream``'s credits from its ring's header too, those of OPEN number
        ``counter`` beyond ``counted`` (None: from CREDIT messages only), and say so
        there (its consumer gives them back there from then on)."""
        if counter is None or stream.ring is None:
            stream.counter = None
            return
        stream.counter, stream.counted = counter, counted
        stream.ring.take(counter)

    def refill(self) -> bool:
        """Take the credits the consumers gave back in their rings' headers since last
        looked, as a CREDIT's: whether any came. Under the worker's lock (the main
        thread's, or a producer's that delivers its records itself)."""
        came = False
        for stream in self.streams.values():
            if stream.counter is None or stream.ring is None:
                continue
            more = credits_since(stream.ring.credits(), stream.counter, stream.counted)
            if more:
                stream.counted = (stream.counted + more) & COUNT_MASK
                self._granted(stream, more)
                came = True
        if came:
            self.delivery.deliver()
        return came

    def starve(self) -> bool:
        """Say in the rings' headers that this task waits for credits (each consumer
        answers with a CREDIT, which wakes the worker's loop), then look again: a credit
        given back meanwhile may have missed the mark. Whether credits came."""
        marked = []
        for stream in self.streams.values():
            if stream.counter is not None and stream.ring is not None:
                stream.waits = stream.waits % COUNT_MASK + 1
                stream.ring.starve(credits_word(stream.counter, stream.waits))
                marked.append(stream)
        if not marked:
            return False
        fence()  # (the consumer writes ``credits``, then reads ``starving``)
        if not self.refill():
            return False
        for stream in marked:  # (no wait after all: no CREDIT needed to end it)
            stream.ring.starve(0)
        return True

    def remove_stream(self, stream: Stream) -> None:
        self.delivery.leave(stream)
        self.streams.pop(stream.identity, None)
        stream.close()

    def drop_consumer(self, consumer: str, replaced: bool) -> None:
        """The broker says ``consumer`` left (``replaced``: another took its place)."""
        self.delivery.consumer_gone(consumer, replaced)
        for stream in [s for s in self.streams.values() if s.consumer == consumer]:
            self.remove_stream(stream)

    # --- producers ------------------------------------------------------------------------

    def from_producer(self, producer: Producer, kind: LinkKind, body: Any) -> None:
        """A message from one of its producers (see :class:`LinkKind`)."""
        if kind is LinkKind.SPLIT_REQ:
            self.broker.ask(messages.SplitReq(task=self.id, pass_=tuple(body["pass"]),
                                              have=body["have"], ahead=body["ahead"]))
        elif kind is LinkKind.PASS_DONE:
            self.broker.send(messages.PassDone(task=self.id, pass_=tuple(body)))
        elif kind is LinkKind.WEIGHED:
            self.broker.weigh(messages.Weighed(task=self.id, pass_=tuple(body["pass"]),
                                               at=body["at"], weights=tuple(body["weights"])))
        elif kind is LinkKind.RECORD:
            self.delivery.on_record(producer, body)
        elif kind is LinkKind.END:
            self.delivery.on_end(producer, body)
        elif kind is LinkKind.FAIL:
            self.fail(producer, body)

    def split(self, answered: messages.Split) -> None:
        """SPLIT: pass the broker's answer to the producer that asked.

        Raises:
            ProtocolError: an exactly-once job's SPLIT lacks its origin.
        """
        producer = self.producer
        if answered.task != self.id or producer is None or producer.link is None:
            return
        self.broker.answered_split(answered)
        key, track = tuple(answered.pass_), self.spec.track
        assigned = None
        if track and answered.split is not None:  # where it belongs, what to skip
            assigned = assignment(answered)
        answers = [SplitAnswer(key, answered.split, answered.have, assigned)]
        if answered.then and answered.have is not None:  # (the next places, read whole)
            answers += [SplitAnswer(key, split, place, Assigned(split, key) if track else None)
                        for place, split in enumerate(answered.then, answered.have + 1)]
        producer.answer(*answers)  # (together: one wake-up of the producer for all)

    def weighed(self, noted: messages.Weighed) -> None:
        """WEIGHED: the broker noted a producer's new weights: it may draw with them."""
        self.broker.noted(noted)
        producer = self.producer
        if noted.task == self.id and producer is not None:
            producer.answer(Noted(tuple(noted.pass_), noted.at))

    # --- epochs ---------------------------------------------------------------------------

    def abandon_stale(self) -> None:
        """Stop producing an epoch no consumer reads any more (one left it early, e.g.
        after a ``take``), so the next epoch can start; or one the delivery mode says a
        consumer's leaving ends for all (coordinated reads)."""
        producing = self.producing
        if producing is None:
            return
        if not self.delivery.breaks(producing) \
                and any(s.epoch == producing for s in self.streams.values()):
            return
        for stream in self.streams.values():
            if stream.epoch == producing:
                self.outlet.send(stream, messages.End(
                    epoch=producing, rerun=self.reruns.get(producing, 0)))
        self._stop_producer()
        self.finished.add(producing)

    def _stop_producer(self) -> None:
        """Stop the producer of the epoch under way (it exits at its next send, split
        request or take of a work item) and forget it."""
        if self.producer is not None:
            self.producer.halt()
            with self.producer.sending:
                pass  # a record it was sending went out; no other will
            self.links.drop(self.producer)
        self.producing = None
        self.producer = None

    def _redispatched(self, epoch: int) -> None:
        """The consumer sends ``epoch``'s work items again, from the first whose elements
        it did not get (its stream of them was lost: the broker gave up on it while it
        was stopped): drop those held here, stop a producer taking them, and make the
        epoch from the items that come."""
        if self.producing == epoch:
            self._stop_producer()
        self.dispatched[epoch] = Dispatched()
        self.finished.discard(epoch)

    def finish_epoch(self, epoch: int) -> None:
        self.finished.add(epoch)
        if self.producing == epoch:
            self.producing = None
            if self.producer is not None:
                self.links.drop(self.producer)
            self.producer = None
        self.maybe_produce()

    def fail(self, producer: Producer, body: dict[str, Any]) -> None:
        """User code failed: the consumers of the producer's epoch get the error."""
        if producer in self.delivery.side_producers() or body["epoch"] in self.finished:
            return  # (a mode's own producer, a replay: not the epoch's failure)
        for stream in self.streams.values():
            if stream.epoch == body["epoch"]:
                self.outlet.send(stream, messages.Fail(epoch=body["epoch"],
                                                       error=body["error"]))
        self.finish_epoch(body["epoch"])

    def maybe_produce(self) -> None:
        """Start producing the oldest epoch a consumer reads and this worker has not
        finished, unless one is under way or the worker is leaving."""
        # A mode's own producer first (a late trainer's replay: what this worker read
        # already, no new split), even while leaving: the trainer waits for it.
        self.delivery.start_side()
        if self.draining.is_set():
            return  # leaving: no new epochs
        if self.waiting_branches:
            return  # (a branch's pipeline loads: the next epoch's run makes it too)
        if self.producing is not None:
            return
        wanted = sorted({s.epoch for s in self.streams.values()} - self.finished)
        if not wanted:
            return
        self.producing = wanted[0]
        recording = self.delivery.new_epoch(wanted[0])
        self.producer = self.start_producer(wanted[0], self.delivery.pool, **recording)
        self.delivery.permit()

    def add_branch(self, index: int, tap: int, plan: Plan, fingerprint: str) -> None:
        """BRANCH: trainers whose pipeline (``plan``) shares the source and first ``tap``
        stages with the job's read it as branch ``index``: every epoch this worker starts
        from now on makes it too, and the delivery may add it to the one under way."""
        if not self.spec.first_tap or not self.spec.first_tap <= tap \
                <= len(self.spec.plan.worker_stages):
            raise ProtocolError(f"BRANCH: tap {tap} is not a stage boundary this task's "
                                "branches may part at")
        self.branches[index] = Branch(index, plan, tap, fingerprint)
        self.delivery.branch_added(index)
        self.maybe_produce()
        self.delivery.deliver()

    def drop_producer(self, producer: Producer) -> None:
        """Stop a producer of the delivery mode's own and stop listening to it."""
        producer.stop.set()
        self.links.drop(producer)

    def ask_round(self, epoch: int, members: tuple[str, ...]) -> None:
        """Ask the broker to number the next round of ``epoch``, for these consumers
        (coordinated reads)."""
        self.broker.send(messages.RoundReq(task=self.id, epoch=epoch, members=members))

    def start_producer(self, epoch: int, pool: Pool, index: int | None = None,
                       branch: int | None = None, **options: Any) -> Producer:
        """Start a producer of ``epoch`` (``options``: see
        :class:`~zloader.worker.producer.Producer`); ``index``: run as that worker index
        (its seeds: another worker's splits made again, zloader/sharing/handover.py);
        ``branch``: of that branch's pipeline alone (a replay for one of its trainers;
        None: the task's, with every branch known now)."""
        spec = self.spec
        if branch is not None:
            spec = dataclasses.replace(spec, plan=self.branches[branch].plan, first_tap=0)
        elif len(self.branches) > 1:  # (those the delivery has readers of)
            made = self.delivery.branches_for(epoch)
            spec = dataclasses.replace(spec, branches=tuple(
                self.branches[k] for k in sorted(self.branches) if k and k in made))
        if index is not None:
            spec = dataclasses.replace(spec, index=index)
        return self.links.start(spec, epoch, inline=self.delivery.inline, pool=pool,
                                draining=self.draining, epoch_input=self.inputs.get(epoch),
                                weights=self.weights, dispatched=self.dispatched_for(epoch),
                                permits=self.delivery.permits, **options)

    def stats(self) -> dict[str, Any]:
        """Its part of the heartbeat's stats: credits granted and not used, the fullest
        ring's fill, and what the delivery mode adds."""
        streams = self.streams.values()
        return {"credits": float(sum(max(0, s.credits) for s in streams)),
                "ring_fill": max((s.ring.fill() for s in streams if s.ring is not None),
                                 default=0.0),
                **self.delivery.stats()}

    def drain(self) -> None:
        """Take no new split or epoch, finish what was taken and send it even without
        credits, then tell the broker (``RELEASE.drain``: the pool moves this worker; see
        :meth:`poll`)."""
        self.moving = True
        self.draining.set()
        self.delivery.overdraw()

    def poll(self) -> None:
        """Called on every turn of the worker's loop: the delivery's own polling, and
        ``HEARTBEAT.drained`` once a task drained to move has sent all it made (after what
        it hands on, ``HEARTBEAT.handover``: a shared job's)."""
        self.delivery.poll()
        self.refill()
        if self.moving and not self.busy():
            self.moving = False
            self.hand_over()
            self.broker.send(messages.Heartbeat(drained=self.id))

    def hand_over(self) -> None:
        """Before it leaves the job cleanly (drained to move, or SIGTERM): what it hands
        on to another worker of the job (``HEARTBEAT.handover``: a shared job's splits,
        zloader/sharing/handover.py), one entry per message (they can be many)."""
        for entry in self.delivery.handover():
            self.broker.send(messages.Heartbeat(handover=(entry,)))

    def busy(self) -> bool:
        """Whether it still makes or sends something: a producer, the delivery's own
        work, or segments its consumers have not mapped yet."""
        return (self.producer is not None or self.delivery.busy()
                or any(s.handoffs for s in self.streams.values()))

    def producers(self) -> list[Producer]:
        """The producers running for this task."""
        main = [self.producer] if self.producer is not None else []
        return main + self.delivery.side_producers()

    def close(self) -> None:
        """Release the consumers' rings and segments and what the delivery holds (the
        producers are stopped first, by the worker)."""
        for stream in self.streams.values():
            stream.close()
        self.delivery.close()


def load_error(exc: BaseException) -> dict[str, Any]:
    """The TASK_FAILED error of a task whose pipeline could not be loaded here."""
    error = error_object(exc)
    error["stage"] = "worker start-up"
    error["message"] = (f"the pipeline could not be loaded on worker pid {os.getpid()}: "
                        f"{error['message']} (install the packages it imports on every "
                        "worker host)")
    return error
