"""Ray worker actors live until they are stopped or the driver exits, whether or not the
caller keeps what ``start_workers`` returned (Ray kills an actor once every reference to
it is gone). Slow (Ray takes seconds to start); the test extras install Ray (``make test``)."""

from __future__ import annotations

import gc

import pytest

from tests.service import start_broker, status, stop, wait_for
from zloader import Loader, Pipeline

pytestmark = pytest.mark.slow


def test_workers_started_as_a_statement_serve_until_stop_all():
    ray = pytest.importorskip("ray")
    import zloader.ray as zray

    broker, address = start_broker()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        zray.start_workers(address, 2, num_cpus_per_worker=0.5)  # the handle is dropped
        gc.collect()
        wait_for(lambda: len(status(address)["workers"]) == 2, what="the actors' workers")
        with Loader(Pipeline.range(500).map(abs), broker=address, timeout=30) as loader:
            assert sorted(loader) == list(range(500))
        assert len(status(address)["workers"]) == 2  # still there after the job
        assert zray.stop_all() == 2
        wait_for(lambda: not status(address)["workers"], what="the drained actors to leave")
        assert zray.stop_all() == 0  # nothing left to stop

        kept = zray.start_workers(address, 1, num_cpus_per_worker=0.5)
        wait_for(lambda: len(status(address)["workers"]) == 1, what="a kept actor's worker")
        kept.stop()  # stopped by its handle: stop_all no longer holds it
        assert zray.stop_all() == 0
        wait_for(lambda: not status(address)["workers"], what="the stopped actor to leave")
    finally:
        zray.stop_all()
        ray.shutdown()
        stop(broker)
