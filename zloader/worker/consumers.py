"""The worker's data socket, the consumers' side of it: OPEN, CREDIT, RING, WEIGHTS,
DISPATCH and CLOSE in (checked, then handed to the task), records out through its
:class:`~zloader.worker.streams.Outlet`. See docs/protocol.md, "Data socket"."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from zloader._defaults import EARLY_OPENS, MAX_DATA_FRAME_BYTES
from zloader.transport import messages
from zloader.transport.keys import Keys
from zloader.transport.protocol import (
    Command,
    Message,
    ProtocolError,
    decode,
    encode,
)
from zloader.transport.sockets import make_socket
from zloader.worker.streams import Outlet
from zloader.worker.task import Task

__all__ = ["EARLY_OPENS", "DataPort"]

DATA_SOCKET_COMMANDS = frozenset({Command.OPEN, Command.CREDIT, Command.RING, Command.CLOSE,
                                  Command.WEIGHTS, Command.DISPATCH})
"""What consumers send on a worker's data socket."""


class DataPort:
    """The data socket (ROUTER), bound, and what consumers send on it.

    Args:
        context: the worker's ZeroMQ context.
        bind: where it binds (``tcp://HOST:*`` or ``ipc://PATH``).
        advertise: the host name consumers should connect to for TCP endpoints.
        keys: CURVE keys, or None.
        plain_data: with keys, PLAIN (a token, no encryption) instead of CURVE.
        reject: counts and logs a dropped message (``text``, ``exc_info``).
    """

    def __init__(self, context: zmq.Context[Any], bind: str, advertise: str | None,
                 keys: Keys | None, plain_data: bool,
                 reject: Callable[..., None]) -> None:
        sock = make_socket(context, zmq.ROUTER, keys, serve=True, plain=plain_data,
                           max_bytes=MAX_DATA_FRAME_BYTES)
        sock.bind(bind)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if advertise and endpoint.startswith("tcp://"):
            endpoint = f"tcp://{advertise}:{endpoint.rsplit(':', 1)[1]}"
        self.endpoint = endpoint  # where consumers reach it
        self.sock = sock
        self.reject = reject
        self.outlet = Outlet(sock, reject)
        self.early_opens: deque[tuple[bytes, messages.Open, list[Any]]] = \
            deque(maxlen=EARLY_OPENS)
        # DISPATCHes that followed an early OPEN, by consumer, until the task arrives
        self.early_dispatches: dict[bytes, list[messages.Dispatch]] = {}
        self.begun: deque[str] = deque(maxlen=EARLY_OPENS)  # the latest tasks run here
        # ... those of them that handed their splits on: the epochs handed, by task
        self.handed: dict[str, set[int]] = {}

    def receive(self, frames: list[zmq.Frame], task: Task | None) -> None:
        """One message from a consumer: a malformed one is answered with ERROR and
        dropped; a failure handling it is logged, never raised."""
        identity = frames[0].bytes
        try:
            msg = decode(frames[1:])
            self.handle(identity, msg, task)
        except ProtocolError as exc:
            self.reject(f"dropped a malformed message from consumer {identity.hex()} on "
                        f"the data socket: {exc}")
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send_multipart([identity, *encode(Command.ERROR,
                                                            {"message": str(exc)})],
                                         zmq.NOBLOCK)
        except Exception:  # a bug must not stop the worker: log it, drop the message
            self.reject(f"failed on a message from consumer {identity.hex()}", exc_info=True)

    def handle(self, identity: bytes, msg: Message, task: Task | None) -> None:
        """Hand a consumer's message to ``task`` (the one this worker runs).

        Raises:
            ProtocolError: it is malformed, or not a data-socket command.
        """
        if msg.command not in DATA_SOCKET_COMMANDS:
            raise ProtocolError(f"{msg.command.name} is not a data-socket command")
        record = messages.decode(msg)
        if isinstance(record, messages.Open):
            if record.task is not None and record.task in self.handed \
                    and (task is None or task.id != record.task):
                self._handed_end(identity, record)
                return
            if task is None or record.job != task.job or record.task not in (None, task.id):
                # The consumer may hear of this worker's task before the worker does: keep
                # the OPEN until the TASK arrives (bounded; the oldest are dropped). An OPEN
                # for another task of the same job never reaches this one: the broker
                # dropped this worker meanwhile and re-queued what this task holds. Nor
                # does one for a task that ran here (task ids are never used again).
                if record.task not in self.begun:
                    self.early_opens.append((identity, record, msg.payload))
                return
            task.open(identity, record, msg.payload)
        elif task is None:
            if isinstance(record, messages.Dispatch):
                self._keep_dispatch(identity, record)
        elif isinstance(record, messages.Credit):
            task.credit(identity, record)
        elif isinstance(record, messages.Ring):
            task.ring(identity, record)
        elif isinstance(record, messages.Weights):
            task.weights.offer(record.weights, record.stamp)
        elif isinstance(record, messages.Dispatch):
            if identity in task.streams:  # only from a consumer that opened an epoch here
                task.dispatch(identity, record)
            else:
                self._keep_dispatch(identity, record)
        elif isinstance(record, messages.Close) and identity in task.streams:
            task.remove_stream(task.streams[identity])

    def stopped(self, task: str, handed: set[int] | None) -> None:
        """``task`` ended here; ``handed``: the epochs of what it handed on (a shared
        job's task that drained), None if nothing (see :meth:`_handed_end`). The OPENs
        kept for it (it drained before it began) are answered now."""
        if handed is None:
            return
        self.handed[task] = handed
        while len(self.handed) > EARLY_OPENS:
            del self.handed[next(iter(self.handed))]
        kept = [early for early in self.early_opens if early[1].task == task]
        if kept:
            self.early_opens = deque((e for e in self.early_opens if e[1].task != task),
                                     maxlen=EARLY_OPENS)
            for identity, opened, _ in kept:
                self._handed_end(identity, opened)

    def _handed_end(self, identity: bytes, opened: messages.Open) -> None:
        """An OPEN for a task that handed its splits on and ended here: it came after the
        handover (it crossed it, then the task ended). Its END names the task for an epoch
        it handed on: the worker that took them makes them again for this trainer, and
        names the task in its END, which the trainer waits for (SharedDelivery.open
        answers such an OPEN so while the task still runs)."""
        handed = opened.task if opened.epoch in self.handed.get(opened.task or "", ()) \
            else None
        end = messages.End(epoch=opened.epoch, handed=handed)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart([identity, *encode(Command.END, messages.encode(end))],
                                     zmq.NOBLOCK)

    def _keep_dispatch(self, identity: bytes, record: messages.Dispatch) -> None:
        """A DISPATCH from a consumer whose OPEN waits for its task (see
        :meth:`handle`): kept for it (at most ``EARLY_OPENS`` per consumer), else
        dropped."""
        waiting = self._waiting()
        for gone in [k for k in self.early_dispatches if k not in waiting]:
            del self.early_dispatches[gone]  # its OPEN was pushed out: so are they
        if identity not in waiting:
            return
        kept = self.early_dispatches.setdefault(identity, [])
        if len(kept) >= EARLY_OPENS:
            self.reject(f"dropped a DISPATCH from consumer {identity.hex()}: more than "
                        f"{EARLY_OPENS} came before its task started")
            return
        kept.append(record)

    def _waiting(self) -> set[bytes]:
        """The consumers whose OPEN is kept for a task not started yet."""
        return {identity for identity, _, _ in self.early_opens}

    def begin(self, task: Task) -> None:
        """A task starts: the OPENs that came for it before it did are handled now, then
        the DISPATCHes that followed them. Those for a task of another job stay, with
        theirs: the broker may start a task of another job here first (its consumer left
        at once), and the OPEN of a task that comes later is sent once. Those for another
        task of this job are dropped (see :meth:`handle`)."""
        self.begun.append(task.id)
        early, self.early_opens = list(self.early_opens), deque(maxlen=EARLY_OPENS)
        dispatches, self.early_dispatches = self.early_dispatches, {}
        for identity, opened, payload in early:
            if opened.job != task.job:
                self.early_opens.append((identity, opened, payload))
                continue
            if opened.task not in (None, task.id):
                continue
            try:
                task.open(identity, opened, payload)
            except ProtocolError as exc:
                self.reject(f"dropped a malformed message from a consumer: {exc}")
        waiting = self._waiting()
        for identity, records in dispatches.items():
            if identity not in task.streams:
                if identity in waiting:
                    self.early_dispatches[identity] = records
                continue
            for record in records:
                try:
                    task.dispatch(identity, record)
                except ProtocolError as exc:
                    self.reject(f"dropped a DISPATCH from a consumer: {exc}")

    def close(self) -> None:
        self.sock.close(0)
