"""A worker process: registers with the broker, runs one task at a time, serves elements.

Threads: the main thread owns every socket (broker DEALER, data ROUTER, the inproc pair to
the producer) and moves messages; a producer thread runs the user's pipeline for one epoch
and hands finished records to the main thread, taking one credit per record, so memory stays
bounded by what consumers granted. See docs/protocol.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket as _socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import zmq

from zloader import codec
from zloader._host import host_id
from zloader.pipeline import Pipeline
from zloader.plan import Plan, plan
from zloader.producer import Outgoing, Producer
from zloader.sources import ArraysSource, ItemsSource
from zloader.transport import records
from zloader.transport.protocol import (
    Command,
    Message,
    ProtocolError,
    decode,
    encode,
    error_object,
)

__all__ = ["WorkerProcess"]

log = logging.getLogger("zloader.worker")

FETCH_TIMEOUT = 30.0


@dataclass
class _Stream:
    """One consumer reading this worker's task."""

    identity: bytes
    consumer: str
    epoch: int
    credits: int = 0
    ring: Any = None
    handoffs: dict[str, Any] = field(default_factory=dict)  # segments the consumer may map


@dataclass
class _Task:
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
    rounds: dict[int, int] = field(default_factory=dict)
    inputs: dict[int, Any] = field(default_factory=dict)  # epoch -> the consumer's input
    balanced: int = 0  # consumers to deal to one element at a time, round-robin (0: off)
    turn: int = 0
    pending: deque[tuple[int, Outgoing | None, dict[str, Any]]] = field(default_factory=deque)


class WorkerProcess:
    """One worker: the sockets, the loop and the current task.

    Args:
        broker: the broker endpoint.
        bind: where the data socket binds (``tcp://HOST:*`` or ``ipc://PATH``).
        advertise: the host name consumers should connect to for TCP endpoints.
        prefer: a job to serve first (the Loader that started this worker).
        parent: exit when this process id is no longer our parent (embedded workers).
        heartbeat: seconds between heartbeats.
    """

    def __init__(self, broker: str, bind: str, advertise: str | None = None,
                 prefer: str | None = None, parent: int | None = None,
                 heartbeat: float = 1.0) -> None:
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
        self.early_opens: deque[tuple[bytes, Message]] = deque(maxlen=64)
        self._last_from_broker = time.monotonic()
        self._last_to_broker = 0.0

    # --- sockets --------------------------------------------------------------------------

    def run(self) -> None:
        context = zmq.Context()
        self.context = context
        data = context.socket(zmq.ROUTER)
        data.setsockopt(zmq.LINGER, 0)
        data.bind(self.bind)
        endpoint = data.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.advertise and endpoint.startswith("tcp://"):
            endpoint = f"tcp://{self.advertise}:{endpoint.rsplit(':', 1)[1]}"
        self.endpoint = endpoint
        self.data = data
        self.pair: zmq.Socket[Any] | None = None  # to the current producer
        self.outbox: deque[Outgoing] = deque()  # that producer's records
        self._pairs = 0
        self.poller = zmq.Poller()
        self.broker = self._connect_broker()
        try:
            self._loop()
        finally:
            self._stop_task()
            with contextlib.suppress(zmq.ZMQError):
                self._to_broker(Command.BYE, {})
            self._drop_pair()
            for sock in (self.broker, data):
                sock.close(0)
            context.term()

    def _connect_broker(self) -> zmq.Socket[Any]:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.broker_endpoint)
        self.broker = sock
        self._ready()
        self._last_from_broker = time.monotonic()
        return sock

    def _ready(self) -> None:
        """(Re-)register with the broker."""
        self._to_broker(Command.READY, {
            "worker": self.id, "host": _socket.gethostname(), "host_id": host_id(),
            "pid": os.getpid(), "endpoint": self.endpoint, "prefer": self.prefer})

    def _to_broker(self, command: Command, body: dict[str, Any]) -> None:
        self.broker.send_multipart(encode(command, body), zmq.NOBLOCK)
        self._last_to_broker = time.monotonic()

    def _loop(self) -> None:
        poller = self.poller
        poller.register(self.data, zmq.POLLIN)
        poller.register(self.broker, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(100):
                for _ in range(256):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if sock is self.data:
                        self._from_consumer(frames)
                    elif sock is self.broker:
                        self._from_broker(frames)
                    elif sock is self.pair:
                        self._from_producer(frames)
                    else:
                        break  # a dropped producer's pair: ignore
            now = time.monotonic()
            if now - self._last_to_broker >= self.heartbeat:
                self._to_broker(Command.HEARTBEAT, {"stats": {
                    "elements": self.elements, "bytes": self.bytes,
                    "fallbacks": self.fallbacks}})
            if now - self._last_from_broker > 3 * self.heartbeat:
                log.warning("no word from the broker at %s for %.0f s: reconnecting",
                            self.broker_endpoint, now - self._last_from_broker)
                poller.unregister(self.broker)
                self.broker.close(0)
                poller.register(self._connect_broker(), zmq.POLLIN)
            if self.parent is not None and os.getppid() != self.parent:
                log.warning("parent process %d is gone: exiting", self.parent)
                return

    # --- broker ---------------------------------------------------------------------------

    def _from_broker(self, frames: list[zmq.Frame]) -> None:
        self._last_from_broker = time.monotonic()
        try:
            msg = decode(frames)
            self._handle_broker(msg)
        except ProtocolError as exc:
            log.warning("dropped a malformed message from the broker: %s", exc)

    def _handle_broker(self, msg: Message) -> None:
        command = msg.command
        if command is Command.TASK:
            self._start_task(msg)
        elif command is Command.SPLIT:
            task = self.task
            if task is not None and msg.field("task", str) == task.id and self.pair:
                split = msg.field("split", int, optional=True)
                with contextlib.suppress(zmq.Again):
                    self.pair.send(json.dumps({"pass": msg.field("pass", list),
                                               "split": split}).encode(), zmq.NOBLOCK)
        elif command is Command.RELEASE:
            if self.task is not None and msg.field("task", str) == self.task.id:
                self._stop_task()
        elif command is Command.CONSUMER_GONE:
            self._drop_consumer(msg.field("consumer", str))
        elif command is Command.UNKNOWN:
            self._ready()
        elif command is Command.ERROR:
            log.error("broker refused a message: %s", msg.body.get("message"))

    def _start_task(self, msg: Message) -> None:
        task_id = msg.field("task", str)
        if self.task is not None:
            self._stop_task()
        try:
            if not msg.payload:
                raise ProtocolError("TASK without a pipeline")
            pipeline = cloudpickle.loads(msg.payload[0].buffer)
            if not isinstance(pipeline, Pipeline):
                raise TypeError(f"the task's pipeline is a {type(pipeline).__name__}")
            source_data = msg.field("source_data", dict, optional=True)
            if source_data is not None:
                pipeline = self._fetch_source(pipeline, source_data)
            self.task = _Task(task_id, msg.field("job", str), plan(pipeline),
                              msg.field("sharding", str), msg.field("index", int),
                              msg.field("width", int), str(msg.body.get("on_error", "raise")),
                              msg.field("entropy", int),
                              balanced=max(0, int(msg.body.get("balanced") or 0)))
            early, self.early_opens = list(self.early_opens), deque(maxlen=64)
            for identity, opened in early:
                if opened.body.get("job") == self.task.job:
                    self._handle_consumer(identity, opened)
        except ProtocolError:
            raise
        except Exception as exc:
            log.exception("task %s could not start", task_id)
            error = error_object(exc)
            error["stage"] = "worker start-up"
            error["message"] = (f"the pipeline could not be loaded on worker pid {os.getpid()}"
                                f": {error['message']} (install the packages it imports on "
                                "every worker host)")
            self._to_broker(Command.TASK_FAILED, {"task": task_id, "error": error})

    def _fetch_source(self, pipeline: Pipeline, where: dict[str, Any]) -> Pipeline:
        """Get a large in-memory source's data from the Loader that holds it."""
        endpoint = where.get("endpoint")
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(str(endpoint))
            sock.send_multipart(encode(Command.FETCH, {}))
            if not sock.poll(int(FETCH_TIMEOUT * 1000)):
                raise TimeoutError(f"the Loader holding this job's in-memory source at "
                                   f"{endpoint} did not answer within {FETCH_TIMEOUT:.0f} s")
            reply = decode(sock.recv_multipart(copy=False))
        finally:
            sock.close(0)
        if reply.command is not Command.SOURCE or not reply.payload:
            raise ProtocolError("the Loader answered FETCH without source data")
        source = pipeline.source
        if where.get("kind") == "arrays" and isinstance(source, ArraysSource):
            structure = codec.decode([frame.buffer for frame in reply.payload])
            return Pipeline(dataclasses.replace(source, structure=structure), pipeline.stages)
        if where.get("kind") == "items" and isinstance(source, ItemsSource):
            items = cloudpickle.loads(reply.payload[0].buffer)
            return Pipeline(dataclasses.replace(source, items=tuple(items)), pipeline.stages)
        raise ProtocolError(f"source data of kind {where.get('kind')!r} does not fit a "
                            f"{type(source).__name__}")

    def _stop_task(self) -> None:
        task, self.task = self.task, None
        if task is None:
            return
        if task.producer is not None:
            task.producer.stop.set()
            task.producer.join(2.0)
        self._drop_pair()
        for stream in task.streams.values():
            self._unlink_handoffs(stream)
            if stream.ring is not None:
                stream.ring.close()

    # --- producer -------------------------------------------------------------------------

    def _from_producer(self, frames: list[zmq.Frame]) -> None:
        task = self.task
        kind = frames[0].bytes
        if task is None:
            return
        if kind == b"S":
            self._to_broker(Command.SPLIT_REQ, {"task": task.id,
                                                "pass": json.loads(frames[1].bytes)})
        elif kind == b"P":
            self._to_broker(Command.PASS_DONE, {"task": task.id,
                                                "pass": json.loads(frames[1].bytes)})
        elif kind == b"R":
            head = json.loads(frames[1].bytes)
            task.pending.append((head["epoch"], self.outbox.popleft(), head))
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
                for stream in streams:
                    self._to_consumer(stream, Command.END, {"epoch": epoch,
                                                            "skipped": head["skipped"]})
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
        size = sum(codec.nbytes(f) for f in frames)
        self.elements += head["count"]
        self.bytes += size
        if stream.ring is not None:
            packed = records.packed_size(frames)
            if packed > stream.ring.capacity and self._send_segment(stream, body, frames, packed):
                return
            slot = stream.ring.reserve(packed)
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
        from zloader.transport.shm import Segment, ShmError

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
            task.producer = None
        self._maybe_produce(task)

    def _maybe_produce(self, task: _Task) -> None:
        if task.producing is not None:
            return
        wanted = sorted({s.epoch for s in task.streams.values()} - task.finished)
        if not wanted:
            return
        epoch = wanted[0]
        self._drop_pair()
        self._pairs += 1
        address = f"inproc://producer-{self.id}-{self._pairs}"
        self.pair = self.context.socket(zmq.PAIR)
        self.pair.setsockopt(zmq.LINGER, 0)
        self.pair.bind(address)
        self.poller.register(self.pair, zmq.POLLIN)
        task.producing = epoch
        task.producer = Producer(self.context, address, task, epoch)
        self.outbox = task.producer.outbox
        task.producer.start()

    def _drop_pair(self) -> None:
        if self.pair is not None:
            self.poller.unregister(self.pair)
            self.pair.close(0)
            self.pair = None

    # --- consumers ------------------------------------------------------------------------

    def _from_consumer(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            msg = decode(frames[1:])
            self._handle_consumer(identity, msg)
        except ProtocolError as exc:
            log.warning("dropped a malformed message on the data socket: %s", exc)
            with contextlib.suppress(zmq.ZMQError):
                self.data.send_multipart([identity, *encode(Command.ERROR,
                                                            {"message": str(exc)})],
                                         zmq.NOBLOCK)

    def _handle_consumer(self, identity: bytes, msg: Message) -> None:
        task = self.task
        if msg.command is Command.OPEN:
            if task is None or msg.field("job", str) != task.job:
                # The consumer may hear of this worker's task before the worker does: keep
                # the OPEN until the TASK arrives (bounded; the oldest are dropped).
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
            self._drop_credits(task, stream)
            stream.epoch = epoch
            self._abandon_stale(task)
            self._add_credits(task, stream, msg.field("credits", int))
            round_ = msg.body.get("round", 0)
            if isinstance(round_, int) and round_ > task.rounds.get(epoch, 0):
                # Another round of a finished epoch: a dead worker's splits wait to be read.
                task.rounds[epoch] = round_
                if epoch != task.producing:
                    task.finished.discard(epoch)
            elif epoch in task.finished and epoch != task.producing:
                self._to_consumer(stream, Command.END, {"epoch": epoch, "skipped": 0})
            self._maybe_produce(task)
            self._deliver(task)
        elif msg.command is Command.CREDIT:
            stream = task.streams.get(identity) if task else None
            if task is not None and stream is not None:
                self._unlink_handoffs(stream, msg.field("mapped", list, optional=True) or [])
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
        after a ``take``), so the next epoch can start."""
        producing = task.producing
        if producing is None or any(s.epoch == producing for s in task.streams.values()):
            return
        if task.producer is not None:
            task.producer.stop.set()  # it exits at its next send or split request
        self._drop_pair()
        task.finished.add(producing)
        task.producing = None
        task.producer = None

    def _add_credits(self, task: _Task, stream: _Stream, credits: int) -> None:
        credits = max(0, min(credits, 1 << 16))
        stream.credits += credits
        for _ in range(credits):
            task.credit_pool.release()

    def _drop_credits(self, task: _Task, stream: _Stream) -> None:
        for _ in range(stream.credits):
            if not task.credit_pool.acquire(blocking=False):
                break
        stream.credits = 0

    def _remove_stream(self, task: _Task, stream: _Stream) -> None:
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
        from zloader.transport.shm import sweep

        sweep()  # a consumer that died cannot unlink its rings: remove them for it

    def _to_consumer(self, stream: _Stream, command: Command, body: dict[str, Any],
                     payload: list[Any] | tuple[Any, ...] = ()) -> None:
        try:
            self.data.send_multipart([stream.identity, *encode(command, body, payload)],
                                     zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to consumer %s: %s", command.name, stream.consumer,
                        exc)


def _attach_ring(name: str) -> Any:
    from zloader.transport.ring import RingWriter

    try:
        return RingWriter(name)
    except FileNotFoundError:  # the consumer closed before this OPEN was read: not a fault
        log.debug("ring %s is gone: its consumer has left", name)
        return None
    except (OSError, ValueError) as exc:
        log.warning("cannot attach ring %s (%s): sending over the socket instead", name, exc)
        return None
