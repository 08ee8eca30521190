"""The broker's file descriptors: every connection to its ROUTER takes one, and a process
that has none left accepts nobody (ZeroMQ retries the accept; peers wait, silently).

Three defences (docs/reliability.md, "Floods"):

- :func:`raise_descriptor_limit`: ``zloader-broker`` raises its soft ``RLIMIT_NOFILE`` to
  the hard limit at start (an embedded broker leaves its Loader's process as it is).
- ZeroMQ closes a connection whose handshake has not finished in ``HANDSHAKE_SECONDS``
  (``ZMQ_HANDSHAKE_IVL``, set where the loop makes its socket).
- :class:`Descriptors`, asked by the loop every ``DESCRIPTORS_CHECK_SECONDS``: when more
  than ``DESCRIPTORS_LOW`` of the limit is in use it warns (at most every
  ``DESCRIPTORS_WARN_SECONDS``) and drops the connections to the broker's port that sent
  nothing, not even ZeroMQ's greeting, for ``DESCRIPTORS_IDLE_SECONDS``: an honest peer
  sends its greeting at once. It shuts each down (``shutdown(2)``), and ZeroMQ, reading
  the end of the stream, closes it and frees the descriptor: nothing is closed under
  ZeroMQ's feet.

Connections that finished the handshake and then say nothing are not told apart here
(ZeroMQ does not say which descriptor a routing identity arrived on); the handshake
bounds how cheaply they come, and with ``--keys`` only key holders get that far.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import time
from collections.abc import Iterator

from zloader._defaults import (
    DESCRIPTORS_CHECK_SECONDS,
    DESCRIPTORS_IDLE_SECONDS,
    DESCRIPTORS_LOW,
    DESCRIPTORS_WARN_SECONDS,
)

__all__ = ["Descriptors", "descriptor_limit", "raise_descriptor_limit"]

log = logging.getLogger("zloader.broker")

# struct tcp_info (linux/tcp.h), as far as tcpi_bytes_received (Linux 4.1 on): eight
# one-byte fields, twenty-four u32s (tcpi_last_data_recv the twelfth), four u64s.
_TCP_INFO = struct.Struct("=8B24I4Q")


def descriptor_limit() -> int | None:
    """This process's soft limit on open descriptors, or None where it has none we know."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def raise_descriptor_limit() -> int | None:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (each connection to
    the broker takes a descriptor, and a common soft limit is 1,024); returns the soft
    limit in force, logging what could not be done."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d (%s): the broker "
                        "serves at most about %d connections", soft, hard, exc, soft)
    return descriptor_limit()


class Descriptors:
    """Watches the descriptors of the broker's process; see the module's docstring.

    Args:
        endpoint: the broker's bound endpoint: only connections to its TCP port may be
            dropped (an ``ipc://`` one has no TCP connections to drop).
    """

    def __init__(self, endpoint: str) -> None:
        self.port = _port(endpoint)
        # (the first check one interval in: a broker that starts has few, and listing
        # them would delay an embedded Loader's first batch)
        self.next_check = time.monotonic() + DESCRIPTORS_CHECK_SECONDS
        self.warned = float("-inf")  # when "run low" was last logged
        self.told = float("-inf")  # when drops were last logged
        self.dropped = 0  # connections dropped so far
        self.untold = 0  # ... of which not logged yet

    def check(self, now: float) -> None:
        """At most every DESCRIPTORS_CHECK_SECONDS: count the descriptors in use; when
        they run low, drop the idle connections that sent nothing and warn."""
        if now < self.next_check:
            return
        self.next_check = now + DESCRIPTORS_CHECK_SECONDS
        limit = descriptor_limit()
        if limit is None:
            return
        fds = _open_fds(limit)
        if len(fds) < DESCRIPTORS_LOW * limit:
            return
        if now - self.warned >= DESCRIPTORS_WARN_SECONDS:
            self.warned = now
            log.warning(
                "file descriptors run low: %d of %d in use, and each peer's connection "
                "takes one: raise the limit (ulimit -n, or LimitNOFILE= in a systemd unit, "
                "before zloader-broker starts: it raises its soft limit to the hard one)",
                len(fds), limit)
        dropped = self._drop_idle(fds) if self.port is not None else 0
        self.dropped += dropped
        self.untold += dropped
        if self.untold and now - self.told >= DESCRIPTORS_WARN_SECONDS:
            self.told = now
            log.warning("dropped %d connections to port %d that sent nothing, not even "
                        "ZeroMQ's greeting, for %.1f s (descriptors run low; %d dropped so "
                        "far)", self.untold, self.port, DESCRIPTORS_IDLE_SECONDS,
                        self.dropped)
            self.untold = 0

    def _drop_idle(self, fds: list[int]) -> int:
        """Shut down each connection to our port that has received no byte in its
        DESCRIPTORS_IDLE_SECONDS or more of life; returns how many."""
        dropped = 0
        for fd in fds:
            with _borrowed(fd) as sock:
                if sock is None or not self._idle(sock):
                    continue
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # ZeroMQ reads the end, and closes it
                    dropped += 1
                except OSError:
                    pass
        return dropped

    def _idle(self, sock: socket.socket) -> bool:
        """Whether ``sock`` is a connection to our port that never received a byte, for
        DESCRIPTORS_IDLE_SECONDS or more."""
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                  socket.AF_INET6):
            return False
        try:
            if sock.getsockname()[1] != self.port:
                return False
            sock.getpeername()  # the listening socket has none
            raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
        except (OSError, AttributeError):  # not connected; no TCP_INFO (not Linux)
            return False
        if len(raw) < _TCP_INFO.size:  # a kernel before tcpi_bytes_received
            return False
        info = _TCP_INFO.unpack(raw)
        since_data_ms, bytes_received = info[8 + 11], info[8 + 24 + 3]
        # With nothing received, tcpi_last_data_recv counts from the connection's start.
        return bytes_received == 0 and since_data_ms >= DESCRIPTORS_IDLE_SECONDS * 1000


def _port(endpoint: str) -> int | None:
    """The TCP port of a bound ZeroMQ endpoint, or None (``ipc://``, ``inproc://``)."""
    if not endpoint.startswith("tcp://"):
        return None
    try:
        return int(endpoint.rsplit(":", 1)[1])
    except ValueError:
        return None


def _open_fds(limit: int) -> list[int]:
    """The descriptors open in this process. Listing them takes one: with none left,
    every number below ``limit`` is tried instead (a descriptor that is not open fails)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return [int(name) for name in os.listdir(folder)]
        except FileNotFoundError:
            continue
        except OSError:  # EMFILE: none left to list them with
            break
    found = []
    for fd in range(min(limit, 1 << 16)):
        try:
            os.fstat(fd)
        except OSError:
            continue
        found.append(fd)
    return found


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket | None]:
    """``fd`` as a socket object that does not own it (released on exit, never closed:
    it is ZeroMQ's); None when ``fd`` is not a socket."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        yield None
        return
    try:
        yield sock
    finally:
        sock.detach()
