"""A consumer's report that a worker is stuck is checked against what the broker sees:
a worker that keeps sending elements (to another consumer of the job) is not dropped on
one consumer's word; the report is counted instead."""

from __future__ import annotations

import collections
import dataclasses
import secrets
import threading
import time

import pytest

from tests.service import dealers, service, status, wait_for
from zloader import Loader, Pipeline
from zloader.transport import messages
from zloader.transport.protocol import Command, decode, encode


def slowly(x: int) -> int:
    time.sleep(0.004)
    return x


@pytest.mark.parametrize("claimed", [pytest.param(30.0, marks=pytest.mark.slow), 0.3])
def test_a_consumer_reporting_busy_workers_stuck_does_not_get_them_dropped(claimed: float):
    pipeline = Pipeline.range(1500, split_size=50).map(slowly)
    with service(workers=2) as (address, _):
        with Loader(pipeline, broker=address, job_name="busy", timeout=60) as honest:
            seen: collections.Counter = collections.Counter()
            reader = threading.Thread(target=lambda: seen.update(honest), daemon=True)
            reader.start()
            wait_for(lambda: len(seen) > 50, what="the honest consumer's first elements")
            workers_before = {w["worker"] for w in status(address)["workers"]}
            # A second consumer of the job (another process could send the same) reports
            # both workers stuck, again and again.
            register = dataclasses.replace(honest._io.loop._link.register,
                                           consumer=secrets.token_hex(8))
            with dealers(address) as (sock,):
                sock.send_multipart(encode(Command.REGISTER, messages.encode(register),
                                           (honest._io.loop._link.blob,)))
                view = None
                deadline = time.monotonic() + 10
                while view is None and time.monotonic() < deadline:
                    if sock.poll(200):
                        msg = decode(sock.recv_multipart())
                        if msg.command == Command.JOB and msg.body.get("workers"):
                            view = msg.body
                assert view is not None, "no JOB view for the second consumer"
                reports = [{"worker": w["worker"], "task": w["task"], "seconds": claimed}
                           for w in view["workers"]]
                for _ in range(10):
                    sock.send_multipart(encode(Command.HEARTBEAT, messages.encode(
                        messages.Heartbeat(stats={}, stuck=tuple(reports)))))
                    time.sleep(0.1)
                wait_for(lambda: _unconfirmed(address) >= 1, what="the reports counted")
                # The job's view now: the same workers with the same tasks (a dropped
                # worker comes back with a new task).
                while sock.poll(100):
                    sock.recv_multipart()
                sock.send_multipart(encode(Command.HEARTBEAT, messages.encode(
                    messages.Heartbeat(stats={}))))
                assert sock.poll(5000)
                now = decode(sock.recv_multipart()).body
                assert {w["worker"]: w["task"] for w in now["workers"]} \
                    == {w["worker"]: w["task"] for w in view["workers"]}
            reader.join(60)
            assert not reader.is_alive()
            assert {w["worker"] for w in status(address)["workers"]} == workers_before
            assert sorted(seen) == list(range(1500)) and set(seen.values()) == {1}


def _unconfirmed(address: str) -> int:
    return sum(job.get("unconfirmed_stuck", 0) for job in status(address)["jobs"])
