"""Workers as Ray actors on a local Ray cluster (``ray.init()`` here): they serve a job,
and the Ray actuator grows them for a starved consumer. Slow (Ray takes seconds to start);
the test extras install Ray (``make test``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.service import BIN, free_port, start_broker, status, stop, wait_for
from zloader import Loader, Pipeline

pytestmark = pytest.mark.slow


def slow(x):
    time.sleep(0.004)
    return x


def test_ray_actors_serve_a_job_and_the_ray_actuator_adds_them_for_a_starved_consumer():
    ray = pytest.importorskip("ray")  # (the test extras install it: make test)
    import zloader.ray as zray

    address = f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([os.path.join(BIN, "zloader-broker"), "--bind", address,
                               "--heartbeat", "0.2", "--autoscale-cooldown", "1.5",
                               "--log-level", "error"])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(ValueError, match="keys="):  # data ports open to the network
            zray.start_workers("tcp://10.255.0.1:5555", 1)  # (a broker elsewhere), no keys
        workers = zray.start_workers(address, 2, num_cpus_per_worker=0.5,
                                     advertise="127.0.0.1")
        assert len(workers) == 2 and all(i["pid"] != os.getpid() for i in workers.info)
        wait_for(lambda: len(status(address)["workers"]) == 2, what="the actors' workers")
        listed = {w["worker"] for w in status(address)["workers"]}
        assert listed == {i["worker"] for i in workers.info}
        with Loader(Pipeline.range(3000).map(abs), broker=address, timeout=30) as loader:
            assert sorted(loader) == list(range(3000))
        workers.stop()
        wait_for(lambda: not status(address)["workers"], what="the drained actors to leave")

        actuator = zray.RayActuator(address, max_workers=2, interval=0.3, remote_delay=0.5,
                                    advertise="127.0.0.1", num_cpus_per_worker=0.5)
        with actuator:  # (start(): it follows the broker on a thread of its own)
            runner = actuator._thread
            assert runner is not None
            # No worker at all: the job lacks one, then a second (the consumer waits).
            with Loader(Pipeline.range(10**6, split_size=20).map(slow), broker=address,
                        timeout=60) as loader:
                deadline = time.monotonic() + 60
                for _ in loader:
                    time.sleep(0.001)
                    if len(actuator.workers) == 2:
                        break
                    assert time.monotonic() < deadline, "the Ray actuator did not grow"
            wait_for(lambda: status(address)["summary"]["worker_cap"] == 2,
                     what="the broker to know the actuator's cap (its actors counted once)")
        assert not runner.is_alive() and len(actuator.workers) == 0
    finally:
        ray.shutdown()
        stop(broker)


@pytest.fixture
def local_ray() -> Iterator[tuple[Any, Any, str]]:
    """Ray on this host (2 CPUs) and a broker on loopback: (ray, zloader.ray, address)."""
    ray = pytest.importorskip("ray")  # (the test extras install it: make test)
    import zloader.ray as zray

    broker, address = start_broker()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray, zray, address
    finally:
        ray.shutdown()
        stop(broker)


def test_ray_workers_of_a_loopback_broker_bind_loopback_and_need_no_keys(local_ray):
    _, zray, address = local_ray
    # Only this host reaches the broker: the actors run here, on loopback, keyless.
    workers = zray.start_workers(address, 2, num_cpus_per_worker=0.5)
    try:
        assert all(i["endpoint"].startswith("tcp://127.0.0.1:") for i in workers.info)
        wait_for(lambda: len(status(address)["workers"]) == 2, what="the actors' workers")
        with Loader(Pipeline.range(500).map(abs), broker=address, timeout=30) as loader:
            assert sorted(loader) == list(range(500))
    finally:
        workers.stop()


def test_a_worker_actor_ray_restarts_is_kept_and_serves_again(local_ray):
    """A worker actor's process is SIGKILLed: Ray restarts it (max_restarts=-1), and
    check() keeps it meanwhile (it dropped the actor as lost, which cancelled Ray's
    restart: no worker came back)."""
    _, zray, address = local_ray
    workers = zray.start_workers(address, 1, num_cpus_per_worker=0.5)
    try:
        (first,) = workers.info
        wait_for(lambda: len(status(address)["workers"]) == 1, what="the actor's worker")
        os.kill(first["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # checked as an actuator does, once a second
            workers.check(timeout=2.0)
            assert len(workers) == 1, "the restarting actor was dropped"
            if workers.info[0]["worker"] != first["worker"]:
                break
            assert time.monotonic() < deadline, "Ray did not restart the actor"
            time.sleep(1.0)
        wait_for(lambda: {w["worker"] for w in status(address)["workers"]}
                 == {workers.info[0]["worker"]}, what="the restarted actor's worker")
    finally:
        workers.stop()


def test_a_loopback_broker_with_resources_this_node_lacks_is_refused_in_zloaders_words(
        local_ray):
    _, zray, address = local_ray
    # (Ray would never place it: zloader pins a loopback broker's actors here)
    with pytest.raises(ValueError, match=r"on loopback.*gpu_node=1"):
        zray.start_workers(address, 1, num_cpus_per_worker=0.5, resources={"gpu_node": 1})
