"""The one place that makes the ZeroMQ sockets of the protocol (docs/protocol.md, "Roles
and sockets"): every socket gets linger 0, its side of the keys (a CURVE server for one that
binds, a CURVE client for one that connects; PLAIN for ``--plain-data``) and, where a peer
could send too much, ZeroMQ's largest frame (MAXMSGSIZE: a larger one cuts the peer off).
The broker's ROUTER, the workers' and the consumers' sockets are all made here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import zmq

from zloader._defaults import RECONNECT_FIRST_MS, RECONNECT_MAX_MS
from zloader.transport.keys import Keys

__all__ = ["NOBLOCK", "has_message", "make_socket", "recv_frames", "send_frames", "waiting"]


def make_socket(context: zmq.Context[Any], kind: int, keys: Keys | None = None, *,
                serve: bool = False, plain: bool = False,
                max_bytes: int | None = None) -> zmq.Socket[Any]:
    """A socket of ``kind`` (``zmq.DEALER``, ``zmq.ROUTER``, ...) in ``context``, not yet
    bound or connected, with linger 0 (closing never blocks on unsent messages) and, for
    one that connects, quick first retries (:data:`RECONNECT_FIRST_MS`).

    Args:
        keys: the keys directory's pairs, or None for no authentication.
        serve: the socket will bind (a CURVE or PLAIN server), else connect (a client).
            A serving socket in a process with keys needs that process's ZAP handler
            (``Keys.guard``), started before it binds.
        plain: with keys, PLAIN (a token, no encryption) instead of CURVE: a worker's
            ``--plain-data`` socket and the consumers' sockets to it.
        max_bytes: frames larger than this are dropped and their peer cut off; None for
            ZeroMQ's default (no limit).

    Raises:
        ValueError: ``plain`` without keys (PLAIN is authenticated by the keys' token).
    """
    if plain and keys is None:
        raise ValueError("plain data needs keys: PLAIN authenticates with their token")
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if not serve:  # a peer not there yet (a broker starting): tried again soon, then less
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_FIRST_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
    if max_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if keys is not None:
        if plain:
            (keys.serve_plain if serve else keys.connect_plain)(sock)
        else:
            (keys.serve if serve else keys.connect)(sock)
    return sock


# pyzmq's Python layer makes an enum of every option and flag on each call: these are its
# sockets' own methods under that layer, with plain ints.
_get = zmq.backend.Socket.get
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
_MORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)


def has_message(sock: zmq.Socket[Any]) -> bool:
    """Whether a message waits on ``sock`` (open): cheaper than a ``NOBLOCK`` receive
    that raises ``zmq.Again`` to say there is none."""
    return not sock.closed and bool(int(_get(sock, _EVENTS)) & _POLLIN)


def waiting(sock: zmq.Socket[Any], limit: int,
            polled: bool = True) -> Iterator[list[zmq.Frame]]:
    """The frames of each message waiting on ``sock``, at most ``limit`` of them (the loop
    then serves its other sockets); ``polled``: a poll of the socket said one waits (not
    of its file descriptor, which only says that one may). It stops early when ``sock``
    is closed meanwhile (handling a message closed it) or none is left."""
    for turn in range(limit):
        # (a poll of the socket saw the first one: EVENTS is asked from the second on)
        if sock.closed or ((turn or not polled) and not has_message(sock)):
            return
        try:
            frames = recv_frames(sock)
        except zmq.Again:
            return
        yield frames


def recv_frames(sock: zmq.Socket[Any]) -> list[zmq.Frame]:
    """The frames of the message waiting on ``sock``, as ``sock.recv_multipart(NOBLOCK,
    copy=False)`` gives them.

    Raises:
        zmq.Again: none waits.
    """
    frame = _recv(sock, NOBLOCK, False, False)
    frames = [frame]
    while frame.more:
        frame = _recv(sock, NOBLOCK, False, False)
        frames.append(frame)
    return frames



def send_frames(sock: zmq.Socket[Any], frames: list[Any], flags: int = 0) -> None:
    """Send ``frames`` as one message, as ``sock.send_multipart(frames, flags,
    copy=False)`` does (small frames are still copied, at pyzmq's copy threshold) without
    its check of every frame and its flag enums: a record's notice is a few small frames,
    sent once per record.

    Raises:
        zmq.ZMQError: as ``send_multipart`` (``zmq.Again`` with ``NOBLOCK``).
        TypeError: a frame does not hold a buffer.
    """
    more = flags | _MORE
    last = len(frames) - 1
    for at, frame in enumerate(frames):
        _send(sock, frame, flags if at == last else more, False, False)
