"""``zloader-broker --metrics-port``: Prometheus text, scraped and parsed while a Loader
reads through the broker's workers."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service import BIN, HEARTBEAT, free_port, start_worker, status, stop, wait_for
from zloader import Loader, Pipeline
from zloader.broker.metrics import JOB_METRICS, WORKER_METRICS


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


@pytest.mark.slow
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
        (deaths,) = families["zloader_broker_worker_deaths"]
        assert deaths.name == "zloader_broker_worker_deaths_total" and deaths.value == 0
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


@pytest.mark.slow
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
        assert row.split()[5] != "-"  # elements/s, over the time since the last refresh
    silent = subprocess.run([os.path.join(BIN, "zloader"), "top", "--broker", address,
                             "--timeout", "0.5", "--iterations", "1"],
                            capture_output=True, text=True, timeout=30)
    assert silent.returncode == 1 and "no answer" in silent.stderr


@pytest.mark.slow
def test_a_consumer_waiting_for_a_job_without_workers_is_starved_in_status_and_metrics():
    """Nothing serves the consumer that waits: its job is 100% starved, not 0%."""
    address, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    broker = subprocess.Popen([os.path.join(BIN, "zloader-broker"), "--bind", address,
                               "--heartbeat", str(HEARTBEAT), "--metrics-port", str(port),
                               "--log-level", "error"])
    worker = None
    try:
        wait_for(lambda: status(address, 1.0) is not None, what="the broker")
        with Loader(Pipeline.range(10), broker=address, timeout=30) as loader:
            got: list[int] = []
            reader = threading.Thread(target=lambda: got.extend(loader))
            reader.start()  # it waits: the job has no worker

            def starved() -> bool:
                jobs = status(address)["jobs"]
                ratios = scrape(port).get("zloader_job_starvation_ratio", [])
                return (len(jobs) == 1 and jobs[0]["starvation"] > 0.9
                        and len(ratios) == 1 and ratios[0].value > 0.9)

            try:
                wait_for(starved, what="the job to show as starved")
            finally:
                worker = start_worker(address)  # now served: the reader ends
                reader.join(30)
            assert sorted(got) == list(range(10))
    finally:
        for process in (worker, broker):
            if process is not None:
                stop(process)


def test_status_and_top_name_jobs_by_their_id_like_json_and_metrics():
    from tests.service import service

    with service(workers=1) as (address, _):
        with Loader(Pipeline.range(10**6), broker=address, job_name="named",
                    timeout=20) as loader:
            next(iter(loader))
            (job,) = status(address)["jobs"]
            table = subprocess.run([os.path.join(BIN, "zloader"), "status", "--broker",
                                    address], capture_output=True, text=True, timeout=30)
            top = subprocess.run([os.path.join(BIN, "zloader"), "top", "--broker", address,
                                  "--iterations", "1"], capture_output=True, text=True,
                                 timeout=30)
        for out in (table.stdout, top.stdout):
            rows = [line.split() for line in out.splitlines() if "named" in line]
            assert rows and rows[0][0] == job["job"], out  # the id leads the job's row
        assert job["fingerprint"][:16] in table.stdout  # still shown, as an extra column
