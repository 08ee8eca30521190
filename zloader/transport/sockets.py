"""The one place that makes the ZeroMQ sockets of the protocol (docs/protocol.md, "Roles
and sockets"): every socket gets linger 0, its side of the keys (a CURVE server for one that
binds, a CURVE client for one that connects; PLAIN for ``--plain-data``) and, where a peer
could send too much, ZeroMQ's largest frame (MAXMSGSIZE: a larger one cuts the peer off).
The broker's ROUTER, the workers' and the consumers' sockets are all made here.
"""

from __future__ import annotations

from typing import Any

import zmq

from zloader.transport.keys import Keys

__all__ = ["has_message", "make_socket"]


def make_socket(context: zmq.Context[Any], kind: int, keys: Keys | None = None, *,
                serve: bool = False, plain: bool = False,
                max_bytes: int | None = None) -> zmq.Socket[Any]:
    """A socket of ``kind`` (``zmq.DEALER``, ``zmq.ROUTER``, ...) in ``context``, not yet
    bound or connected, with linger 0 (closing never blocks on unsent messages).

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
    if max_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if keys is not None:
        if plain:
            (keys.serve_plain if serve else keys.connect_plain)(sock)
        else:
            (keys.serve if serve else keys.connect)(sock)
    return sock


_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # (plain ints: no enum per call)


def has_message(sock: zmq.Socket[Any]) -> bool:
    """Whether a message waits on ``sock`` (open): cheaper than a ``NOBLOCK`` receive
    that raises ``zmq.Again`` to say there is none."""
    return not sock.closed and bool(int(sock.getsockopt(_EVENTS)) & _POLLIN)
