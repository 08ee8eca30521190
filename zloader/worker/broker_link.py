"""The worker's connection to the broker: a DEALER that registers (READY), sends, and is
replaced when the broker has been silent too long (see docs/protocol.md, heartbeats)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import zmq

from zloader._defaults import BROKER_SEND_WAIT_SECONDS
from zloader.errors import ZloaderError
from zloader.lineage import Assigned, Group, unpack
from zloader.transport.keys import Keys
from zloader.transport.messages import Ready, Record, Split, SplitReq, Weighed
from zloader.transport.protocol import ProtocolError, encode
from zloader.transport.sockets import make_socket

__all__ = ["BrokerLink", "BrokerRefused", "BrokerUnread", "assignment"]

log = logging.getLogger("zloader.worker")


class BrokerRefused(ZloaderError, ConnectionRefusedError):
    """The broker's socket refused this worker's connection at the handshake: the two do
    not hold the same keys."""


class BrokerUnread(ZloaderError, ConnectionError):
    """The broker answered on this connection, but has not taken this worker's messages
    for BROKER_SEND_WAIT_SECONDS: its queue to the broker is full."""


class BrokerLink:
    """The DEALER to the broker.

    Args:
        context: the worker's ZeroMQ context.
        endpoint: the broker's address.
        keys: CURVE keys (the broker's), or None.
        hello: the READY body: who and where this worker is.
    """

    def __init__(self, context: zmq.Context[Any], endpoint: str, keys: Keys | None,
                 hello: Ready) -> None:
        self.context = context
        self.endpoint = endpoint
        self.keys = keys
        self.hello = hello
        self.last_from = time.monotonic()  # when the broker last said anything
        self.last_to = 0.0
        self.answered = False  # the broker said something on this connection
        # The split requests not yet answered in full, by pass: a producer making a
        # mix's inputs reads a pass of each at once, each with its request out.
        self.asking: dict[tuple[int, ...], SplitReq] = {}
        self.weighing: list[Weighed] = []  # WEIGHEDs the broker has not echoed yet
        self.sock: zmq.Socket[Any] = self.connect()

    def connect(self) -> zmq.Socket[Any]:
        """A fresh connection, registered (the old one, if any, is the caller's to close).

        Raises:
            BrokerRefused: the handshake failed.
        """
        sock = make_socket(self.context, zmq.DEALER, self.keys)
        sock.connect(self.endpoint)
        self.sock = sock
        self.answered = False
        self.ready()
        self.last_from = time.monotonic()
        return sock

    def ready(self) -> None:
        """(Re-)register with the broker."""
        self.send(self.hello)

    def send(self, record: Record) -> None:
        """Send to the broker. A connection still being made queues what is sent; only
        one whose handshake failed (other keys, or none) has nowhere to put it. On a
        connection the broker has answered, a full queue (the broker not reading) is
        waited on for BROKER_SEND_WAIT_SECONDS.

        Raises:
            BrokerRefused: the handshake failed; the text says which keys to give.
            BrokerUnread: the broker answered, then took nothing for that long.
        """
        frames = encode(record.COMMAND, record.to_body())
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            if not self.answered:
                raise self._refused() from None
            if not self.sock.poll(int(BROKER_SEND_WAIT_SECONDS * 1000), zmq.POLLOUT):
                raise BrokerUnread(
                    f"the broker at {self.endpoint} has taken none of this worker's "
                    f"messages for {BROKER_SEND_WAIT_SECONDS:g} s (its queue to the broker "
                    f"is full): the broker is stalled or overloaded ({record.COMMAND.name} "
                    "not sent)") from None
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        self.last_to = time.monotonic()

    def _refused(self) -> BrokerRefused:
        fix = ("the broker wants CURVE keys: pass --keys DIR, the broker's keys "
               "directory (see `zloader keygen`)" if self.keys is None else
               f"the broker holds other CURVE keys than {self.keys.path}, or none: give "
               "every host of the service the same keys directory (--keys DIR)")
        return BrokerRefused(f"the broker at {self.endpoint} refused this worker's "
                             f"connection at the handshake: {fix}")

    def ask(self, request: SplitReq) -> None:
        """SPLIT_REQ, remembered until its answers come (:meth:`answered_split`); a
        request of another task than the last is of a task that stopped: forgotten."""
        self.asking = {key: asked for key, asked in self.asking.items()
                       if asked.task == request.task}
        self.asking[tuple(request.pass_)] = request
        self.send(request)

    def answered_split(self, answer: Split) -> None:
        """A SPLIT came: what of its pass's request is still to come is what to ask again
        after a lost connection (nothing, once the last or a null came). An answer to an
        earlier request (sent again after a reconnect) changes nothing."""
        key = tuple(answer.pass_)
        asking = self.asking.get(key)
        if asking is None or asking.task != answer.task:
            return
        if answer.split is None or answer.have is None or asking.have is None:
            del self.asking[key]
            return
        last = answer.have + len(answer.then)  # (the place of the last split it hands)
        if last < asking.have:
            return
        left = asking.have + asking.ahead - last
        if left > 0:
            self.asking[key] = dataclasses.replace(asking, have=last + 1, ahead=left - 1)
        else:
            del self.asking[key]

    def weigh(self, weighed: Weighed) -> None:
        """WEIGHED, remembered until the broker echoes it (:meth:`noted`): a producer
        waits for that echo."""
        self.weighing = [w for w in self.weighing if w.task == weighed.task] + [weighed]
        self.send(weighed)

    def noted(self, echo: Weighed) -> None:
        self.weighing = [w for w in self.weighing
                         if (w.task, w.pass_, w.at) != (echo.task, echo.pass_, echo.at)]

    def ask_again(self, task: str) -> None:
        """The split requests and WEIGHEDs of ``task`` whose answers may be lost (a new
        connection, a restarted broker): send them again; ``have`` makes the broker send
        the same split if it had handed one out (and it notes a WEIGHED once)."""
        for asking in self.asking.values():
            if asking.task == task:
                self.send(asking)
        for weighed in self.weighing:
            if weighed.task == task:
                self.send(weighed)

    def heard(self) -> None:
        """The broker said something."""
        self.last_from = time.monotonic()
        self.answered = True

    def close(self) -> None:
        self.sock.close(0)


def assignment(split: Split) -> Assigned:
    """An exactly-once job's SPLIT (checked by its record) as the split the producer
    reads: where it belongs (``origin``), what to skip, what an earlier reading held.

    Raises:
        ProtocolError: it has no ``origin``, or no split.
    """
    if split.origin is None or split.split is None:
        raise ProtocolError("SPLIT: field 'origin' is missing (an exactly-once job's split "
                            "needs it)")
    expect = (int(split.expect[0]), int(split.expect[1])) if split.expect else None
    groups = []
    for value in split.groups or ():
        try:
            group, _, rows = Group.from_json(value)
        except ValueError as exc:
            raise ProtocolError(f"SPLIT: field 'groups': {exc}") from None
        if group is None:
            raise ProtocolError("SPLIT: field 'groups': a group to make again needs its "
                                "elements and rows")
        groups.append((group, frozenset(rows)))
    return Assigned(split.split, tuple(split.origin), frozenset(unpack(split.skip)), expect,
                    tuple(groups))
