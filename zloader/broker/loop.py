"""The broker loop: one ROUTER socket, one thread, all state in
:class:`zloader.broker.state.State`; each command goes to its entry in :data:`HANDLERS`.

It never touches element data. Run it with ``zloader-broker`` or, embedded, as a thread of
the Loader's process (:meth:`Broker.start`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from zloader._defaults import (
    AUTOSCALE_COOLDOWN,
    BROKER_BEATS_AT_ONCE,
    BROKER_POLL_SECONDS,
    BROKER_TURN_SECONDS,
    CLOSE_SECONDS,
    HANDSHAKE_SECONDS,
    HEARTBEAT,
    MAX_MESSAGE_BYTES,
    START_TIMEOUT,
)
from zloader.broker.descriptors import Descriptors
from zloader.broker.journal import Journal
from zloader.broker.records import Limits
from zloader.broker.state import Out, State
from zloader.transport import messages
from zloader.transport.keys import Keys
from zloader.transport.messages import Bye, Error, Heartbeat, Record, Status, Unknown
from zloader.transport.protocol import (
    Command,
    Message,
    ProtocolError,
    VersionMismatch,
    decode,
    encode,
)
from zloader.transport.sockets import make_socket

__all__ = ["Broker"]

log = logging.getLogger("zloader.broker")

_FROM_ANYONE = {Command.READY, Command.REGISTER, Command.STATUS}

Handler = Callable[[State, bytes, Any, float], list[Out]]
"""Takes the state, the sender's identity, the record of its message (the one of its
command, zloader/transport/messages.py) and the time; returns what to send."""


def _status(state: State, identity: bytes, msg: Status, now: float) -> list[Out]:
    """One page of the broker's status, from the request's ``from`` (the last page's
    ``next``; none: the first). An actuator's request names it (``actuator``): its cap
    counts in the fleet's (broker/status.py)."""
    if "actuator" in msg.report:
        state.note_actuator(msg.report["actuator"], now)
    return [Out(identity, Status(report=state.status(now, msg.report.get("from"))))]


def _heartbeat(state: State, identity: bytes, msg: Heartbeat, now: float) -> list[Out]:
    """A worker's or a consumer's: each record notes what concerns it."""
    return state.worker_heartbeat(identity, msg, now) + state.consumer_heartbeat(identity, now,
                                                                                 msg)


def _bye(state: State, identity: bytes, msg: Bye, now: float) -> list[Out]:
    return state.bye(identity, now, msg.left)


HANDLERS: dict[Command, Handler] = {
    Command.READY: State.worker_ready,
    Command.REGISTER: State.register,
    Command.STATUS: _status,
    Command.HEARTBEAT: _heartbeat,
    Command.SPLIT_REQ: State.split_request,
    Command.PASS_DONE: State.pass_done,
    Command.WEIGHED: State.weighed,
    Command.TASK_FAILED: State.task_failed,
    Command.BYE: _bye,
    Command.EPOCH: State.epoch_started,
    Command.ROUND_REQ: State.round_request,
    Command.RECEIVED: State.rounds_received,
    Command.DELIVERED: State.delivered,
    Command.LOG: State.worker_log,
}
"""One entry per command the broker accepts (docs/protocol.md)."""


class Broker:
    """A broker bound at ``endpoint``.

    Args:
        endpoint: where to bind, e.g. ``tcp://127.0.0.1:5555`` or ``ipc:///path``.
        heartbeat: seconds between heartbeats; a peer silent for 3 of them is dead.
        keys: CURVE keys (:mod:`zloader.transport.keys`): only peers holding an authorized
            key get in. None: no authentication.
        work_dir: journal every state change there (:mod:`zloader.broker.journal`) and, when it
            holds one already, resume its jobs. None: state lives in memory only (a
            restarted broker starts its jobs over).
        metrics: (bind address, port) of the Prometheus endpoint; None: none.
        cooldown: seconds the autoscaler (``zloader/broker/autoscale.py``) samples a job's
            starvation between two changes of its ``desired_workers``.
        limits: the jobs and pipeline bytes peers may make it hold (``records.Limits``,
            docs/reliability.md "Floods"); None: the defaults.
    """

    def __init__(self, endpoint: str, heartbeat: float = HEARTBEAT, keys: Keys | None = None,
                 work_dir: str | None = None, metrics: tuple[str, int] | None = None,
                 cooldown: float = AUTOSCALE_COOLDOWN, limits: Limits | None = None) -> None:
        self.endpoint = endpoint
        self.metrics = metrics  # (bind address, port) of the Prometheus endpoint
        self.snapshot: dict[str, Any] = {}  # the latest State.metrics(), read by scrapes
        self.keys = keys
        self.state = State(heartbeat=heartbeat,
                           journal=Journal(work_dir) if work_dir is not None else None,
                           cooldown=cooldown, limits=limits)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._warned = 0.0
        # A pipe whose byte wakes the loop's poll when it is closed (while it serves).
        self._waker: tuple[int, int] | None = None
        self._waker_lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT) -> Broker:
        """Run the loop on a background thread; returns once the socket is bound."""
        self._thread = threading.Thread(target=self._run_guarded, name="zloader-broker",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._failure is not None:
            self.close()
            raise RuntimeError(f"broker failed to start at {self.endpoint}: {self._failure}")
        return self

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Stop the loop and close the socket (safe to call twice)."""
        self._stop.set()
        with self._waker_lock:
            if self._waker is not None:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._waker[1], b"!")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            self._thread = None

    def _run_guarded(self) -> None:
        try:
            self.serve()
        except BaseException as exc:  # reported by start(); logged for the embedded case
            self._failure = exc
            self._ready.set()
            log.exception("broker loop failed")

    def serve(self) -> None:
        """Run the loop in this thread until :meth:`close` (or SIGTERM in the CLI)."""
        context = zmq.Context()
        guard = self.keys.guard(context) if self.keys is not None else None
        socket = make_socket(context, zmq.ROUTER, self.keys, serve=True,
                             max_bytes=MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # A connection that never finishes its handshake holds a descriptor until then.
        socket.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_SECONDS * 1000))
        waker = os.pipe()
        os.set_blocking(waker[1], False)
        with self._waker_lock:
            self._waker = waker
        try:
            socket.bind(self.endpoint)
            if self.endpoint.endswith(":0"):
                self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
            resumed = self.state.restore(time.monotonic())
            if resumed:
                log.info("resumed %d jobs from the journal in %s", resumed,
                         self.state.journal.root if self.state.journal else "")
            self.snapshot = self.state.metrics(time.monotonic())
            exporter = None
            if self.metrics is not None:
                from zloader.broker.metrics import serve as serve_metrics

                exporter = serve_metrics(lambda: self.snapshot, self.metrics[1],
                                         self.metrics[0])
            self._ready.set()
            try:
                self._loop(socket)
            finally:
                if exporter is not None:
                    exporter.shutdown()
                    exporter.server_close()
        finally:
            socket.close(0)
            if self.state.journal is not None:
                self.state.journal.close()
            if guard is not None:
                guard.stop()
            context.term()
            with self._waker_lock:
                self._waker = None
                for fd in waker:
                    os.close(fd)

    def _loop(self, socket: zmq.Socket[Any]) -> None:
        state = self.state
        descriptors = Descriptors(self.endpoint)
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        if self._waker is not None:
            poller.register(self._waker[0], zmq.POLLIN)  # (close() writes: stop now)
        next_beat = time.monotonic() + state.heartbeat
        beats: deque[Out] = deque()  # the workers' HEARTBEATs of this interval, not sent yet
        # On a thread of its own (a Loader's), close() wakes the poll: it waits for the next
        # message or beat. On the main thread (the CLI), SIGTERM only sets ``_stop``.
        longest = BROKER_POLL_SECONDS if threading.current_thread() is \
            threading.main_thread() else math.inf
        while not self._stop.is_set():
            timeout = max(0.0, min(next_beat - time.monotonic(), longest))
            if beats:
                self._send(socket, [beats.popleft()
                                    for _ in range(min(BROKER_BEATS_AT_ONCE, len(beats)))])
                timeout = 0.0
            if poller.poll(int(timeout * 1000)):
                # Drain what is queued, for BROKER_TURN_SECONDS at most: a flood must not
                # hold up the timer (the workers' heartbeats, the tick that places them).
                turn_ends = time.monotonic() + BROKER_TURN_SECONDS
                for _ in range(1000):
                    try:
                        frames = socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._send(socket, self._handle(frames, time.monotonic()))
                    if time.monotonic() > turn_ends:
                        break
            now = time.monotonic()
            if now >= next_beat:
                late = now - next_beat
                if late > state.heartbeat:  # the loop itself was stopped (see State.stalled)
                    log.warning("the broker did not run for %.1f s (stopped, or a long "
                                "pause): its peers' silence meanwhile is not held against "
                                "them", late)
                    state.stalled(late, now)
                next_beat = now + state.heartbeat
                out = state.tick(now) + state.heartbeats()
                # A worker's HEARTBEAT says only "the broker is alive": sent in slices
                # between the messages that come in, after whatever else the tick sends.
                self._send(socket, [o for o in out if o.command is not Command.HEARTBEAT])
                beats.clear()  # (any left from the last interval: this one supersedes)
                beats.extend(o for o in out if o.command is Command.HEARTBEAT)
                if self.metrics is not None:  # only a scrape reads it (a fleet's worth)
                    self.snapshot = state.metrics(now)
            self._send(socket, state.journal_errors())  # a full work dir: say so
            descriptors.check(now)  # (every DESCRIPTORS_CHECK_SECONDS)

    def _send(self, socket: zmq.Socket[Any], messages: list[Out]) -> None:
        """Send each message, its record encoded; one record sent to many peers (a job's
        view to its consumers, the heartbeat to every worker) is encoded once."""
        encoded: dict[int, list[Any]] = {}
        for out in messages:
            if out.payload:
                frames = encode(out.command, out.message.to_body(), out.payload)
            else:
                key = id(out.message)  # the records live as long as ``messages``
                frames = encoded.get(key) or encoded.setdefault(
                    key, encode(out.command, out.message.to_body()))
            try:
                socket.send_multipart([out.identity, *frames], zmq.NOBLOCK)
            except zmq.Again:
                log.warning("dropped %s to a peer whose queue is full", out.command.name)

    # --- dispatch -------------------------------------------------------------------------

    def _handle(self, frames: list[bytes], now: float) -> list[Out]:
        if len(frames) < 2:
            self._warn(b"", f"dropped a message of {len(frames)} frames")
            return []
        identity = frames[0]
        try:
            msg = decode(frames[1:])
        except VersionMismatch as exc:
            self._warn(identity, str(exc))
            return [Out(identity, Error(message=str(exc)))]
        except ProtocolError as exc:
            self._warn(identity, f"dropped a malformed message: {exc}")
            return []
        except Exception:  # decode turns everything into ProtocolError; never trust that
            self._warn(identity, "dropped an undecodable message", exc_info=True)
            return []
        try:
            return self._dispatch(identity, msg, now)
        except ProtocolError as exc:
            self._warn(identity, f"dropped a malformed {msg.command.name}: {exc}")
            return [Out(identity, Error(message=str(exc)))]
        except Exception:  # a bug must not stop the broker: log it, drop the message
            self._warn(identity, f"failed on a {msg.command.name}", exc_info=True)
            return []

    def _dispatch(self, identity: bytes, msg: Message, now: float) -> list[Out]:
        command = msg.command
        known = self.state.seen(identity, now)
        if not known and command not in _FROM_ANYONE:
            if command in (Command.BYE, Command.PASS_DONE):
                return []
            return [Out(identity, Unknown(reason="not registered"))]
        handler = HANDLERS.get(command)
        if handler is None:
            raise ProtocolError(f"{command.name} is not a command the broker accepts")
        record: Record = messages.decode(msg)  # ProtocolError: refused, see _handle
        return handler(self.state, identity, record, now)

    def _warn(self, identity: bytes, text: str, exc_info: bool = False) -> None:
        """Count a rejected message and log it with its peer, at most once a second (a
        flood of junk must not flood the log)."""
        self.state.rejected += 1
        now = time.monotonic()
        if now - self._warned >= 1.0:
            self._warned = now
            kind, peer = self.state.peers.get(identity, ("unregistered peer", identity.hex()))
            log.warning("%s (from %s %s; %d rejected so far)", text, kind, peer,
                        self.state.rejected, exc_info=exc_info)
