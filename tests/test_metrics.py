"""``zloader-broker --metrics-port``: Prometheus text, scraped and parsed while a Loader
reads through the broker's workers."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service import BIN, HEARTBEAT, free_port, start_worker, status, stop, wait_for
from zloader import Loader, Pipeline
from zloader.metrics import JOB_METRICS, WORKER_METRICS


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_the_metrics_endpoint_serves_job_and_worker_metrics_while_a_loader_reads():
    address, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    broker = subprocess.Popen([os.path.join(BIN, "zloader-broker"), "--bind", address,
                               "--heartbeat", str(HEARTBEAT), "--metrics-port", str(port),
                               "--log-level", "error"])
    worker = start_worker(address)
    try:
        wait_for(lambda: status(address, 1.0) is not None and status(address)["workers"],
                 what="the broker and its worker")

        def slow(x):
            time.sleep(0.0005)
            return x

        with Loader(Pipeline.range(10**6).map(slow), broker=address, job_name="metered",
                    timeout=20) as loader:
            for i, _ in enumerate(loader):
                if i == 3000:
                    break
            def reported() -> bool:  # workers and consumers report every heartbeat
                got = scrape(port)
                return (any(s.value > 0 for s in got["zloader_job_consumer_wait_seconds"])
                        and any(s.value >= 3000 for s in got["zloader_job_elements"]))

            wait_for(reported, what="the workers' and the consumer's reports")
            families = scrape(port)
            wait_for(lambda: loader.stats()["stage_seconds"].get("pipeline", 0) > 0,
                     what="the stage times in loader.stats()")
            loader_stages = loader.stats()["stage_seconds"]
        for _, name, _kind, _ in JOB_METRICS + WORKER_METRICS:
            assert name.removesuffix("_total") in families, name
        (elements,) = families["zloader_job_elements"]
        assert elements.name == "zloader_job_elements_total"  # a counter, by convention
        assert elements.labels["job_name"] == "metered" and elements.value >= 3000
        (consumers,) = families["zloader_job_consumers"]
        assert consumers.value == 1
        (desired,) = families["zloader_job_desired_workers"]
        assert desired.value >= 1  # one worker to start with; the policy may want more
        (cpu,) = families["zloader_worker_cpu_seconds"]
        assert cpu.value > 0 and cpu.labels["job_id"] == elements.labels["job_id"]
        (starvation,) = families["zloader_job_starvation_ratio"]
        assert 0.0 <= starvation.value <= 1.0
        stages = {s.labels["stage"]: s.value for s in families["zloader_job_stage_seconds"]}
        assert set(stages) == {"pipeline", "splits", "encode", "blocked"}
        assert stages["pipeline"] > 0  # the map sleeps 0.5 ms an element
        seen = loader_stages
        assert set(seen) == {"pipeline", "splits", "encode", "blocked", "wait"}
    finally:
        stop(worker)
        stop(broker)


def test_a_bad_metrics_port_is_refused_with_a_clear_message():
    done = subprocess.run([os.path.join(BIN, "zloader-broker"), "--metrics-port", "70000"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--metrics-port must be a port number" in done.stderr


@pytest.mark.parametrize("taken", [True])
def test_a_metrics_port_in_use_is_reported(taken):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = subprocess.run([os.path.join(BIN, "zloader-broker"), "--bind",
                               f"tcp://127.0.0.1:{free_port()}", "--metrics-port", str(port),
                               "--log-level", "error"],
                              capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "cannot serve metrics" in done.stderr


def test_zloader_top_shows_jobs_with_rates_and_starvation_and_workers():
    from tests.service import service

    with service(workers=1) as (address, _):
        with Loader(Pipeline.range(10**7), broker=address, job_name="watched",
                    timeout=20) as loader:
            reading = iter(loader)
            for _ in range(1000):
                next(reading)
            top = subprocess.Popen([os.path.join(BIN, "zloader"), "top", "--broker", address,
                                    "--interval", "0.5", "--iterations", "3"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 30
            while top.poll() is None and time.monotonic() < deadline:
                next(reading)  # keep the job busy while top samples it
            out, err = top.communicate(timeout=10)
        assert top.returncode == 0, err
        frames = out.split("zloader top: ")
        assert len(frames) == 4  # three refreshes
        last = frames[-1]
        assert "1 jobs, 1 workers" in last and "watched" in last and "starved" in last
        row = next(line for line in last.splitlines() if "watched" in line)
        assert row.split()[4] != "-"  # elements/s, over the time since the last refresh
    silent = subprocess.run([os.path.join(BIN, "zloader"), "top", "--broker", address,
                             "--timeout", "0.5", "--iterations", "1"],
                            capture_output=True, text=True, timeout=30)
    assert silent.returncode == 1 and "no answer" in silent.stderr
