"""The identity of this host's shared-memory namespace, for co-location decisions.

Two processes can share a ``/dev/shm`` segment when they run under the same kernel boot
and in the same mount namespace; that pair, with the host name, is the host identity.
"""

from __future__ import annotations

import functools
import os
import socket


@functools.cache
def host_id() -> str:
    """``hostname/boot id/mount namespace``: equal for processes that share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        namespace = os.readlink("/proc/self/ns/mnt")
    except OSError:
        namespace = "unknown-ns"
    return f"{socket.gethostname()}/{boot}/{namespace}"


def loopback(address: str) -> bool:
    """Whether ``address`` (a ZeroMQ endpoint) is reachable only from this host."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def running(pid: int) -> bool:
    """Whether process ``pid`` of this host exists and is neither stopped (SIGSTOP, a
    debugger) nor a zombie: a worker that is silent but running is busy (user code that
    holds the interpreter's lock), not dead."""
    return _state(pid) in ("R", "S", "D")


def gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (or is a zombie); a stopped one
    (SIGSTOP, a debugger) is not gone: it may continue."""
    return _state(pid) in ("", "Z", "X")


def _state(pid: int) -> str | None:
    """Process ``pid``'s state letter from /proc (``R``, ``S``, ``T``, ``Z``, ...); ""
    when there is no such process; None when /proc cannot say (not Linux: heartbeats
    alone decide)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return ""
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:][:1]
