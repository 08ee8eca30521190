"""A worker process: registers with the broker, runs one task at a time, serves elements.

Threads: the main thread owns every socket (broker DEALER, data ROUTER, the inproc pair to
the producer) and moves messages; a producer thread runs the user's pipeline for one epoch
and hands finished records to the main thread, taking one credit per record, so memory stays
bounded by what consumers granted. See docs/protocol.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket as _socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import psutil
import zmq

from zloader import codec
from zloader._command import with_sys_path, worker_command
from zloader._defaults import DRAIN_SECONDS, STAGES
from zloader._host import host_id
from zloader.errors import ZloaderError
from zloader.forward import Capture
from zloader.lineage import unpack
from zloader.pipeline import Pipeline
from zloader.plan import Plan, plan
from zloader.producer import Outgoing, Producer
from zloader.sharing.store import Stored, store
from zloader.sharing.window import Window
from zloader.shipping import Loading, Supply
from zloader.transport import records
from zloader.transport.keys import Keys
from zloader.transport.protocol import (
    MAX_DATA_FRAME_BYTES,
    Command,
    Message,
    ProtocolError,
    decode,
    encode,
    error_object,
    heartbeat,
)
from zloader.transport.ring import RingError, RingWriter
from zloader.transport.shm import Segment, ShmError, sweep, sweep_dirs

__all__ = ["BrokerRefused", "WorkerProcess"]

log = logging.getLogger("zloader.worker")

STOP_SECONDS = 2.0
"""A producer told to stop that has not within this long is stuck in user code (a thread
cannot be killed): the worker process then replaces itself (:meth:`WorkerProcess._restart`)."""
FORWARD_EVERY = 0.2
"""Seconds between two sends of captured user output (zloader/forward.py)."""


class BrokerRefused(ZloaderError, ConnectionRefusedError):
    """The broker's socket refused this worker's connection at the handshake: the two do
    not hold the same keys."""


@dataclass
class _Stream:
    """One consumer reading this worker's task."""

    identity: bytes
    consumer: str
    epoch: int
    credits: int = 0
    ring: Any = None
    handoffs: dict[str, Any] = field(default_factory=dict)  # segments the consumer may map
    index: int | None = None  # consumer_index, in a coordinated job


@dataclass(eq=False)
class _Group:
    """One round's worth of records (element j for consumer j) of a coordinated job, or
    the epoch's end (``end``: the END body) once the rounds before it have gone out."""

    epoch: int
    records: list[Outgoing]
    end: dict[str, Any] | None = None
    members: list[bytes] | None = None  # set when its number was asked for


@dataclass
class _Task:
    """The job a worker runs (see the fields' comments)."""

    id: str
    job: str
    plan: Plan
    sharding: str
    index: int
    width: int
    on_error: str
    entropy: int
    streams: dict[bytes, _Stream] = field(default_factory=dict)
    credit_pool: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    producer: Producer | None = None
    producing: int | None = None
    finished: set[int] = field(default_factory=set)
    reruns: dict[int, int] = field(default_factory=dict)  # epoch -> latest rerun asked
    inputs: dict[int, Any] = field(default_factory=dict)  # epoch -> the consumer's input
    balanced: int = 0  # consumers to deal to one element at a time, round-robin (0: off)
    turn: int = 0
    pending: deque[tuple[int, Outgoing | None, dict[str, Any]]] = field(default_factory=deque)
    # A shared job (zloader/sharing): the window, each record's memory, the splits read per
    # epoch (to make a late joiner's missed elements again) and the replays to run.
    window: Window | None = None
    stored: dict[str, Stored] = field(default_factory=dict)
    splits: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)
    replays: deque[tuple[bytes, int, int]] = field(default_factory=deque)
    replayer: Producer | None = None
    replaying: tuple[bytes, int] | None = None  # (trainer, elements sent so far)
    replay_pending: deque[tuple[int, Outgoing | None, dict[str, Any]]] = field(
        default_factory=deque)
    outstanding: int = 0  # production permits not yet used
    replay_outstanding: int = 0
    # Coordinated reads (zloader/rounds.py): the group being filled, and the full groups
    # (and epoch ends) in order, the first ones waiting for their round number.
    coordinated: int = 0
    track: bool = False  # exactly-once: elements carry their origins (zloader/lineage.py)
    partial: list[Outgoing] = field(default_factory=list)
    partial_epoch: int = -1
    replaced: set[str] = field(default_factory=set)  # consumers a restarted one took over
    draining: threading.Event = field(default_factory=threading.Event)  # take no more splits
    groups: deque[_Group] = field(default_factory=deque)


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
    """

    def __init__(self, broker: str, bind: str, advertise: str | None = None,
                 prefer: str | None = None, parent: int | None = None,
                 heartbeat: float = 1.0, keys: Keys | None = None,
                 plain_data: bool = False, forward_output: bool = False,
                 inherited: dict[str, Pipeline] | None = None,
                 blob_dir: str | None = None) -> None:
        self.keys = keys
        self.inherited = inherited
        self.blob_dir = blob_dir
        self.plain_data = plain_data and keys is not None
        self.broker_endpoint = broker
        self.bind = bind
        self.advertise = advertise
        self.prefer = prefer
        self.parent = parent
        self.heartbeat = heartbeat
        self.id = secrets.token_hex(8)
        self.task: _Task | None = None
        self.stop = threading.Event()
        self.elements = 0
        self.bytes = 0
        self.fallbacks = 0
        self.rejected = 0  # malformed messages dropped
        self._process = psutil.Process()  # its CPU time goes in the heartbeat stats
        self.timing = dict.fromkeys(STAGES, 0.0)  # its producers' time, by stage
        self._asking: dict[str, Any] | None = None  # the split request not yet answered
        self._drain_deadline: float | None = None  # set by drain()
        self._warned = 0.0
        self.early_opens: deque[tuple[bytes, Message]] = deque(maxlen=64)
        self.loading: tuple[dict[str, Any], Loading] | None = None  # a task's pipeline loads
        self._last_from_broker = time.monotonic()
        self._last_to_broker = 0.0
        self._last_beat = 0.0
        self.capture = Capture() if forward_output else None
        self._last_forward = 0.0
        self.orphaned = False  # the parent process died (see run)
        # Set when a producer did not stop (user code blocked for good): the process can no
        # longer be trusted with a task, so it leaves its loop and runs itself afresh.
        self.wedged: str | None = None
        self._restart_when_wedged = False

    # --- sockets --------------------------------------------------------------------------

    def run(self) -> None:
        context = zmq.Context()
        self.context = context
        self.supply = Supply(context, self.keys, self.inherited, self.blob_dir)
        guard = self.keys.guard(context) if self.keys is not None else None
        data = context.socket(zmq.ROUTER)
        data.setsockopt(zmq.LINGER, 0)
        data.setsockopt(zmq.MAXMSGSIZE, MAX_DATA_FRAME_BYTES)
        if self.plain_data:
            assert self.keys is not None
            self.keys.serve_plain(data)
        elif self.keys is not None:
            self.keys.serve(data)
        data.bind(self.bind)
        endpoint = data.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.advertise and endpoint.startswith("tcp://"):
            endpoint = f"tcp://{self.advertise}:{endpoint.rsplit(':', 1)[1]}"
        self.endpoint = endpoint
        self.data = data
        self.links: dict[Any, Producer] = {}  # our end of each live producer's pair
        self._pairs = 0
        self.poller = zmq.Poller()
        self.broker = self._connect_broker()
        if self.capture is not None:
            self.capture.install()
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
                self._to_broker(Command.BYE, {})
            for producer in list(self.links.values()):
                self._drop_link(producer)
            for sock in (self.broker, data):
                sock.close(0)
            if guard is not None:
                guard.stop()
            if self.wedged is None:
                context.term()  # (a stuck producer's socket would make this wait forever)
            if self.orphaned:  # a trainer killed by a signal (SIGTERM from SLURM, say)
                sweep()        # cannot remove its rings and socket directory: we do
                sweep_dirs()
        if self._restart_when_wedged:
            self._restart()

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

    def _connect_broker(self) -> zmq.Socket[Any]:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            self.keys.connect(sock)
        sock.connect(self.broker_endpoint)
        self.broker = sock
        self._ready()
        self._last_from_broker = time.monotonic()
        return sock

    def _ready(self) -> None:
        """(Re-)register with the broker."""
        self._to_broker(Command.READY, {
            "worker": self.id, "host": _socket.gethostname(), "host_id": host_id(),
            "pid": os.getpid(), "endpoint": self.endpoint, "prefer": self.prefer,
            "plain_data": self.plain_data, "holds": sorted(self.inherited or ())})

    def _to_broker(self, command: Command, body: dict[str, Any]) -> None:
        """Send to the broker. A connection still being made queues what is sent; only
        one whose handshake failed (other keys, or none) has nowhere to put it.

        Raises:
            BrokerRefused: the handshake failed; the text says which keys to give.
        """
        try:
            self.broker.send_multipart(encode(command, body), zmq.NOBLOCK)
        except zmq.Again:
            fix = ("the broker wants CURVE keys: pass --keys DIR, the broker's keys "
                   "directory (see `zloader keygen`)" if self.keys is None else
                   f"the broker holds other CURVE keys than {self.keys.path}, or none: give "
                   "every host of the service the same keys directory (--keys DIR)")
            raise BrokerRefused(f"the broker at {self.broker_endpoint} refused this worker's "
                                f"connection at the handshake: {fix}") from None
        self._last_to_broker = time.monotonic()

    def _loop(self) -> None:
        poller = self.poller
        poller.register(self.data, zmq.POLLIN)
        poller.register(self.broker, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(100):
                for _ in range(256):
                    if sock.closed:
                        break  # a producer's pair, dropped while its messages were read
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if sock is self.data:
                        self._from_consumer(frames)
                    elif sock is self.broker:
                        self._from_broker(frames)
                    elif sock in self.links:
                        self._from_producer(self.links[sock], frames)
            if self.loading is not None:
                self._begin_task()
            task = self.task
            if task is not None and task.window is not None and task.pending:
                self._deliver(task)  # a record blocked by a lagging trainer: look again
            now = time.monotonic()
            if self.capture is not None and now - self._last_forward >= FORWARD_EVERY:
                self._forward(now)
            if now - self._last_beat >= self.heartbeat:  # stats too: not only when idle
                self._last_beat = now
                stats: dict[str, Any] = {"elements": self.elements, "bytes": self.bytes,
                                         "fallbacks": self.fallbacks,
                                         "rejected": self.rejected, **self._usage()}
                if self.task is not None and self.task.window is not None:
                    stats["trainers"] = self._trainers(self.task)
                beat: dict[str, Any] = {"stats": stats}
                if self.task is not None and self.task.producer is not None:
                    beat["doing"] = self.task.producer.doing()  # where a stuck one is
                self._to_broker(Command.HEARTBEAT, beat)
            if now - self._last_from_broker > 3 * self.heartbeat:
                log.warning("no word from the broker at %s for %.0f s: reconnecting",
                            self.broker_endpoint, now - self._last_from_broker)
                poller.unregister(self.broker)
                self.broker.close(0)
                poller.register(self._connect_broker(), zmq.POLLIN)
                self._ask_again_for_split()
                if self.task is not None and self.task.coordinated:
                    self._ask_again(self.task)
            if self.parent is not None and os.getppid() != self.parent:
                log.warning("parent process %d is gone: exiting", self.parent)
                self.orphaned = True
                return
            if self._drain_deadline is not None and self._drained(now):
                return

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
            self._to_broker(Command.LOG, {"task": task_id, "lines": lines})

    # --- draining (SIGTERM to zloader-worker) -----------------------------------------------

    def _usage(self) -> dict[str, float]:
        """CPU seconds used, credits granted and not used, and the fullest ring's fill."""
        cpu = self._process.cpu_times()
        usage = {"cpu_seconds": round(cpu.user + cpu.system, 3), "credits": 0.0,
                 "ring_fill": 0.0,
                 **{f"{stage}_seconds": round(t, 3) for stage, t in self.timing.items()}}
        if self.task is not None:
            streams = self.task.streams.values()
            usage["credits"] = float(sum(max(0, s.credits) for s in streams))
            usage["ring_fill"] = max((s.ring.fill() for s in streams if s.ring is not None),
                                     default=0.0)
        return usage

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

    def _drained(self, now: float) -> bool:
        task = self.task
        assert self._drain_deadline is not None
        if task is not None:
            task.draining.set()  # a task that arrived meanwhile
        if now > self._drain_deadline:
            log.warning("still busy %.0f s after SIGTERM: leaving anyway (the splits it "
                        "holds go to other workers)", DRAIN_SECONDS)
            return True
        if task is None or task.sharding != "dynamic" or not task.streams:
            return True  # nothing to finish, or nobody to send it to (static and off
            # splits are the worker's own: nobody else would read them anyway)
        busy = (task.producer is not None or task.pending or task.groups or task.partial
                or any(s.handoffs for s in task.streams.values()))
        return not busy

    # --- broker ---------------------------------------------------------------------------

    def _from_broker(self, frames: list[zmq.Frame]) -> None:
        self._last_from_broker = time.monotonic()
        try:
            msg = decode(frames)
            self._handle_broker(msg)
        except ProtocolError as exc:
            self._reject(f"dropped a malformed message from the broker: {exc}")
        except Exception:  # a bug must not stop the worker: log it, drop the message
            self._reject("failed on a message from the broker", exc_info=True)

    def _ask_again_for_split(self) -> None:
        """A split request whose answer may be lost (a new broker connection): ask again;
        ``have`` makes the broker send the same split if it had handed one out."""
        if self._asking is not None and self.task is not None \
                and self._asking["task"] == self.task.id:
            self._to_broker(Command.SPLIT_REQ, self._asking)

    def _reject(self, text: str, exc_info: bool = False) -> None:
        """Count a dropped message; log it at most once a second."""
        self.rejected += 1
        now = time.monotonic()
        if now - self._warned >= 1.0:
            self._warned = now
            log.warning("%s (%d rejected so far)", text, self.rejected, exc_info=exc_info)

    def _handle_broker(self, msg: Message) -> None:
        command = msg.command
        if command is Command.ACK:
            beat = heartbeat(msg.body.get("heartbeat"))
            if beat is not None:
                self.heartbeat = beat  # the broker's interval: it expects ours
            if "task" in msg.body and self.task is not None \
                    and msg.body["task"] != self.task.id:
                # The broker gave up on this worker (a partition, a stall) and handed its
                # splits to others: what it still holds must not reach a consumer.
                log.warning("the broker had dropped this worker: task %s abandoned",
                            self.task.id)
                self._stop_task()
        elif command is Command.TASK:
            self._start_task(msg)
        elif command is Command.SPLIT:
            task = self.task
            link = task.producer.link if task is not None and task.producer else None
            if task is not None and msg.field("task", str) == task.id and link is not None:
                self._asking = None
                split = msg.field("split", int, optional=True)
                answer = {"pass": msg.field("pass", list), "split": split,
                          "have": msg.body.get("have")}
                if task.track and split is not None:  # where it belongs, what to skip
                    answer.update(_assignment(msg))
                with contextlib.suppress(zmq.Again):
                    link.send(json.dumps(answer).encode(), zmq.NOBLOCK)
        elif command is Command.RELEASE:
            if self.loading is not None and msg.field("task", str) == self.loading[0]["id"]:
                self.loading = None
            if self.task is not None and msg.field("task", str) == self.task.id:
                self._stop_task()
        elif command is Command.ROUND:
            if self.task is not None and msg.field("task", str) == self.task.id:
                self._numbered(self.task, msg.field("epoch", int),
                               msg.field("round", int, optional=True))
        elif command is Command.CONSUMER_GONE:
            if self.task is not None and msg.body.get("replaced"):
                self.task.replaced.add(msg.field("consumer", str))
            self._drop_consumer(msg.field("consumer", str))
        elif command is Command.UNKNOWN:
            self._ready()  # the broker restarted (or gave up on us): register again
            self._ask_again_for_split()
        elif command is Command.ERROR:
            log.error("broker refused a message: %s", msg.body.get("message"))

    def _start_task(self, msg: Message) -> None:
        """TASK: check it, then load its pipeline on a thread (see ``_begin_task``)."""
        task = {"id": msg.field("task", str), "job": msg.field("job", str),
                "sharding": msg.field("sharding", str), "index": msg.field("index", int),
                "width": msg.field("width", int),
                "on_error": str(msg.body.get("on_error", "raise")),
                "entropy": msg.field("entropy", int),
                "balanced": max(0, int(msg.body.get("balanced") or 0)),
                "coordinated": max(0, int(msg.body.get("coordinated") or 0)),
                "track": msg.body.get("track") is True}
        share = msg.field("share", dict, optional=True)
        if share is not None:
            task["window"] = Window(int(share["window_bytes"]), str(share["lag"]),
                                    float(share["block_seconds"]))
        if self.task is not None:
            self._stop_task()
        self.loading = (task, self.supply.start(msg))
        self._begin_task()

    def _begin_task(self) -> None:
        """Run the task whose pipeline has loaded (a fetch or an unpickle may take seconds:
        the loop keeps heartbeating meanwhile), or report why it could not load."""
        if self.loading is None or not self.loading[1].done():
            return
        (fields, loading), self.loading = self.loading, None
        if loading.error is not None:
            exc = loading.error
            log.error("task %s could not start", fields["id"], exc_info=exc)
            error = error_object(exc)
            error["stage"] = "worker start-up"
            error["message"] = (f"the pipeline could not be loaded on worker pid {os.getpid()}"
                                f": {error['message']} (install the packages it imports on "
                                "every worker host)")
            self._to_broker(Command.TASK_FAILED, {"task": fields["id"], "error": error})
            return
        assert loading.pipeline is not None
        task = self.task = _Task(plan=plan(loading.pipeline), **fields)
        early, self.early_opens = list(self.early_opens), deque(maxlen=64)
        for identity, opened in early:
            if opened.body.get("job") == task.job and opened.body.get("task") in (None, task.id):
                try:
                    self._handle_consumer(identity, opened)
                except ProtocolError as exc:
                    self._reject(f"dropped a malformed message from a consumer: {exc}")

    def _stop_task(self) -> None:
        self.loading = None  # a task still loading is dropped with its result
        task, self.task = self.task, None
        if task is None:
            return
        for producer in (task.producer, task.replayer):
            if producer is not None:
                producer.stop.set()
                producer.join(STOP_SECONDS)
                self._drop_link(producer)
                if producer.is_alive():
                    self._wedge(task, producer)
        if self.capture is not None:  # its output goes to its own consumers, not the next's
            with contextlib.suppress(zmq.ZMQError):
                self._forward(time.monotonic(), task.id)
            self.capture.discard()
        for stream in task.streams.values():
            self._unlink_handoffs(stream)
            if stream.ring is not None:
                stream.ring.close()
        for stored in task.stored.values():
            stored.free()
        task.stored.clear()

    def _wedge(self, task: _Task, producer: Producer) -> None:
        """A producer did not stop: its user code is blocked (a deadlock, a wait that
        never ends). Leave the loop; :meth:`run` then restarts the process, unless it was
        asked to stop anyway."""
        doing = producer.doing()
        self.wedged = (f"task {task.id}'s producer did not stop within {STOP_SECONDS:.0f} s "
                       f"(stage {doing['stage']}, split {doing['split']}, epoch "
                       f"{doing['epoch']}): its user code has not returned (blocked, or "
                       "slower than that per element)")
        if not self.stop.is_set():
            self._restart_when_wedged = threading.current_thread() is threading.main_thread()
            self.stop.set()

    # --- producer -------------------------------------------------------------------------

    def _from_producer(self, producer: Producer, frames: list[zmq.Frame]) -> None:
        task = self.task
        kind = frames[0].bytes
        if task is None:
            return
        if producer.replay is not None:
            if kind in (b"R", b"E"):
                self._from_replay(task, producer, kind, json.loads(frames[1].bytes))
            return
        if kind == b"S":
            ask = json.loads(frames[1].bytes)
            self._asking = {"task": task.id, "pass": ask["pass"], "have": ask["have"]}
            self._to_broker(Command.SPLIT_REQ, self._asking)
        elif kind == b"P":
            self._to_broker(Command.PASS_DONE, {"task": task.id,
                                                "pass": json.loads(frames[1].bytes)})
        elif kind == b"R":
            head = json.loads(frames[1].bytes)
            task.outstanding = max(0, task.outstanding - 1)
            task.pending.append((head["epoch"], producer.outbox.popleft(), head))
            self._deliver(task)
        elif kind == b"E":
            body = json.loads(frames[1].bytes)
            task.pending.append((body["epoch"], None, {"end": True, **body}))
            self._deliver(task)
        elif kind == b"F":
            body = json.loads(frames[1].bytes)
            if body["epoch"] in task.finished:
                return
            for stream in task.streams.values():
                if stream.epoch == body["epoch"]:
                    self._to_consumer(stream, Command.FAIL, body)
            self._finish_epoch(task, body["epoch"])

    def _deliver(self, task: _Task) -> None:
        """Send pending records to consumers with credit, in order; an epoch's END goes
        out once all its records have."""
        if task.window is not None:
            self._deliver_shared(task)
            return
        if task.coordinated:
            self._deliver_rounds(task)
            return
        while task.pending:
            epoch, outgoing, head = task.pending[0]
            if epoch in task.finished:  # an abandoned epoch's leftovers
                task.pending.popleft()
                if outgoing is not None:
                    outgoing.taken.set()
                continue
            streams = [s for s in task.streams.values() if s.epoch == epoch]
            if head.get("end"):
                task.pending.popleft()
                end = {"epoch": epoch, "skipped": head["skipped"]}
                if "origins" in head:
                    end["origins"] = head["origins"]
                for stream in streams:
                    self._to_consumer(stream, Command.END, end)
                self._finish_epoch(task, epoch)
                continue
            if task.balanced:
                # Deal records round-robin, whatever the consumers' speed: equal shares,
                # once every consumer sharing the job has opened the epoch.
                if len(streams) < task.balanced:
                    return
                order = sorted(streams, key=lambda s: s.consumer)
                stream = order[task.turn % len(order)]
                if stream.credits <= 0:
                    return
                task.turn += 1
            else:
                ready = [s for s in streams if s.credits > 0]
                if not ready:
                    return
                stream = max(ready, key=lambda s: s.credits)
            task.pending.popleft()
            stream.credits -= 1
            assert outgoing is not None
            self._send_record(stream, epoch, outgoing.buffers, head)
            outgoing.taken.set()

    def _send_record(self, stream: _Stream, epoch: int, frames: list[Any],
                     head: dict[str, Any]) -> None:
        body = {"epoch": epoch, "count": head["count"], "skipped": head["skipped"],
                "ring": None}
        for name in ("round", "origins"):
            if name in head:
                body[name] = head[name]
        size = sum(codec.nbytes(f) for f in frames)
        self.elements += head["count"]
        self.bytes += size
        if stream.ring is not None:
            packed = records.packed_size(frames)
            if packed > stream.ring.capacity and self._send_segment(stream, body, frames, packed):
                return
            try:
                slot = stream.ring.reserve(packed)
            except RingError as exc:  # its header was overwritten: sockets from now on
                self._reject(f"stopped using the ring of consumer {stream.consumer}: {exc}")
                stream.ring.close()
                stream.ring = None
                slot = None
            if slot is not None:
                position, view = slot
                records.pack_into(frames, view)
                body["ring"] = [position, packed, stream.ring.name]
                self._to_consumer(stream, Command.DATA, body)
                return
            self.fallbacks += 1
            body["full"] = True  # the consumer may give this worker a larger ring
            if packed >= records.SEGMENT_BYTES and self._send_segment(stream, body, frames,
                                                                      packed):
                return
        self._to_consumer(stream, Command.DATA, body, codec.joined(frames))

    def _send_segment(self, stream: _Stream, body: dict[str, Any], frames: list[Any],
                      packed: int) -> bool:
        """A record larger than the ring goes in a shared-memory segment of its own. This
        worker unlinks it once the consumer says it has mapped it (in CREDIT), or when the
        consumer goes away."""
        try:
            segment = Segment.create("big", packed)
        except (ShmError, OSError) as exc:
            log.warning("%s; sending the record over the socket", exc)
            return False
        records.pack_into(frames, segment.buf)
        stream.handoffs[segment.name] = segment
        body["segment"] = [segment.name, packed]
        self._to_consumer(stream, Command.DATA, body)
        return True

    def _unlink_handoffs(self, stream: _Stream, names: Any = None) -> None:
        for name in list(stream.handoffs) if names is None else names:
            segment = stream.handoffs.pop(name, None) if isinstance(name, str) else None
            if segment is not None:
                segment.close()
                segment.unlink()

    def _finish_epoch(self, task: _Task, epoch: int) -> None:
        task.finished.add(epoch)
        if task.producing == epoch:
            task.producing = None
            if task.producer is not None:
                self._drop_link(task.producer)
            task.producer = None
        self._maybe_produce(task)

    def _maybe_produce(self, task: _Task) -> None:
        if task.draining.is_set():
            return  # leaving: no new epochs, no replays
        if task.replayer is None:
            while task.replays:  # a shared job's late joiner: make what it missed again
                trainer, epoch, missed = task.replays.popleft()
                if trainer in task.streams:
                    task.replaying = (trainer, 0)
                    task.replay_outstanding = 0
                    task.replayer = self._start_producer(
                        task, epoch, replay=(trainer, missed), pool=threading.Semaphore(0))
                    break
        if task.producing is not None:
            return
        wanted = sorted({s.epoch for s in task.streams.values()} - task.finished)
        if not wanted:
            return
        task.producing = wanted[0]
        if task.window is not None or task.coordinated:  # permits: _permit, _permit_rounds
            while task.credit_pool.acquire(blocking=False):
                pass
            task.outstanding = 0
            for old in [e for e in task.splits if e < wanted[0] - 2]:
                del task.splits[old]
        task.producer = self._start_producer(task, wanted[0])

    def _start_producer(self, task: _Task, epoch: int, replay: tuple[bytes, int] | None = None,
                        pool: threading.Semaphore | None = None) -> Producer:
        self._pairs += 1
        address = f"inproc://producer-{self.id}-{self._pairs}"
        link = self.context.socket(zmq.PAIR)
        link.setsockopt(zmq.LINGER, 0)
        link.bind(address)
        self.poller.register(link, zmq.POLLIN)
        producer = Producer(self.context, address, task, epoch, replay, pool, self.timing)
        producer.link = link
        self.links[link] = producer
        producer.start()
        if task.window is not None:
            self._permit(task, producer)
        elif task.coordinated:
            self._permit_rounds(task)
        return producer

    def _drop_link(self, producer: Producer) -> None:
        link, producer.link = producer.link, None
        if link is not None:
            self.links.pop(link, None)
            self.poller.unregister(link)
            link.close(0)

    # --- shared jobs (zloader/sharing) ----------------------------------------------------

    def _open_shared(self, task: _Task, stream: _Stream, epoch: int, credits: int) -> None:
        """A trainer starts (or re-opens) ``epoch``: place its cursor in the window; what
        it missed of an epoch under way is made again for it (a replay)."""
        window = task.window
        assert window is not None
        cursor = window.cursors.get(stream.identity)
        if cursor is None or cursor.epoch != epoch:
            finished = epoch in task.finished and epoch != task.producing
            cursor = window.join(stream.identity, epoch, epoch == task.producing or finished,
                                 finished)
            if cursor.missed > 0:
                task.replays.append((stream.identity, epoch, cursor.missed))
        elif cursor.done:
            self._to_consumer(stream, Command.END, {"epoch": epoch, "skipped": 0,
                                                    "lagged": cursor.lagged})
        stream.epoch = epoch
        cursor.credits = max(0, min(credits, 1 << 16))
        self._abandon_stale(task)  # every trainer left the epoch being produced
        self._maybe_produce(task)
        self._deliver(task)

    def _from_replay(self, task: _Task, producer: Producer, kind: bytes,
                     head: dict[str, Any]) -> None:
        if producer is not task.replayer:
            return
        if kind == b"R":
            task.replay_outstanding = max(0, task.replay_outstanding - 1)
            task.replay_pending.append((head["epoch"], producer.outbox.popleft(), head))
        else:
            task.replay_pending.append((head["epoch"], None, {"end": True, **head}))
        self._deliver(task)

    def _deliver_shared(self, task: _Task) -> None:
        """Admit produced records into the window (as the lag policy allows), send a
        replay's records to its trainer, then send every trainer what it may take."""
        window = task.window
        assert window is not None
        now = time.monotonic()
        while task.pending:
            epoch, outgoing, head = task.pending[0]
            if head.get("end"):
                task.pending.popleft()
                window.add(epoch, 0, 0, end=True, skipped=int(head.get("skipped", 0)))
                self._finish_epoch(task, epoch)
                continue
            assert outgoing is not None
            if epoch in task.finished:  # an abandoned epoch's leftovers
                task.pending.popleft()
                outgoing.taken.set()
                continue
            nbytes = sum(codec.nbytes(b) for b in outgoing.buffers)
            admitted, gone = window.room(nbytes, now)
            self._evicted(task, gone)
            if not admitted:
                break  # "block": retried from the loop until the lagging trainer moves
            stored = store(outgoing.buffers)
            outgoing.taken.set()
            task.pending.popleft()
            window.add(epoch, int(head["count"]), nbytes, stored,
                       skipped=int(head.get("skipped", 0)))
            if stored.name is not None:
                task.stored[stored.name] = stored
        self._fan_out(task)
        for producer in (task.producer, task.replayer):
            if producer is not None:
                self._permit(task, producer)

    def _fan_out(self, task: _Task) -> None:
        window = task.window
        assert window is not None
        for stream in list(task.streams.values()):
            cursor = window.cursors.get(stream.identity)
            if cursor is None or cursor.done or cursor.replaying:
                continue
            while cursor.credits > 0 or cursor.end is not None:
                entry = cursor.end or window.next_for(cursor)
                if entry is None:
                    break
                cursor.end = None
                cursor.seq = max(cursor.seq, entry.seq + 1)
                if entry.end:
                    if cursor.missed > 0:
                        cursor.replaying = True  # its replay's records go out now
                    else:
                        cursor.done = True
                        self._to_consumer(stream, Command.END, {
                            "epoch": entry.epoch, "skipped": entry.skipped,
                            "lagged": cursor.lagged})
                    break
                cursor.credits -= 1
                self._send_stored(stream, entry.epoch, entry.count, entry.skipped,
                                  entry.data, cursor.lagged)
        while task.replaying is not None and task.replay_pending and self._send_replay(task):
            pass

    def _send_stored(self, stream: _Stream, epoch: int, count: int, skipped: int,
                     stored: Stored, lagged: int) -> None:
        body: dict[str, Any] = {"epoch": epoch, "count": count, "skipped": skipped,
                                "ring": None, "lagged": lagged}
        self.elements += count
        self.bytes += stored.length
        if stream.ring is not None and stored.segment is not None:  # co-located
            body["segment"] = [stored.name, stored.length]
            body["shared"] = True
            stored.holders.add(stream.identity)
            self._to_consumer(stream, Command.DATA, body)
        else:
            self._to_consumer(stream, Command.DATA, body, stored.frames)

    def _send_replay(self, task: _Task) -> bool:
        """Send the replay's next record (or its end) to its trainer, once the trainer has
        reached the end of the epoch in the window; False: not yet."""
        assert task.window is not None
        epoch, outgoing, head = task.replay_pending[0]
        trainer, sent = task.replaying or (b"", 0)
        stream = task.streams.get(trainer)
        cursor = task.window.cursors.get(trainer)
        if stream is None or cursor is None:
            self._stop_replay(task)
            return False
        if not cursor.replaying:
            return False
        if head.get("end"):
            task.replay_pending.popleft()
            cursor.lagged += max(0, cursor.missed - sent)  # splits no longer on record
            cursor.done, cursor.replaying, cursor.missed = True, False, 0
            self._to_consumer(stream, Command.END, {"epoch": epoch,
                                                    "skipped": int(head.get("skipped", 0)),
                                                    "lagged": cursor.lagged,
                                                    "replayed": sent})
            self._stop_replay(task)
            self._maybe_produce(task)
            return False
        if cursor.credits <= 0:
            return False
        assert outgoing is not None
        task.replay_pending.popleft()
        cursor.credits -= 1
        task.replaying = (trainer, sent + int(head["count"]))
        self._send_record(stream, epoch, outgoing.buffers, head)
        outgoing.taken.set()
        return True

    def _stop_replay(self, task: _Task) -> None:
        if task.replayer is not None:
            task.replayer.stop.set()
            self._drop_link(task.replayer)
        task.replayer, task.replaying = None, None
        for _, outgoing, _ in task.replay_pending:
            if outgoing is not None:
                outgoing.taken.set()
        task.replay_pending.clear()

    def _permit(self, task: _Task, producer: Producer) -> None:
        """Let a producer of a shared job make as many records as trainers can take now:
        the main one as far as the readiest trainer, a replay as far as its trainer."""
        window = task.window
        assert window is not None
        if producer is task.replayer and task.replaying is not None:
            cursor = window.cursors.get(task.replaying[0])
            lead = cursor.credits if cursor is not None else 0
            queued = len(task.replay_pending)
            for _ in range(lead - queued - task.replay_outstanding):
                task.replay_outstanding += 1
                producer.pool.release()
        elif producer is task.producer and task.producing is not None:
            queued = len(task.pending)
            for _ in range(window.lead(task.producing) - queued - task.outstanding):
                task.outstanding += 1
                producer.pool.release()

    def _evicted(self, task: _Task, gone: list[Any]) -> None:
        for entry in gone:
            stored = entry.data
            if isinstance(stored, Stored):
                stored.evicted = True
                self._release_stored(task, stored)

    def _release_stored(self, task: _Task, stored: Stored) -> None:
        if stored.releasable:
            if stored.name is not None:
                task.stored.pop(stored.name, None)
            stored.free()

    def _mapped_shared(self, task: _Task, trainer: bytes, names: list[Any]) -> None:
        for name in names:
            stored = task.stored.get(name) if isinstance(name, str) else None
            if stored is not None:
                stored.holders.discard(trainer)
                self._release_stored(task, stored)

    def _trainers(self, task: _Task) -> dict[str, dict[str, int]]:
        """Each trainer's lag (elements produced here that it has not been sent yet) and
        the elements it lost to the lag policy, for ``zloader status``."""
        window = task.window
        assert window is not None
        out = {}
        for identity, cursor in window.cursors.items():
            stream = task.streams.get(identity)
            if stream is not None:
                lag = sum(e.count for e in window.entries if e.seq >= cursor.seq)
                out[stream.consumer] = {"lag": lag, "skipped": cursor.lagged}
        return out

    def _leave_shared(self, task: _Task, stream: _Stream) -> None:
        window = task.window
        assert window is not None
        window.leave(stream.identity)
        for stored in list(task.stored.values()):
            stored.holders.discard(stream.identity)
            self._release_stored(task, stored)
        if task.replaying is not None and task.replaying[0] == stream.identity:
            self._stop_replay(task)
        task.replays = deque(r for r in task.replays if r[0] != stream.identity)
        if not window.cursors:  # the last trainer left: free the window's memory
            self._evicted(task, window.clear())

    # --- coordinated reads (zloader/rounds.py) ---------------------------------------------

    def _deliver_rounds(self, task: _Task) -> None:
        """Group records N at a time; ask the broker to number each full group once every
        consumer has a credit for it (reserved now); an epoch's END goes out once the
        groups before it have. An epoch's last, incomplete group is dropped and counted."""
        while task.pending:
            epoch, outgoing, head = task.pending.popleft()
            if epoch in task.finished:  # an abandoned epoch's leftovers
                if outgoing is not None:
                    outgoing.taken.set()
                continue
            if head.get("end"):
                dropped = len(task.partial) if task.partial_epoch == epoch else 0
                self._discard(task.partial)
                end = {"epoch": epoch, "skipped": int(head.get("skipped", 0)),
                       "dropped": int(head.get("dropped", 0)) + dropped,
                       "rerun": task.reruns.get(epoch, 0)}
                task.groups.append(_Group(epoch, [], end=end))
                continue
            assert outgoing is not None
            if outgoing.gathered:  # it waits for its round: copy it, so the producer goes on
                outgoing.buffers = codec.joined(outgoing.buffers)
                outgoing.taken.set()
            if task.partial_epoch != epoch:
                self._discard(task.partial)
                task.partial_epoch = epoch
            task.partial.append(outgoing)
            if len(task.partial) == task.coordinated:
                task.groups.append(_Group(epoch, task.partial))
                task.partial = []
        for group in [g for g in task.groups if g.members is None and g.epoch in task.finished
                      and g.end is None]:  # an abandoned epoch's groups
            task.groups.remove(group)
            self._discard(group.records)
        for group in list(task.groups):
            if group.members is not None:
                continue  # asked for already
            if group.end is not None:
                if group is not task.groups[0]:
                    break  # after the rounds still waiting for their number
                task.groups.popleft()
                for stream in task.streams.values():
                    if stream.epoch == group.epoch:
                        self._to_consumer(stream, Command.END, group.end)
                self._finish_epoch(task, group.epoch)
                continue
            members = self._members(task, group.epoch)
            if members is None or min(s.credits for s in members) <= 0:
                break
            for stream in members:
                stream.credits -= 1
            group.members = [s.identity for s in members]
            self._to_broker(Command.ROUND_REQ, {"task": task.id, "epoch": group.epoch,
                                                "members": [s.consumer for s in members]})
        self._permit_rounds(task)

    def _numbered(self, task: _Task, epoch: int, number: int | None) -> None:
        """The broker numbered the oldest group asked for (or refused it: null): send its
        elements, one to each consumer, or give back the credits reserved for it."""
        group = task.groups[0] if task.groups else None
        if group is None or group.members is None or group.epoch != epoch:
            log.warning("a round number for epoch %d came with no group waiting", epoch)
            return
        task.groups.popleft()
        if number is None:
            self._unreserve(task, group)
        else:
            for record, identity in zip(group.records, group.members, strict=True):
                stream = task.streams.get(identity)
                if stream is not None:
                    self._send_record(stream, epoch, record.buffers,
                                      {"count": 1, "skipped": 0, "round": number})
        self._discard(group.records)
        self._deliver_rounds(task)

    def _ask_again(self, task: _Task) -> None:
        """The broker connection was replaced: answers to round requests sent on the old
        one are lost (and the broker lost those rounds), so ask for them again."""
        for group in task.groups:
            self._unreserve(task, group)
        self._deliver_rounds(task)

    @staticmethod
    def _unreserve(task: _Task, group: _Group) -> None:
        """Give back the credits reserved for a group whose number will not come (a
        re-opened stream has fresh credits already)."""
        for identity in group.members or ():
            stream = task.streams.get(identity)
            if stream is not None and stream.epoch == group.epoch:
                stream.credits += 1
        group.members = None

    @staticmethod
    def _discard(records: list[Outgoing]) -> None:
        for record in records:
            record.taken.set()
        records.clear()

    def _members(self, task: _Task, epoch: int | None) -> list[_Stream] | None:
        """The streams of consumers 0..N-1 reading ``epoch`` (the latest to open for an
        index), or None while one is missing."""
        by_index: dict[int, _Stream] = {}
        for stream in task.streams.values():
            if stream.epoch == epoch and stream.index is not None:
                by_index[stream.index] = stream
        if len(by_index) < task.coordinated:
            return None
        return [by_index[i] for i in range(task.coordinated)]

    def _permit_rounds(self, task: _Task) -> None:
        """Let the producer make as many records as the consumers have credits for rounds:
        N per round, the fewest credits of the N deciding."""
        producer = task.producer
        if producer is None or task.producing is None:
            return
        members = self._members(task, task.producing)
        rounds = min(s.credits for s in members) if members else 0
        waiting = sum(1 for g in task.groups if g.members is None and g.end is None)
        queued = len(task.partial) + task.coordinated * waiting + len(task.pending)
        for _ in range(task.coordinated * rounds - queued - task.outstanding):
            task.outstanding += 1
            producer.pool.release()

    # --- consumers ------------------------------------------------------------------------

    def _from_consumer(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            msg = decode(frames[1:])
            self._handle_consumer(identity, msg)
        except ProtocolError as exc:
            self._reject(f"dropped a malformed message from consumer {identity.hex()} on "
                         f"the data socket: {exc}")
            with contextlib.suppress(zmq.ZMQError):
                self.data.send_multipart([identity, *encode(Command.ERROR,
                                                            {"message": str(exc)})],
                                         zmq.NOBLOCK)
        except Exception:  # a bug must not stop the worker: log it, drop the message
            self._reject(f"failed on a message from consumer {identity.hex()}", exc_info=True)

    def _handle_consumer(self, identity: bytes, msg: Message) -> None:
        task = self.task
        if msg.command is Command.OPEN:
            if task is None or msg.field("job", str) != task.job \
                    or msg.body.get("task") not in (None, task.id):
                # The consumer may hear of this worker's task before the worker does: keep
                # the OPEN until the TASK arrives (bounded; the oldest are dropped). An OPEN
                # for another task of the same job never reaches this one: the broker
                # dropped this worker meanwhile and re-queued what this task holds.
                self.early_opens.append((identity, msg))
                return
            epoch = msg.field("epoch", int)
            if msg.payload and epoch not in task.inputs:
                task.inputs[epoch] = codec.decode([f.buffer for f in msg.payload])
                for old in [e for e in task.inputs if e < epoch - 1]:
                    del task.inputs[old]
            stream = task.streams.get(identity)
            if stream is None:
                stream = _Stream(identity, msg.field("consumer", str), epoch)
                task.streams[identity] = stream
                ring = msg.field("ring", str, optional=True)
                if ring is not None:
                    stream.ring = _attach_ring(ring)
            if task.coordinated:
                if stream.consumer in task.replaced:
                    self._remove_stream(task, stream)
                    raise ProtocolError(f"consumer {stream.consumer} was taken over by "
                                        "another with its consumer_index")
                index = msg.field("consumer_index", int)
                if not 0 <= index < task.coordinated:
                    raise ProtocolError(f"OPEN: consumer_index {index} out of range")
                stream.index = index
            if task.window is not None:
                self._open_shared(task, stream, epoch, msg.field("credits", int))
                return
            self._drop_credits(task, stream)
            stream.epoch = epoch
            self._abandon_stale(task)
            self._add_credits(task, stream, msg.field("credits", int))
            rerun = msg.body.get("rerun", 0)
            if isinstance(rerun, int) and rerun > task.reruns.get(epoch, 0):
                # A rerun of a finished epoch: a dead worker's splits wait to be read.
                task.reruns[epoch] = rerun
                if epoch != task.producing:
                    task.finished.discard(epoch)
            elif epoch in task.finished and epoch != task.producing:
                self._to_consumer(stream, Command.END, {"epoch": epoch, "skipped": 0,
                                                        "rerun": task.reruns.get(epoch, 0)})
            self._maybe_produce(task)
            self._deliver(task)
        elif msg.command is Command.CREDIT:
            stream = task.streams.get(identity) if task else None
            if task is not None and stream is not None:
                mapped = msg.field("mapped", list, optional=True) or []
                self._unlink_handoffs(stream, mapped)
                if task.window is not None:
                    self._mapped_shared(task, identity, mapped)
                if msg.field("epoch", int) == stream.epoch:
                    self._add_credits(task, stream, msg.field("credits", int))
                    self._deliver(task)
        elif msg.command is Command.RING:
            stream = task.streams.get(identity) if task else None
            if stream is not None:
                if stream.ring is not None:
                    stream.ring.close()
                stream.ring = _attach_ring(msg.field("ring", str))
        elif msg.command is Command.CLOSE:
            if task is not None and identity in task.streams:
                self._remove_stream(task, task.streams[identity])
        else:
            raise ProtocolError(f"{msg.command.name} is not a data-socket command")

    def _abandon_stale(self, task: _Task) -> None:
        """Stop producing an epoch no consumer reads any more (one left it early, e.g.
        after a ``take``), so the next epoch can start; in a coordinated job, as soon as
        one consumer has left it."""
        producing = task.producing
        if producing is None:
            return
        left = task.coordinated and any(s.index is not None and s.epoch > producing
                                        for s in task.streams.values())
        if not left and any(s.epoch == producing for s in task.streams.values()):
            return
        # A coordinated consumer left the epoch: its rounds can no longer be complete, so
        # the epoch ends here for the others too (the broker loses its open rounds).
        for stream in task.streams.values():
            if stream.epoch == producing:
                self._to_consumer(stream, Command.END, {"epoch": producing, "skipped": 0,
                                                        "rerun": task.reruns.get(producing, 0)})
        if task.producer is not None:
            task.producer.stop.set()  # it exits at its next send or split request
            self._drop_link(task.producer)
        task.finished.add(producing)
        task.producing = None
        task.producer = None

    def _add_credits(self, task: _Task, stream: _Stream, credits: int) -> None:
        credits = max(0, min(credits, 1 << 16))
        if task.coordinated:  # production follows the rounds the consumers can take
            stream.credits += credits
            self._permit_rounds(task)
            return
        if task.window is not None:  # production follows the window (_permit)
            cursor = task.window.cursors.get(stream.identity)
            if cursor is not None:
                cursor.credits += credits
            return
        stream.credits += credits
        for _ in range(credits):
            task.credit_pool.release()

    def _drop_credits(self, task: _Task, stream: _Stream) -> None:
        if task.window is not None or task.coordinated:
            stream.credits = 0
            return
        for _ in range(stream.credits):
            if not task.credit_pool.acquire(blocking=False):
                break
        stream.credits = 0

    def _remove_stream(self, task: _Task, stream: _Stream) -> None:
        if task.window is not None:
            self._leave_shared(task, stream)
        self._drop_credits(task, stream)
        self._unlink_handoffs(stream)
        task.streams.pop(stream.identity, None)
        if stream.ring is not None:
            stream.ring.close()

    def _drop_consumer(self, consumer: str) -> None:
        task = self.task
        if task is None:
            return
        for stream in [s for s in task.streams.values() if s.consumer == consumer]:
            self._remove_stream(task, stream)
        sweep()  # a consumer that died cannot unlink its rings: remove them for it

    def _to_consumer(self, stream: _Stream, command: Command, body: dict[str, Any],
                     payload: list[Any] | tuple[Any, ...] = ()) -> None:
        try:
            self.data.send_multipart([stream.identity, *encode(command, body, payload)],
                                     zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to consumer %s: %s", command.name, stream.consumer,
                        exc)


def _assignment(msg: Message) -> dict[str, Any]:
    """The checked ``origin``, ``skip`` and ``expect`` of an exactly-once job's SPLIT.

    Raises:
        ProtocolError: one is malformed.
    """
    origin = msg.field("origin", list)
    if not origin or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0
                             for k in origin):
        raise ProtocolError("SPLIT.origin must be a pass key")
    skip = msg.body.get("skip", "")
    try:
        unpack(skip)
    except ValueError as exc:
        raise ProtocolError(f"SPLIT.skip: {exc}") from None
    expect = msg.body.get("expect")
    if expect is not None and not (isinstance(expect, list) and len(expect) == 2
                                   and all(isinstance(v, int) for v in expect)):
        raise ProtocolError("SPLIT.expect must be [count, digest]")
    return {"origin": origin, "skip": skip, "expect": expect}


def _attach_ring(name: str) -> Any:
    try:
        return RingWriter(name)
    except FileNotFoundError:  # the consumer closed before this OPEN was read: not a fault
        log.debug("ring %s is gone: its consumer has left", name)
        return None
    except (OSError, ValueError) as exc:
        log.warning("cannot attach ring %s (%s): sending over the socket instead", name, exc)
        return None
