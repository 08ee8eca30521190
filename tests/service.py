"""Helpers for tests that start real brokers and workers (processes, loopback sockets)."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from zloader.transport.protocol import Command, decode, encode

BIN = os.path.dirname(sys.executable)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HANDED: set[int] = set()
_DRAW = random.Random()  # its own: tests that seed the global one draw alike


def free_port() -> int:
    """A loopback port free now, for a server a test starts next.

    It is drawn below the kernel's ephemeral range: a port bound as port 0 (a worker's
    data socket, any test's ``free_port`` of old) or a connection's source port is taken
    from that range, so none of them can take this one between this call and the
    server's bind (a CI run once had a worker's data socket on its broker's port). Each
    pytest-xdist worker draws from a slice of its own and never hands out a port twice.
    """
    low, high = 10000, _ephemeral_low()
    if high - low < 2000:  # an unusual range: fall back to the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    width = (high - low) // count
    start = low + index * width
    for _ in range(1000):
        port = _DRAW.randrange(start, start + width)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {start}..{start + width - 1}")


def status(address: str, timeout: float = 5.0, keys: str | None = None) -> dict | None:
    """The broker's STATUS, or None if it does not answer within ``timeout``."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        from zloader.transport.keys import Keys

        Keys.load(keys).connect(sock)
    try:
        sock.connect(address)
        sock.send_multipart(encode(Command.STATUS, {}))
        if not sock.poll(timeout * 1000):
            return None
        return decode(sock.recv_multipart()).body
    finally:
        sock.close(0)
        context.term()


def wait_for(condition, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


HEARTBEAT = 0.5
"""The test brokers' heartbeat: deaths are noticed in 1.5 s instead of 3."""


def start_broker(port: int | None = None, keys: str | None = None
                 ) -> tuple[subprocess.Popen, str]:
    address = f"tcp://127.0.0.1:{port or free_port()}"
    process = subprocess.Popen([os.path.join(BIN, "zloader-broker"), "--bind", address,
                                "--heartbeat", str(HEARTBEAT), "--log-level", "error",
                                *(["--keys", keys] if keys else [])])
    return process, address


def start_worker(address: str, processes: int = 1, keys: str | None = None
                 ) -> subprocess.Popen:
    return subprocess.Popen([os.path.join(BIN, "zloader-worker"), "--broker", address,
                             "--processes", str(processes),
                             *(["--keys", keys] if keys else [])])


def stop(process: subprocess.Popen, timeout: float = 10.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def service(workers: int = 1, keys: str | None = None
            ) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """A broker and ``workers`` single-process workers (with ``keys``, all authenticated);
    all stopped on exit."""
    broker, address = start_broker(keys=keys)
    # The workers start at once: they connect while the broker starts (ZeroMQ retries).
    procs = [start_worker(address, keys=keys) for _ in range(workers)]
    try:
        wait_for(lambda: status(address, 1.0, keys) is not None, what="the broker")
        # (a reply without a worker list, once seen under load, is read as "not yet")
        wait_for(lambda: len((status(address, keys=keys) or {}).get("workers", ())) == workers,
                 what="the workers")
        yield address, procs
    finally:
        for p in procs:
            stop(p)
        stop(broker)


@contextlib.contextmanager
def dealers(*endpoints: str) -> Iterator[list[zmq.Socket]]:
    """A raw DEALER socket connected to each endpoint, with no send limit (room for a
    flood of hostile or crafted messages), all closed on exit."""
    context = zmq.Context()
    socks = []
    try:
        for endpoint in endpoints:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(endpoint)
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close(0)
        context.term()


def read_together(loaders: list, epochs: int = 1, timeout: float = 60.0,
                  element: Callable[[Any], Any] = lambda value: value) -> list[list[list]]:
    """Every loader's ``epochs`` epochs, each loader read on a thread of its own (they may
    wait for each other), as lists of ``element(value)``; a hung or failed reader fails."""
    results: list[list[list]] = [[] for _ in loaders]

    def read(i: int) -> None:
        for _ in range(epochs):
            results[i].append([element(value) for value in loaders[i]])

    run_together([functools.partial(read, i) for i in range(len(loaders))], timeout)
    return results


def run_together(readers: list[Callable[[], Any]], timeout: float = 60.0) -> None:
    """Run each of ``readers`` on a thread of its own (they may wait for each other); a
    hung or failed reader fails."""
    errors: list[BaseException] = []

    def run(reader: Callable[[], Any]) -> None:
        try:
            reader()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(reader,), daemon=True)
               for reader in readers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a consumer hung"
    assert not errors, errors
