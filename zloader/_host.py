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
