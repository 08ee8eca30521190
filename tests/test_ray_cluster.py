"""Workers as Ray actors on a multi-node Ray cluster (``ray.cluster_utils.Cluster``: a head
and two worker nodes with custom resources, all on this machine): placement by resources,
a job exact through an actor's death and a node's removal, and the Ray actuator growing
actors on the node a resource names for a starved consumer and letting them go once the
job ends. In ``make test`` (the test extras install Ray): about 30 s."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests.service import BIN, HEARTBEAT, free_port, status, stop, wait_for
from zloader import Loader, Pipeline

N = 12_000


def slow(x: int) -> int:
    time.sleep(0.001)
    return x


def slower(x: int) -> int:
    time.sleep(0.004)
    return x


def test_two_nodes_place_by_resources_keep_a_job_exact_and_the_actuator_grows_and_shrinks(
        tmp_path):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    import zloader.ray as zray

    keys = str(tmp_path / "keys")
    subprocess.run([os.path.join(BIN, "zloader"), "keygen", keys], check=True,
                   capture_output=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    node_a = cluster.add_node(num_cpus=2, resources={"node_a": 4})
    node_b = cluster.add_node(num_cpus=2, resources={"node_b": 4})
    ray.init(address=cluster.address, log_to_driver=False)
    host = ray.util.get_node_ip_address()  # (every node's: they all run on this machine)
    address = f"tcp://{host}:{free_port()}"
    broker = subprocess.Popen([os.path.join(BIN, "zloader-broker"), "--bind", address,
                               "--keys", keys, "--heartbeat", str(HEARTBEAT),
                               "--autoscale-cooldown", "1.5", "--log-level", "error"])
    try:
        on_a = zray.start_workers(address, 2, num_cpus_per_worker=0.5, keys=keys,
                                  resources={"node_a": 1})
        on_b = zray.start_workers(address, 1, num_cpus_per_worker=0.5, keys=keys,
                                  resources={"node_b": 1})
        # Placed by their resources: each actor runs on the node that has them.
        assert {i["node"] for i in on_a.info} == {node_a.node_id}
        assert {i["node"] for i in on_b.info} == {node_b.node_id}
        wait_for(lambda: len(status(address, keys=keys)["workers"]) == 3,
                 what="the three actors' workers")

        seen: list[int] = []
        with Loader(Pipeline.range(N, split_size=100).map(slow), broker=address,
                    keys=keys, timeout=60) as loader:
            for x in loader:
                seen.append(int(x))
                if len(seen) == N // 4:  # an actor's process dies: Ray restarts it
                    os.kill(on_a.info[0]["pid"], signal.SIGKILL)
                if len(seen) == N // 2:  # a node goes, its actor with it
                    cluster.remove_node(node_b)
        assert sorted(seen) == list(range(N)), (
            f"{len(seen)} elements, {len(set(seen))} distinct")
        on_a.check(timeout=5.0)
        assert len(on_a) == 2  # the restarted actor was kept (and serves again)
        on_a.stop()
        on_b.stop()
        wait_for(lambda: not status(address, keys=keys)["workers"],
                 what="the stopped actors' workers to leave")

        # The actuator: no worker, a starved consumer; it grows two actors on node a (the
        # resource it was given), and lets them go once the job is over.
        actuator = zray.RayActuator(address, max_workers=2, interval=0.3, remote_delay=0.5,
                                    keys=keys, num_cpus_per_worker=0.5,
                                    resources={"node_a": 1})
        with actuator:
            with Loader(Pipeline.range(10**6, split_size=20).map(slower), broker=address,
                        keys=keys, timeout=60) as loader:
                deadline = time.monotonic() + 60
                for _ in loader:
                    if len(actuator.workers) == 2:
                        break
                    assert time.monotonic() < deadline, "the Ray actuator did not grow"
                assert {i["node"] for i in actuator.workers.info} == {node_a.node_id}
            wait_for(lambda: len(actuator.workers) == 0, timeout=60,
                     what="the actuator to let its actors go after the job")
    finally:
        zray.stop_all()
        ray.shutdown()
        cluster.shutdown()
        stop(broker)
