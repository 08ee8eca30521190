"""A worker process: registers with the broker, runs one task at a time, serves elements.

Threads: the main thread owns the sockets (broker DEALER, data ROUTER, the inproc pair to
each producer) and moves messages; a producer thread runs the user's pipeline for one epoch
and delivers finished records itself, on the data socket, holding the worker's lock (which
the main thread holds whenever it is not waiting in its poll), taking one permit per record,
so memory stays bounded by what consumers granted. See docs/protocol.md. This module is
the process: its sockets and loop, the broker's messages, reconnecting, draining,
forwarding user output; the rest of zloader/worker/ is the task, its producers and the
delivery modes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket as _socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from zloader import handoff
from zloader._command import with_sys_path, worker_command
from zloader._defaults import DRAIN_SECONDS, FORWARD_EVERY, HEARTBEAT, WORKER_IDLE_SECONDS
from zloader._host import host_id
from zloader.forward import Capture
from zloader.pipeline import Pipeline
from zloader.plan import Plan, plan
from zloader.sharing.handover import rehanded
from zloader.shipping import Loading, Supply
from zloader.transport import messages
from zloader.transport.keys import Keys
from zloader.transport.protocol import Message, ProtocolError, decode
from zloader.transport.shm import sweep, sweep_dirs
from zloader.transport.sockets import has_message, waiting
from zloader.worker.broker_link import BrokerLink, BrokerRefused
from zloader.worker.consumers import DataPort
from zloader.worker.credit import CreditDelivery
from zloader.worker.delivery import Delivery, TaskPort
from zloader.worker.links import Links
from zloader.worker.memory import keep_freed_memory
from zloader.worker.outgoing import Outgoing
from zloader.worker.producer import Hand, LinkKind, Producer
from zloader.worker.rounds import RoundsDelivery
from zloader.worker.shared import SharedDelivery
from zloader.worker.task import Assignment, Task, load_error

__all__ = ["FORWARD_EVERY", "WorkerProcess", "delivery_for"]

log = logging.getLogger("zloader.worker")


def delivery_for(task: Assignment, planned: Plan | None = None
                 ) -> Callable[[TaskPort], Delivery]:
    """The delivery mode of a task (``planned``: its pipeline's plan), with its settings:
    the one place that asks which mode it is. The task makes it with itself as the
    port."""
    if task.share is not None:
        return functools.partial(SharedDelivery, share=task.share)
    if task.coordinated:
        return functools.partial(RoundsDelivery, size=task.coordinated)
    return functools.partial(CreditDelivery, balanced=task.balanced,  # plain or balanced
                             # (by part: a mix its consumers draw, a deterministic job's
                             # shards)
                             parts=planned.parts if planned is not None else 0)


class WorkerProcess:
    """One worker: the sockets, the loop and the current task.

    Args:
        broker: the broker endpoint.
        bind: where the data socket binds (``tcp://HOST:*`` or ``ipc://PATH``).
        advertise: the host name consumers should connect to for TCP endpoints.
        prefer: a job to serve first (the Loader that started this worker).
        parent: exit when this process id is no longer our parent (embedded workers).
        heartbeat: seconds between heartbeats (until the broker says its own).
        keys: CURVE keys (:mod:`zloader.transport.keys`), the broker's; None: none.
        plain_data: with keys, serve the data socket with PLAIN (a token, no encryption:
            trusted networks) instead of CURVE.
        forward_output: send what user code prints or logs to the job's consumers
            (:mod:`zloader.forward`): for workers whose output would not reach the
            trainer's terminal (standalone, Ray actors, pods).
        inherited: pipelines by fingerprint that this worker holds since its fork (a
            Loader's own workers): run as they are, never fetched or unpickled.
        blob_dir: the host's directory of fetched pipelines (:mod:`zloader.blobs`).
        slot: the task index a forked worker asks for (``READY.slot``); its inherited
            pipelines' sources prepare that index's first epoch as it starts.
        prepared: called once they have, with whether all did fine (see
            ``Source.forked``).
    """

    def __init__(self, broker: str, bind: str, advertise: str | None = None,
                 prefer: str | None = None, parent: int | None = None,
                 heartbeat: float = HEARTBEAT, keys: Keys | None = None,
                 plain_data: bool = False, forward_output: bool = False,
                 inherited: dict[str, Pipeline] | None = None,
                 blob_dir: str | None = None, slot: int | None = None,
                 prepared: Callable[[bool], None] | None = None) -> None:
        self.keys = keys
        self.inherited = inherited
        self.blob_dir = blob_dir
        self.plain_data = plain_data and keys is not None
        self.broker_endpoint = broker
        self.bind = bind
        self.advertise = advertise
        self.prefer = prefer
        self.slot = slot  # the task index it was forked for (READY.slot)
        self.prepared = prepared
        self.parent = parent
        self.heartbeat = heartbeat
        self.id = os.urandom(8).hex()
        self.task: Task | None = None
        self.stop = threading.Event()
        self.rejected = 0  # malformed messages dropped
        self._drain_deadline: float | None = None  # set by drain()
        self._announced = False  # HEARTBEAT.leaving sent
        self._warned = 0.0
        self.loading: tuple[Assignment, Loading] | None = None  # a task's pipeline loads
        self.branch_loads: list[tuple[messages.Branch, Loading]] = []  # (BRANCH)
        self.early: list[messages.Handover] = []  # HANDOVERs for the task that loads
        self._last_beat = 0.0
        self.capture = Capture() if forward_output else None
        self._last_forward = 0.0
        self.orphaned = False  # the parent process died (see run)
        # Set when a producer did not stop (user code blocked for good): the process can no
        # longer be trusted with a task, so it leaves its loop and runs itself afresh.
        self.wedged: str | None = None
        self._restart_when_wedged = False
        # Held by the loop except while it waits, and by a producer delivering a record.
        self.lock = threading.Lock()
        # A producer that finds a consumer's message waiting wakes the loop's poll here.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    # --- sockets --------------------------------------------------------------------------

    def run(self, gate: Callable[[], None] | None = None) -> None:
        """Serve until stopped. ``gate``: called before connecting to the broker (a forked
        worker waits there for its Loader's broker to be bound, its sockets made)."""
        keep_freed_memory()  # records made afresh reuse warm memory (worker/memory.py)
        self._prepare()  # (first: its Loader may wait for it, see zloader/_process.py)
        context = zmq.Context()
        self.supply = Supply(context, self.keys, self.inherited, self.blob_dir)
        guard = self.keys.guard(context) if self.keys is not None else None
        self.port = DataPort(context, self.bind, self.advertise, self.keys, self.plain_data,
                             self._reject)
        self.endpoint = self.port.endpoint
        self.poller = zmq.Poller()
        hand = Hand(self.lock, self._hand_record, self._delivery_busy, self._refill)
        self.links = Links(context, self.poller, self.id, hand)
        if gate is not None:
            gate()
        self.broker = BrokerLink(context, self.broker_endpoint, self.keys, messages.Ready(
            worker=self.id, host=_socket.gethostname(), host_id=host_id(), pid=os.getpid(),
            endpoint=self.endpoint, prefer=self.prefer, plain_data=self.plain_data,
            holds=tuple(sorted(self.inherited or ())), slot=self.slot))
        if self.capture is not None:
            self.capture.install()
        self.lock.acquire()  # the loop lets go of it only while it waits (see _loop)
        try:
            self._loop()
        finally:
            if self.capture is not None:
                self.capture.end()
                with contextlib.suppress(zmq.ZMQError, BrokerRefused):
                    self._forward(time.monotonic())
                self.capture.remove()
            self._stop_task()
            with contextlib.suppress(zmq.ZMQError, BrokerRefused):
                self.broker.send(messages.Bye())
            self.links.drop_all()
            self.broker.close()
            self.port.close()
            if guard is not None:
                guard.stop()
            if self.wedged is None:
                context.term()  # (a stuck producer's socket would make this wait forever)
            handoff.reap(stop=True)
            if self.orphaned:  # a trainer killed by a signal (SIGTERM from SLURM, say)
                sweep()        # cannot remove its rings and socket directory: we do
                sweep_dirs()
            self.lock.release()
            for fd in (self._wake_read, self._wake_write):
                os.close(fd)
        if self._restart_when_wedged:
            self._restart()

    def _prepare(self) -> None:
        """A worker forked as ``slot``: its pipelines' sources prepare that index's first
        epoch (``Source.forked``) before it connects; then ``prepared`` hears whether
        they all did fine."""
        fine = True
        if self.slot is not None:
            for pipeline in (self.inherited or {}).values():
                fine = pipeline.source.forked(self.slot) is not False and fine
        if self.prepared is not None:
            self.prepared(fine)

    def _restart(self) -> None:
        """Replace this process with a fresh worker (same pid, so a Loader or supervisor
        that started it still owns it; a new worker id, so the broker sees a new worker):
        a producer thread stuck in user code cannot be stopped, only discarded. Only a
        worker whose loop runs on the main thread does so (in a Ray actor the loop runs on
        a thread of the actor, which just ends)."""
        command = worker_command(
            self.broker_endpoint, bind=self.bind, parent=self.parent, advertise=self.advertise,
            keys=self.keys.path if self.keys is not None else None,
            insecure=True,  # (the bind was checked at start)
            plain_data=self.plain_data, blob_dir=self.blob_dir,
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower())
        if self.bind.startswith("ipc://"):  # the new process binds the same path
            with contextlib.suppress(OSError):
                os.unlink(self.bind[len("ipc://"):])
        log.warning("restarting worker pid %d: %s", os.getpid(), self.wedged)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, command, with_sys_path())

    def _loop(self) -> None:
        """Serve the sockets until stopped, holding the worker's lock except while waiting
        in the poll: producers deliver their records under it (:meth:`_hand_record`), so
        the data socket, used by either thread, is polled by its file descriptor (polling
        the socket itself would use it unlocked) and its messages are looked for after
        every wake-up."""
        poller, data = self.poller, self.port.sock
        poller.register(data.getsockopt(zmq.FD), zmq.POLLIN)
        poller.register(self.broker.sock, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        wait = 100
        while not self.stop.is_set():
            self.lock.release()
            try:
                ready = poller.poll(wait)
            finally:
                self.lock.acquire()
            for sock, _ in ready:
                if sock == self._wake_read:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_read, 4096)
                    continue
                if not isinstance(sock, zmq.Socket):
                    continue  # the data socket's descriptor: read below in any case
                # (a producer's pair may be dropped while its messages are read)
                for frames in waiting(sock, 256):
                    if sock is self.broker.sock:
                        self._from_broker(frames)
                    elif sock in self.links.producers:
                        producer = self.links.producers[sock]
                        kind, body = producer.outbox.popleft()  # (one per frame)
                        if self.task is not None:
                            self.task.from_producer(producer, kind, body)
            for frames in waiting(data, 256, polled=False):
                self.port.receive(frames, self.task)
                # (an OPEN maps and reserves a consumer's ring: on a busy host a burst of
                # them takes seconds, and the broker must still hear us)
                self._beat_if_due()
            if self.loading is not None:
                self._begin_task()
            if self.branch_loads:
                self._add_branches()
            handoff.reap()  # (the packer this worker forked, once it exited)
            if self.task is not None:
                self.task.poll()
            now = time.monotonic()
            if self.capture is not None and now - self._last_forward >= FORWARD_EVERY:
                self._forward(now)
            self._beat_if_due(now)
            if now - self.broker.last_from > 3 * self.heartbeat:
                self._reconnect(now)
            if self.parent is not None and os.getppid() != self.parent:
                log.warning("parent process %d is gone: exiting", self.parent)
                self.orphaned = True
                return
            if self._drain_deadline is not None and not self._announced:
                self._announced = True  # (a shared job's others hold what it will hand on)
                self.broker.send(messages.Heartbeat(leaving=True))
            if self._drain_deadline is not None and self._drained(now):
                if self.task is not None:
                    self.task.hand_over()  # (then BYE: it leaves the job cleanly)
                return
            # More waiting than one turn reads, or a message whose signal this turn's sends
            # took: the descriptor may not say so again.
            wait = 0 if has_message(data) else self._idle_wait(now)

    def _idle_wait(self, now: float) -> int:
        """Milliseconds the loop may wait for a message: 100 while something needs a look
        sooner (records waiting in the delivery, a pipeline loading, output to forward, a
        drain, a task moving), else until the next heartbeat is due, at most
        WORKER_IDLE_SECONDS (how soon it sees its parent gone). Producers' credits do
        not wait for it: they take them themselves (Hand.refill)."""
        task = self.task
        if (self.capture is not None or self._drain_deadline is not None
                or self.loading is not None or self.branch_loads
                or (task is not None and (task.moving or task.delivery.busy()))):
            return 100
        due = self._last_beat + self.heartbeat - now
        return max(1, int(min(due, WORKER_IDLE_SECONDS) * 1000) + 1)

    def _hand_record(self, producer: Producer, outgoing: Outgoing) -> None:
        """A producer's record, delivered on its thread under the worker's lock (see
        :class:`~zloader.worker.producer.Hand`). A send on the data socket may have taken
        its signal that a consumer's message came: the loop is then woken to read it (a
        record that went with a notice sent nothing on the socket)."""
        sent = self.port.outlet.sent
        if self.task is not None and producer.link is not None:
            self.task.from_producer(producer, LinkKind.RECORD, outgoing)
        else:  # a producer nobody listens to any more (its task stopped)
            outgoing.mark_taken()
        if self.port.outlet.sent != sent and has_message(self.port.sock):
            self._wake()

    def _wake(self) -> None:
        """Wake the loop from its poll (another thread has something for it)."""
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_write, b"!")

    def _refill(self, starve: bool) -> bool:
        """A producer's :attr:`Hand.refill` (the worker's lock held): its task takes the
        credits given back in the rings' headers, or (``starve``) says it waits for them."""
        task = self.task
        return task is not None and (task.refill() or (starve and task.starve()))

    def _delivery_busy(self) -> bool:
        """Whether records wait in the task's delivery for a consumer's credit."""
        task = self.task
        return task is not None and bool(task.delivery.pending)

    def _beat_if_due(self, now: float | None = None) -> None:
        """HEARTBEAT when one is due (stats too: not only when idle)."""
        now = time.monotonic() if now is None else now
        if now - self._last_beat >= self.heartbeat:
            self._last_beat = now
            self._beat()

    def _beat(self) -> None:
        """HEARTBEAT, with this worker's stats and what its producer is doing."""
        outlet, cpu = self.port.outlet, os.times()  # (this process's, all its threads)
        stats: dict[str, Any] = {
            "elements": outlet.elements, "bytes": outlet.bytes, "fallbacks": outlet.fallbacks,
            "rejected": self.rejected, "cpu_seconds": round(cpu.user + cpu.system, 3),
            "credits": 0.0, "ring_fill": 0.0,  # (the task's, below)
            "warm": self.supply.warm(),  # (pipelines kept loaded, by fingerprint)
            **{f"{stage}_seconds": round(t, 3) for stage, t in self.links.timing.items()}}
        doing = None
        if self.task is not None:
            stats.update(self.task.stats())
            if self.task.producer is not None:
                doing = self.task.producer.doing()  # where a stuck one is
        self.broker.send(messages.Heartbeat(stats=stats, doing=doing))

    def _reconnect(self, now: float) -> None:
        """The broker is silent: connect afresh; ask again what the old link lost. A
        worker that was itself stopped (SIGSTOP, a paused VM) may find the broker's
        messages waiting: it reads those first."""
        if self.broker.sock.poll(0):
            return
        log.warning("no word from the broker at %s for %.0f s: reconnecting",
                    self.broker_endpoint, now - self.broker.last_from)
        self.poller.unregister(self.broker.sock)
        self.broker.close()
        self.poller.register(self.broker.connect(), zmq.POLLIN)
        if self.task is not None:
            self.broker.ask_again(self.task.id)
            self.task.delivery.reconnected()

    def _forward(self, now: float, task_id: str | None = None) -> None:
        """Send the user output captured since the last call to the broker, for the
        consumers of ``task_id`` (default: the task that runs; output between tasks is
        not sent)."""
        assert self.capture is not None
        self._last_forward = now
        task_id = task_id or (self.task.id if self.task is not None else None)
        if task_id is None:
            self.capture.discard()
            return
        lines = self.capture.take(now)
        if lines:
            self.broker.send(messages.Log(task=task_id, lines=tuple(map(tuple, lines))))

    def _reject(self, text: str, exc_info: bool = False) -> None:
        """Count a dropped message; log it at most once a second."""
        self.rejected += 1
        now = time.monotonic()
        if now - self._warned >= 1.0:
            self._warned = now
            log.warning("%s (%d rejected so far)", text, self.rejected, exc_info=exc_info)

    def halt(self) -> None:
        """Stop now (a Loader's own worker, SIGTERM'd as its Loader closes): the loop leaves
        at once instead of at the end of its poll. Safe in a signal handler."""
        self.stop.set()
        self._wake()

    # --- draining (SIGTERM to zloader-worker) -----------------------------------------------

    @property
    def draining(self) -> bool:
        """Whether :meth:`drain` was called."""
        return self._drain_deadline is not None

    def drain(self) -> None:
        """Leave without losing or repeating anything: take no more splits, finish the
        ones taken and send what they make, then exit (at most DRAIN_SECONDS). Called
        from a signal handler: it only sets flags the loop reads."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + DRAIN_SECONDS
        task = self.task
        if task is not None:
            task.draining.set()
        self._wake()

    def _drained(self, now: float) -> bool:
        """Whether a draining worker is done: nothing left to send, or out of time."""
        task = self.task
        assert self._drain_deadline is not None
        if task is not None:
            task.draining.set()  # a task that arrived meanwhile
        if now > self._drain_deadline:
            log.warning("still busy %.0f s after SIGTERM: leaving anyway (the splits it "
                        "holds go to other workers)", DRAIN_SECONDS)
            return True
        if task is None or task.assignment.sharding != "dynamic" or not task.streams:
            return True  # nothing to finish, or nobody to send it to (static and off
            # splits are the worker's own: nobody else would read them anyway)
        return not task.busy()

    # --- broker ---------------------------------------------------------------------------

    def _from_broker(self, frames: list[zmq.Frame]) -> None:
        self.broker.heard()
        try:
            msg = decode(frames)
            self._handle_broker(msg)
        except ProtocolError as exc:
            self._reject(f"dropped a malformed message from the broker: {exc}")
        except Exception:  # a bug must not stop the worker: log it, drop the message
            self._reject("failed on a message from the broker", exc_info=True)

    def _handle_broker(self, msg: Message) -> None:
        """One message from the broker, its body decoded into its record.

        Raises:
            ProtocolError: it is malformed.
        """
        record, task = messages.decode(msg), self.task
        if isinstance(record, messages.Ack):
            self.heartbeat = record.heartbeat  # the broker's interval: it expects ours
            if task is not None and record.task != task.id:
                # The broker gave up on this worker (a partition, a stall) and handed its
                # splits to others: what it still holds must not reach a consumer.
                log.warning("the broker had dropped this worker: task %s abandoned", task.id)
                self._stop_task()
        elif isinstance(record, messages.Task):
            self._start_task(record, msg.payload)
        elif isinstance(record, messages.Split):
            if task is not None:
                task.split(record)
        elif isinstance(record, messages.Weighed):
            if task is not None:
                task.weighed(record)
        elif isinstance(record, messages.Release):
            if record.drain and task is not None and record.task == task.id:
                task.drain()  # the pool moves this worker: finish, then say so
                return
            if self.loading is not None and record.task == self.loading[0].id:
                self.loading = None
                if record.drain:  # nothing taken yet: done at once
                    self._drained_unbegun(record.task)
            if task is not None and record.task == task.id:
                self._stop_task()
        elif isinstance(record, messages.Branch):
            self._load_branch(record, msg.payload)
        elif isinstance(record, messages.Handover):
            if task is not None and record.task == task.id:
                task.delivery.adopt(record.segments, record.held, record.fence)
            elif self.loading is not None and record.task == self.loading[0].id:
                self.early.append(record)  # (a job's next worker: adopted as it begins)
        elif isinstance(record, messages.Round):
            if task is not None and record.task == task.id:
                task.delivery.on_round(record.epoch, record.round)
        elif isinstance(record, messages.ConsumerGone):
            if task is not None:
                task.drop_consumer(record.consumer, record.replaced)
                sweep()  # a consumer that died cannot unlink its rings: remove them for it
        elif isinstance(record, messages.Unknown):
            self.broker.ready()  # the broker restarted (or gave up on us): register again
            if task is not None:
                self.broker.ask_again(task.id)
        elif isinstance(record, messages.Error):
            log.error("broker refused a message: %s", record.message)

    def _start_task(self, record: messages.Task, payload: list[Any]) -> None:
        """TASK: check it, then load its pipeline on a thread (see ``_begin_task``)."""
        task = Assignment.decode(record)
        if task.id in (self.task.id if self.task is not None else None,
                       self.loading[0].id if self.loading is not None else None):
            return  # sent again after a reconnect: this worker has it already
        if self.task is not None:
            self._stop_task()
        self.early = []
        self.loading = (task, self.supply.start(record, payload, self._wake))
        self._begin_task()

    def _begin_task(self) -> None:
        """Run the task whose pipeline has loaded (a fetch or an unpickle may take seconds:
        the loop keeps heartbeating meanwhile), or report why it could not load."""
        if self.loading is None or not self.loading[1].done():
            return
        (assigned, loading), self.loading = self.loading, None
        if loading.error is not None:
            log.error("task %s could not start", assigned.id, exc_info=loading.error)
            self.broker.send(messages.TaskFailed(task=assigned.id,
                                                 error=load_error(loading.error)))
            return
        assert loading.pipeline is not None
        planned = plan(loading.pipeline, assigned.options)
        self.task = Task(assigned, planned, self.port.outlet, self.links, self.broker,
                         delivery_for(assigned, planned))
        self.task.waiting_branches = sum(1 for record, _ in self.branch_loads
                                         if record.task == assigned.id)
        early, self.early = self.early, []
        for handover in early:  # (before its consumers' OPENs: the epochs it holds)
            if handover.task == assigned.id:
                self.task.delivery.adopt(handover.segments, handover.held, handover.fence)
        self.port.begin(self.task)

    def _drained_unbegun(self, task: str) -> None:
        """``task`` drained while its pipeline loaded: it took no split, so it hands on
        only what was handed to it meanwhile (a shared job's HANDOVERs, kept for it), and
        an OPEN for it, kept or to come, is answered with an END as a drained task's is
        (its trainers wait for that END: before, they waited LEAVE_GRACE_SECONDS, about
        once in 150 runs of a shared job's move under load). Then it says it is done."""
        early, self.early = [h.segments for h in self.early if h.task == task], []
        entries = rehanded(early)
        for entry in entries:
            self.broker.send(messages.Heartbeat(handover=(entry,)))
        self.port.stopped(task, {entry["epoch"] for entry in entries})
        self.broker.send(messages.Heartbeat(drained=task))

    def _load_branch(self, record: messages.Branch, payload: list[Any]) -> None:
        """BRANCH: load the pipeline of a shared job's branch on a thread, as a task's
        (the task may itself still be loading: the branch is added once both are)."""
        owner = self.task.assignment if self.task is not None else \
            self.loading[0] if self.loading is not None else None
        if owner is None or owner.id != record.task:
            return
        carrier = messages.Task(task=record.task, job=owner.job, options=owner.options,
                                index=owner.index, width=owner.width, entropy=owner.entropy,
                                source_data=record.source_data,
                                fingerprint=record.fingerprint, pipeline=record.pipeline)
        self.branch_loads.append((record, self.supply.start(carrier, payload, self._wake)))
        if self.task is not None:
            self.task.waiting_branches += 1
        self._add_branches()

    def _add_branches(self) -> None:
        """Add to the task the branches whose pipelines have loaded."""
        waiting = []
        for record, loading in self.branch_loads:
            task = self.task
            if not loading.done() or (task is None and self.loading is not None
                                      and self.loading[0].id == record.task):
                waiting.append((record, loading))
                continue
            if task is None or task.id != record.task:
                continue  # (its task is over)
            task.waiting_branches = max(0, task.waiting_branches - 1)
            if loading.error is not None or loading.pipeline is None:
                log.error("branch %d of task %s could not load: its trainers get the "
                          "error", record.branch, task.id, exc_info=loading.error)
                task.delivery.branch_failed(record.branch, load_error(
                    loading.error or RuntimeError("no pipeline")))
            else:
                try:
                    task.add_branch(record.branch, record.tap,
                                    plan(loading.pipeline, task.assignment.options),
                                    record.fingerprint)
                except ProtocolError as exc:
                    self._reject(f"dropped a BRANCH: {exc}")
        self.branch_loads = waiting
        if self.task is not None:
            self.task.maybe_produce()  # (an epoch that waited for the branches)

    def _stop_task(self) -> None:
        self.loading = None  # a task still loading is dropped with its result
        task, self.task = self.task, None
        if task is None:
            return
        for producer in task.producers():
            stuck = self.links.stop(producer)
            if stuck is not None:
                self._wedge(f"task {task.id}'s {stuck}")
        if self.capture is not None:  # its output goes to its own consumers, not the next's
            with contextlib.suppress(zmq.ZMQError):
                self._forward(time.monotonic(), task.id)
            self.capture.discard()
        self.port.stopped(task.id, task.delivery.handed())
        task.close()

    def _wedge(self, why: str) -> None:
        """A producer did not stop (``why``): its user code is blocked (a deadlock, a
        wait that never ends). Leave the loop; :meth:`run` then restarts the process,
        unless it was asked to stop anyway."""
        self.wedged = why
        if not self.stop.is_set():
            self._restart_when_wedged = threading.current_thread() is threading.main_thread()
            self.stop.set()
