"""Prometheus metrics of a broker: ``zloader-broker --metrics-port PORT``.

The broker loop takes a snapshot of its state once per heartbeat
(``zloader/broker/status.py``, ``metrics``); the HTTP server's thread only reads the
latest snapshot, so a scrape never touches state the loop is changing. Names follow
Prometheus conventions: counters end in ``_total``, units are in the name (``_seconds``,
``_bytes``), ratios end in ``_ratio``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["JOB_METRICS", "WORKER_METRICS", "serve"]

# (snapshot key, metric name, kind, help)
JOB_METRICS = [
    ("elements", "zloader_job_elements_total", "counter", "Elements the job's workers sent"),
    ("bytes", "zloader_job_bytes_total", "counter", "Bytes of records the job's workers sent"),
    ("wait_seconds", "zloader_job_consumer_wait_seconds_total", "counter",
     "Seconds the job's consumers waited for data, summed over consumers"),
    ("starvation", "zloader_job_starvation_ratio", "gauge",
     "Share of the last heartbeat interval the job's consumers waited for data"),
    ("skipped", "zloader_job_skipped_elements_total", "counter",
     "Elements dropped by on_error='skip'"),
    ("failed_splits", "zloader_job_failed_splits", "gauge", "Splits reported as failed"),
    ("consumers", "zloader_job_consumers", "gauge", "Consumers reading the job"),
    ("workers", "zloader_job_workers", "gauge", "Workers serving the job"),
    ("desired_workers", "zloader_job_desired_workers", "gauge",
     "Workers the job should have, as the broker's autoscaling policy decides"),
    ("share_workers", "zloader_job_share_workers", "gauge",
     "Workers the job is entitled to in the pool: weighted fair share, capped by its need"),
    ("weight", "zloader_job_weight", "gauge", "The job's weight in the pool (Loader(weight=))"),
]
WORKER_METRICS = [
    ("elements", "zloader_worker_elements_total", "counter", "Elements the worker sent"),
    ("bytes", "zloader_worker_bytes_total", "counter", "Bytes of records the worker sent"),
    ("cpu_seconds", "zloader_worker_cpu_seconds_total", "counter",
     "CPU time of the worker process (user + system)"),
    ("rejected", "zloader_worker_rejected_messages_total", "counter",
     "Malformed or refused messages the worker dropped"),
    ("credits", "zloader_worker_credits", "gauge",
     "Records the worker's consumers have granted and it has not yet sent"),
    ("ring_fill", "zloader_worker_ring_fill_ratio", "gauge",
     "Fullest shared-memory ring of the worker (written, not yet released / capacity)"),
]


class _Snapshot(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        data = self.snapshot()
        for key, name, kind, text in JOB_METRICS:
            family = _family(name, kind, text, ["job_id", "job_name"])
            for job in data.get("jobs", []):
                family.add_metric([job["job"], job["name"]], float(job.get(key, 0)))
            yield family
        for key, name, kind, text in WORKER_METRICS:
            family = _family(name, kind, text, ["worker", "host", "job_id"])
            for worker in data.get("workers", []):
                family.add_metric([worker["worker"], worker["host"], worker["job"]],
                                  float(worker.get(key, 0)))
            yield family
        stages = CounterMetricFamily(
            "zloader_job_stage_seconds", "Seconds the job's workers spent per stage: "
            "pipeline (user code, source), splits (waiting for the broker), encode, blocked "
            "(no credits: the consumers are slower)", labels=["job_id", "job_name", "stage"])
        for job in data.get("jobs", []):
            for stage, seconds in sorted(job.get("stages", {}).items()):
                stages.add_metric([job["job"], job["name"], stage], float(seconds))
        yield stages
        rejected = CounterMetricFamily("zloader_broker_rejected_messages",
                                       "Malformed or refused messages the broker dropped")
        rejected.add_metric([], float(data.get("rejected", 0)))
        yield rejected
        deaths = CounterMetricFamily("zloader_broker_worker_deaths",
                                     "Workers the broker dropped as dead: silent past their "
                                     "expiry, confirmed stuck, or gone without leaving")
        deaths.add_metric([], float(data.get("worker_deaths", 0)))
        yield deaths


def _family(name: str, kind: str, text: str, labels: list[str]) -> Any:
    if kind == "counter":
        return CounterMetricFamily(name.removesuffix("_total"), text, labels=labels)
    return GaugeMetricFamily(name, text, labels=labels)


def serve(snapshot: Callable[[], dict[str, Any]], port: int, bind: str) -> Any:
    """Serve the metrics of ``snapshot()`` at ``http://bind:port/metrics``; returns the
    server (call ``shutdown()`` on it to stop).

    Raises:
        OSError: the port cannot be bound.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(snapshot))
    server, _ = start_http_server(port, addr=bind, registry=registry)
    return server
