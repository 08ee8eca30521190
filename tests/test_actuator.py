"""Carrying out desired_workers: the decision (``zloader.actuator.plan``), the broker's
placement and surplus marks, and ``zloader-worker --autoscale`` end to end."""

from __future__ import annotations

import os
import subprocess
import time

import psutil
import pytest

from tests.service import BIN, free_port, status, stop, wait_for
from tests.test_state import record, register
from zloader import Loader, Pipeline
from zloader._defaults import ACTUATOR_EXPIRY
from zloader.actuator import plan
from zloader.broker.state import State
from zloader.transport.protocol import Command

HERE = "host-a/boot/ns"


def job(desired: int, workers: int, hosts: tuple[str, ...] = (HERE,)) -> dict:
    return {"state": "running", "desired_workers": desired, "workers": workers,
            "consumer_hosts": list(hosts)}


def worker(wid: str, job_id: str | None = "j", surplus: bool = False) -> dict:
    return {"worker": wid, "job": job_id, "surplus": surplus}


def decide(status: dict, mine: set[str] = frozenset(), starting: int = 0, room: int = 4,
           idle_cores: float = 2.0, short_for: float = 0.0):
    return plan(status, set(mine), starting, room, HERE, idle_cores, short_for,
                remote_delay=5.0)


def test_a_host_with_the_lacking_jobs_consumers_and_an_idle_core_grows_at_once():
    got = decide({"jobs": [job(4, 1)], "workers": [worker("w1")]}, idle_cores=4.0)
    assert (got.start, got.lacking) == (3, 3)
    # At once only as many as it has idle cores; the rest after the delay.
    assert decide({"jobs": [job(4, 1)], "workers": []}, idle_cores=2.5).start == 2
    assert decide({"jobs": [job(4, 1)], "workers": []}, idle_cores=2.5,
                  short_for=5.0).start == 3


def test_other_hosts_wait_for_the_remote_delay_before_growing():
    status = {"jobs": [job(3, 1, hosts=("host-b/boot/ns",))], "workers": [worker("w1")]}
    assert decide(status).start == 0
    assert decide(status, short_for=5.0).start == 2


def test_a_busy_local_host_leaves_the_shortfall_to_others_first():
    status = {"jobs": [job(3, 1)], "workers": []}
    assert decide(status, idle_cores=0.5).start == 0
    assert decide(status, idle_cores=0.5, short_for=6.0).start == 2


def test_idle_workers_and_processes_still_starting_count_against_the_shortfall():
    status = {"jobs": [job(5, 1)], "workers": [worker("w1"), worker("w2", job_id=None)]}
    assert decide(status, idle_cores=8.0).start == 3
    assert decide(status, idle_cores=8.0, starting=2).start == 1
    assert decide(status, idle_cores=8.0, starting=3).start == 0


def test_a_loopback_actuator_grows_only_for_jobs_read_on_its_host():
    status = {"jobs": [job(3, 1, hosts=("host-b/boot/ns",)), job(2, 1)], "workers": []}
    got = plan(status, set(), 0, 8, HERE, 4.0, 10.0, remote_delay=5.0, loopback_only=True)
    assert (got.start, got.lacking) == (1, 1)


def test_idle_loopback_workers_count_only_for_jobs_read_on_their_host():
    status = {"jobs": [job(3, 1, hosts=("host-b/boot/ns",))],
              "workers": [{"worker": "w9", "job": None, "surplus": False,
                           "endpoint": "tcp://127.0.0.1:7000", "host_id": HERE}]}
    assert decide(status, short_for=6.0).start == 2  # w9 cannot serve host-b's job
    status["workers"][0]["host_id"] = "host-b/boot/ns"
    assert decide(status, short_for=6.0).start == 1


def test_growth_stops_at_the_core_budget():
    assert decide({"jobs": [job(9, 1)], "workers": []}, room=2).start == 2
    assert decide({"jobs": [job(9, 1)], "workers": []}, room=0).start == 0


def test_failed_jobs_and_jobs_at_their_count_start_nothing():
    failed = {**job(4, 1), "state": "failed"}
    assert decide({"jobs": [failed, job(2, 2), job(1, 3)], "workers": []}).start == 0


def test_only_this_actuators_surplus_workers_are_drained():
    status = {"jobs": [job(1, 3)], "workers": [worker("w1", surplus=True), worker("w2"),
                                               worker("w3", surplus=True)]}
    assert decide(status, mine={"w1", "w2"}).drain == ["w1"]
    assert decide(status, mine={"w2"}).drain == []


def ready(state: State, name: str, host: str, now: float = 0.0) -> None:
    state.worker_ready(name.encode(), record(Command.READY, {
        "worker": name, "host": host.split("/")[0], "host_id": host,
        "pid": 100 + len(state.workers), "endpoint": f"tcp://{host.split('/')[0]}:5000",
        "prefer": None}),
        now)


def test_the_broker_marks_remote_workers_surplus_before_local_ones():
    state = State()
    ready(state, "remote", "other/boot/ns")
    ready(state, "local", "h/boot/ns")  # the test consumers' host (tests/test_state.py)
    register(state, "c1")
    (j,) = state.jobs.values()
    assert len(j.tasks) == 2
    j.metrics.desired = 1
    marks = {w["worker"]: w["surplus"] for w in state.status(0.0)["workers"]}
    assert marks == {"remote": True, "local": False}
    j.metrics.desired = 2
    assert not any(w["surplus"] for w in state.status(0.0)["workers"])


def test_a_lacking_job_gets_local_idle_workers_first():
    state = State()
    register(state, "c1")  # no workers yet: the job lacks one
    (j,) = state.jobs.values()
    j.metrics.desired = 1
    ready(state, "remote", "other/boot/ns")
    assert len(j.tasks) == 1  # a worker that arrives alone is taken
    state2 = State()
    register(state2, "c1")
    (j2,) = state2.jobs.values()
    j2.consumers.clear()  # closed while both workers arrive, then open again
    ready(state2, "remote", "other/boot/ns")
    ready(state2, "local", "h/boot/ns")
    j2.consumers.add("c1")
    j2.metrics.desired = 1
    state2.tick(0.0)
    assigned = {state2.workers[w].host_id for w in j2.tasks.values()}
    assert "h/boot/ns" in assigned


def test_a_worker_reachable_only_on_its_host_serves_only_jobs_read_there():
    state = State()
    register(state, "c1")  # its consumer runs on h/boot/ns
    state.worker_ready(b"w1", record(Command.READY, {
        "worker": "w1", "host": "other", "host_id": "other/boot/ns", "pid": 7,
        "endpoint": "tcp://127.0.0.1:5000", "prefer": None}), 0.0)
    assert state.workers["w1"].task is None  # a Loader's own worker on another host
    ready(state, "w2", "h/boot/ns")
    assert state.workers["w2"].task is not None


def test_idle_workers_are_surplus_after_a_cooldown_only_while_no_job_lacks_any():
    state = State(cooldown=10.0)
    ready(state, "w1", "h/boot/ns", now=0.0)
    assert not state.status(5.0)["workers"][0]["surplus"]
    assert state.status(11.0)["workers"][0]["surplus"]


def _starved(state: State, seconds: int, start: int = 0) -> list[int]:
    """The job's desired workers, second by second, its consumer waiting 90% of the time."""
    desired = []
    for now in range(start, start + seconds):
        for peer in [*state.workers.values(), *state.consumers.values()]:
            peer.last_seen = float(now)  # (their heartbeats: the broker's loop notes them)
        state.consumer_heartbeat(b"c1", float(now), record(Command.HEARTBEAT, {
            "stats": {"wait_seconds": 0.9 * now, "active": 1}}))
        state.tick(float(now))
        (job,) = state.jobs.values()
        desired.append(job.metrics.desired)
    return desired


@pytest.mark.parametrize("cap", [None, 3])
def test_an_actuators_cap_bounds_every_jobs_desired_workers(cap):
    """A job with 3 workers whose consumer waits 90% of its time wants twice as many; an
    actuator that runs at most 3 (``zloader-worker --autoscale --max-processes 3``, which
    names its cap in its status requests) holds it at 3, and ``zloader status`` shows the
    cap. (It wanted 5 against a cap of 4.)"""
    state = State(cooldown=5.0, heartbeat=1.0)
    for name in ("w1", "w2", "w3"):
        ready(state, name, "h/boot/ns")
    register(state, "c1")
    for now in range(0, 40):
        if cap is not None:
            state.note_actuator({"id": "a1", "cap": cap, "workers": ["w1", "w2", "w3"]},
                                float(now))
        _starved(state, 1, start=now)
    (job,) = state.jobs.values()
    assert len(job.tasks) == 3
    assert job.metrics.desired == (6 if cap is None else 3)
    assert state.status(40.0)["summary"]["worker_cap"] == cap


def test_an_actuator_not_heard_from_no_longer_bounds_the_fleet():
    state = State()
    ready(state, "w1", "h/boot/ns")
    ready(state, "w2", "h/boot/ns")  # a fixed worker (zloader-worker --processes 1)
    state.note_actuator({"id": "a1", "cap": 4, "workers": ["w1"]}, 0.0)
    assert state.status(1.0)["summary"]["worker_cap"] == 5  # its 4, and the fixed one
    assert state.status(1.0 + ACTUATOR_EXPIRY + 1)["summary"]["worker_cap"] is None


@pytest.mark.parametrize("entry", [None, "a1", {"id": "a1"}, {"id": "a1", "cap": 0},
                                   {"id": "a1", "cap": True, "workers": []},
                                   {"id": "", "cap": 2, "workers": []},
                                   {"id": "a1", "cap": 2}, {"id": "a1", "cap": 2, "workers": [7]},
                                   {"id": "a1", "cap": 2, "workers": "w1"}])
def test_a_malformed_actuator_report_is_counted_and_ignored(entry):
    state = State()
    state.note_actuator(entry, 0.0)
    assert state.rejected == 1 and state.status(0.0)["summary"]["worker_cap"] is None


def test_a_bad_autoscale_setting_is_refused_with_the_flag_named():
    worker_bin = os.path.join(BIN, "zloader-worker")
    done = subprocess.run([worker_bin, "--broker", "tcp://127.0.0.1:1", "--max-processes",
                           "2"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--max-processes is the budget of --autoscale" in done.stderr
    broker_bin = os.path.join(BIN, "zloader-broker")
    done = subprocess.run([broker_bin, "--autoscale-cooldown", "0"], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 2 and "--autoscale-cooldown" in done.stderr


@pytest.mark.slow
def test_the_local_actuator_grows_for_a_starved_consumer_and_shrinks_for_an_idle_one():
    address = f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([os.path.join(BIN, "zloader-broker"), "--bind", address,
                               "--heartbeat", "0.2", "--autoscale-cooldown", "1.5",
                               "--log-level", "error"])
    actuator = subprocess.Popen([os.path.join(BIN, "zloader-worker"), "--broker", address,
                                 "--autoscale", "--max-processes", "3", "--processes", "1",
                                 "--autoscale-interval", "0.3"])
    counts: list[int] = []

    def processes() -> int:
        return len(psutil.Process(actuator.pid).children())

    def work(x):  # a worker makes ~200 elements/s
        time.sleep(0.005)
        return x

    try:
        wait_for(lambda: (s := status(address, 1.0)) is not None and s["workers"],
                 what="the broker and the first worker")
        # The consumer needs ~500 elements/s (2 ms each): one worker leaves it waiting
        # ~60% of the time, three keep up.
        pause = [0.002]
        with Loader(Pipeline.range(10**6, split_size=20).map(work), broker=address,
                    timeout=30) as loader:
            deadline = time.monotonic() + 100
            looked = 0.0
            seen: list[int] = []
            for x in loader:
                seen.append(x)
                time.sleep(pause[0])
                if time.monotonic() - looked < 0.25:
                    continue
                looked = time.monotonic()
                counts.append(processes())
                if pause[0] < 0.01 and counts[-1] >= 3:
                    pause[0] = 0.05  # now a slow trainer: the workers wait for it
                elif pause[0] > 0.01 and counts[-1] == 1:
                    break
                assert looked < deadline, f"no settling: process counts {counts}"
        assert max(counts) == 3 and counts[-1] == 1
        assert len(set(seen)) == len(seen)  # drained workers repeated nothing
        stop(actuator, timeout=40)
        assert actuator.returncode == 0
    finally:
        stop(actuator, timeout=40)
        stop(broker)
