"""Floods and exhaustion: a flood of REGISTERs from one peer, a STATUS larger than one
message, idle connections that use up the broker's file descriptors. Each is bounded by a
documented limit, and the broker keeps serving an honest Loader (design invariant 10)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from tests.service import (
    BIN,
    HEARTBEAT,
    dealers,
    free_port,
    read_together,
    service,
    start_worker,
    status,
    stop,
    wait_for,
)
from tests.test_pool import epoch, workers_of
from tests.test_state import nested, ready, record
from zloader import Loader, Pipeline, cli
from zloader._defaults import MAX_BODY_BYTES, SLICE_SECONDS, UNHEARD_BEATS
from zloader._host import host_id
from zloader.broker.records import Limits
from zloader.broker.state import State
from zloader.client.shipment import pack
from zloader.options import JobOptions
from zloader.transport import messages
from zloader.transport.protocol import Command, decode, encode

FLOOD = 3000
"""REGISTERs of the flood: enough to keep the broker busy for tens of seconds before it
bounded them (each one weighed every job's claim on the pool)."""


def registration(blob: bytes, fingerprint: str | None = None, consumer: str | None = None,
                 job_name: str | None = None) -> list[Any]:
    """The frames of one REGISTER of a new job (a fresh consumer and fingerprint), as a
    Loader on this host sends it, with ``blob`` as its pipeline."""
    register = messages.Register(
        consumer=consumer or secrets.token_hex(8),
        fingerprint=fingerprint or secrets.token_hex(16), job_name=job_name,
        options=JobOptions(),
        source={"num_splits": 4, "shuffle_splits": False, "seed": None},
        host_id=host_id(), pid=os.getpid())
    return encode(Command.REGISTER, messages.encode(register), (blob,))


def replies(sock: zmq.Socket, until: Any, timeout: float = 20.0) -> list[Any]:
    """The messages ``sock`` receives until one satisfies ``until`` (or the deadline)."""
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sock.poll(100):
            got.append(decode(sock.recv_multipart()))
            if until(got[-1]):
                return got
    raise AssertionError(f"no awaited reply within {timeout} s ({len(got)} others)")


# --- a flood of jobs ----------------------------------------------------------------------

def test_a_flood_of_registers_does_not_starve_an_honest_loader():
    """3,000 REGISTERs of new jobs from one raw DEALER, then an honest Loader: it reads its
    epoch (no timeout), and the flood past the per-peer limit is refused, naming it."""
    blob, _ = pack(Pipeline.range(1000), inherited=False)
    with service(2) as (address, _procs), dealers(address) as (flood,):
        for _ in range(FLOOD):
            flood.send_multipart(registration(blob))
        with Loader(Pipeline.range(300), broker=address, timeout=5) as loader:
            (epochs,) = read_together([loader], timeout=60)
        assert sorted(epochs[0]) == list(range(300))
        refused = replies(flood, lambda m: m.command is Command.ERROR)[-1]
        assert "--max-peer-jobs" in refused.body["message"]
        assert "MAX_PEER_JOBS" in refused.body["message"]
        assert status(address)["summary"]["refused"] > 0


def test_jobs_whose_consumers_never_speak_do_not_hold_the_workers():
    """Jobs whose consumers registered and then sent nothing hold both workers; once
    they have been silent for UNHEARD_BEATS heartbeats, a consumer that starts its epoch
    gets a worker at once (not after a time slice, nor after their expiry)."""
    state = State(heartbeat=0.25)
    for i in range(2):
        ready(state, f"w{i}")
    for name in ("idle-a", "idle-b"):
        join(state, name.encode(), name, now=0.0)
    assert sum(len(j.tasks) for j in state.jobs.values()) == 2
    state.tick(UNHEARD_BEATS * 0.25 + 0.1)  # silent since: taken for jobs nobody reads
    now = UNHEARD_BEATS * 0.25 + 0.2
    assert now < min(SLICE_SECONDS, state.expiry)
    join(state, b"honest", "honest", now=now)
    epoch(state, "honest", now)
    assert workers_of(state)["honest"] >= 1


def join(state: State, identity: bytes, consumer: str, now: float = 0.0,
         blob: bytes = b"pipeline", fingerprint: str | None = None) -> list[Any]:
    """A REGISTER from ``identity`` (a connection) for a new job, as plain calls."""
    return state.register(identity, record(Command.REGISTER, nested({
        "consumer": consumer, "fingerprint": fingerprint or consumer.ljust(16, "f"),
        "job_name": None, "host_id": "h/boot/ns", "pid": 1,
        "source": {"num_splits": 4, "shuffle_splits": False, "seed": None}}), [blob]), now)


def refusal(out: list[Any]) -> str:
    (error,) = [o for o in out if o.command is Command.ERROR]
    return str(error.body["message"])


def test_jobs_and_pipeline_bytes_are_bounded_per_peer_and_in_all():
    """Past each limit a REGISTER of a new job is refused with an error naming the limit,
    its flag and its constant; a consumer registering again joins its job as before, and a
    job that ends frees its place."""
    state = State(heartbeat=1.0, limits=Limits(jobs=4, peer_jobs=2, pipeline_bytes=2000,
                                               peer_pipeline_bytes=1500))
    join(state, b"a", "a1")
    join(state, b"a", "a2")
    message = refusal(join(state, b"a", "a3"))
    assert "--max-peer-jobs" in message and "MAX_PEER_JOBS" in message
    assert "2" in message
    again = join(state, b"a", "a2")  # registering again is not a new job
    assert [o.command for o in again][-1] is Command.JOB
    join(state, b"b", "b1", blob=b"x" * 1000)
    message = refusal(join(state, b"b", "b2", blob=b"x" * 1000))
    assert "--max-peer-pipeline-bytes" in message and "MAX_PEER_PIPELINE_BYTES" in message
    message = refusal(join(state, b"c", "c1", blob=b"x" * 1200))
    assert "--max-pipeline-bytes" in message and "MAX_PIPELINE_BYTES_HELD" in message
    join(state, b"c", "c1")
    message = refusal(join(state, b"d", "d1"))
    assert "--max-jobs" in message and "MAX_JOBS" in message
    state.bye(b"c", 0.5)  # c1's job ends with its last consumer: its place is free
    assert [o.command for o in join(state, b"d", "d1")][-1] is Command.JOB
    assert state.refused == 4


# --- STATUS of a big broker ---------------------------------------------------------------

LONG = 1000
"""Characters of each job's fingerprint: 800 such jobs make a STATUS of over 1 MiB."""


def big_state(jobs: int) -> State:
    state = State(heartbeat=1.0, limits=Limits(jobs=10_000, peer_jobs=10_000))
    for i in range(jobs):
        join(state, b"peer", f"c{i}", fingerprint=f"{i:08d}".ljust(LONG, "f"))
    return state


def test_a_status_reply_is_bounded_and_pages_cover_every_job():
    """800 jobs of long fingerprints: each STATUS reply fits a message (the size a client
    accepts); it says how many jobs it left off, and following ``next`` lists each job
    once."""
    state = big_state(800)
    seen: list[str] = []
    start: dict[str, int] | None = {}
    pages = 0
    while start is not None:
        report = state.status(0.0, start)
        body = encode(Command.STATUS, report)[2]
        assert len(body) <= MAX_BODY_BYTES
        assert report["summary"]["jobs"] == 800
        seen += [j["job"] for j in report["jobs"]]
        assert report["left_off"]["jobs"] == 800 - len(seen)
        start, pages = report["next"], pages + 1
    assert sorted(seen) == sorted(state.jobs) and pages > 1


def test_zloader_status_json_does_not_crash_on_a_big_broker(capsys):
    """A live broker with 800 jobs of long fingerprints (a STATUS of over 1 MiB whole):
    ``zloader status --json`` prints a bounded page with the count of the rest, and
    ``--all`` pages through every job."""
    blob, _ = pack(Pipeline.range(10), inherited=False)
    with service(0) as (address, _procs), dealers(*[address] * 50) as socks:
        for n in range(800):
            socks[n % 50].send_multipart(registration(
                blob, fingerprint=f"{n:08d}".ljust(LONG, "f")))
        wait_for(lambda: status(address)["summary"]["jobs"] == 800, what="800 jobs")
        capsys.readouterr()
        assert cli.main(["status", "--json", "--broker", address]) == 0
        page = json.loads(capsys.readouterr().out)
        assert 0 < len(page["jobs"]) < 800
        assert page["left_off"]["jobs"] == 800 - len(page["jobs"])
        assert cli.main(["status", "--json", "--all", "--broker", address]) == 0
        whole = json.loads(capsys.readouterr().out)
        assert len({j["job"] for j in whole["jobs"]}) == 800
        assert cli.main(["status", "--broker", address]) == 0
        assert "more jobs" in capsys.readouterr().out


# --- file descriptors ---------------------------------------------------------------------

def _limit(soft: int, hard: int) -> Any:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return apply


@contextlib.contextmanager
def limited_broker(soft: int, hard: int, log: Any) -> Iterator[tuple[subprocess.Popen, str]]:
    """A broker whose process may open ``soft`` (up to ``hard``) descriptors, logging to
    ``log``; stopped on exit."""
    address = f"tcp://127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [os.path.join(BIN, "zloader-broker"), "--bind", address, "--heartbeat",
         str(HEARTBEAT), "--log-level", "warning"],
        preexec_fn=_limit(soft, hard), stderr=log)
    try:
        wait_for(lambda: status(address, 1.0) is not None, what="the broker")
        yield process, address
    finally:
        stop(process)


def test_the_broker_raises_its_descriptor_limit_to_the_hard_one(tmp_path):
    with open(tmp_path / "broker.log", "w") as log, \
            limited_broker(256, 4096, log) as (process, _address):
        with open(f"/proc/{process.pid}/limits") as limits:
            line = next(x for x in limits if x.startswith("Max open files"))
        assert line.split()[3:5] == ["4096", "4096"], line


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_idle_connections_do_not_exhaust_the_brokers_descriptors(tmp_path):
    """A broker that may open 128 descriptors, and 150 idle TCP connections to it (no
    greeting, no handshake): the broker drops them, says so in its log, and an honest
    Loader that comes after them is served."""
    path = tmp_path / "broker.log"
    with open(path, "w") as log, limited_broker(128, 128, log) as (_process, address):
        worker = start_worker(address)
        idle: list[socket.socket] = []
        try:
            wait_for(lambda: len(status(address)["workers"]) == 1, what="the worker")
            port = int(address.rsplit(":", 1)[1])
            for _ in range(150):
                idle.append(socket.create_connection(("127.0.0.1", port)))
            wait_for(lambda: "run low" in path.read_text(), what="the broker's warning")
            with Loader(Pipeline.range(200), broker=address, timeout=5) as loader:
                (epochs,) = read_together([loader], timeout=60)
            assert sorted(epochs[0]) == list(range(200))
        finally:
            for conn in idle:
                conn.close()
            stop(worker)
    text = path.read_text()
    assert "descriptors run low" in text and "ulimit -n" in text, text[-2000:]
    assert re.search(r"dropped [1-9]\d* connections", text), text[-2000:]
