"""Workers as Ray actors on a local Ray cluster (``ray.init()`` here): they serve a job,
and the Ray actuator grows them for a starved consumer. Slow (Ray takes seconds to start);
``make test-slow`` installs Ray."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from tests.service import BIN, free_port, start_broker, status, stop, wait_for
from zloader import Loader, Pipeline

pytestmark = pytest.mark.slow


def slow(x):
    time.sleep(0.004)
    return x


def test_ray_actors_serve_a_job_and_the_ray_actuator_adds_them_for_a_starved_consumer():
    ray = pytest.importorskip("ray")  # make test-slow installs it (the ray extra)
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
        runner = threading.Thread(target=actuator.run)
        runner.start()
        try:
            # No worker at all: the job lacks one, then a second (the consumer waits).
            with Loader(Pipeline.range(10**6, split_size=20).map(slow), broker=address,
                        timeout=60) as loader:
                deadline = time.monotonic() + 60
                for _ in loader:
                    time.sleep(0.001)
                    if len(actuator.workers) == 2:
                        break
                    assert time.monotonic() < deadline, "the Ray actuator did not grow"
        finally:
            actuator.stop.set()
            runner.join(60)
        assert not runner.is_alive() and len(actuator.workers) == 0
    finally:
        ray.shutdown()
        stop(broker)


def test_ray_workers_of_a_loopback_broker_bind_loopback_and_need_no_keys():
    ray = pytest.importorskip("ray")
    import zloader.ray as zray

    broker, address = start_broker()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # Only this host reaches the broker: the actors run here, on loopback, keyless.
        workers = zray.start_workers(address, 2, num_cpus_per_worker=0.5)
        try:
            assert all(i["endpoint"].startswith("tcp://127.0.0.1:") for i in workers.info)
            wait_for(lambda: len(status(address)["workers"]) == 2, what="the actors' workers")
            with Loader(Pipeline.range(500).map(abs), broker=address, timeout=30) as loader:
                assert sorted(loader) == list(range(500))
        finally:
            workers.stop()
    finally:
        ray.shutdown()
        stop(broker)
