"""The service end to end: real broker and worker processes, real sockets, real shared
memory. Ports of tf.data service's scenarios plus zloader's own guarantees."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from tests.service import service, start_broker, start_worker, status, stop, wait_for
from zloader import Loader, Pipeline, PipelineError, Timeout, WorkerExited
from zloader._defaults import DEFAULT_PREFETCH
from zloader.transport.protocol import VERSION, Command, encode


def test_one_worker_yields_range_in_order():
    with Loader(Pipeline.range(10), num_workers=1, timeout=30) as loader:
        assert list(loader) == list(range(10))


def test_one_worker_matches_iter_with_seeded_shuffle_and_batch():
    pipeline = Pipeline.range(100, shuffle_splits=True, seed=3).shuffle(20, seed=4).batch(7)
    with Loader(pipeline, num_workers=1, timeout=30) as loader:
        for epoch in range(2):
            got = [b.tolist() for b in loader]
            assert got == [b.tolist() for b in pipeline.iter(epoch)]


def test_sharding_off_gives_every_worker_the_whole_pipeline():
    with Loader(Pipeline.range(10), num_workers=3, sharding="off", timeout=30) as loader:
        assert sorted(loader) == sorted(list(range(10)) * 3)


def test_dynamic_sharding_yields_each_element_once_over_ten_epochs():
    with Loader(Pipeline.range(100).map(lambda x: x * 2), num_workers=2, timeout=30) as loader:
        for _ in range(10):
            assert sorted(loader) == [x * 2 for x in range(100)]
        assert loader.stats()["elements"] == 1000
        assert len(loader.stats()["per_worker"]) >= 1


def test_static_and_deterministic_runs_repeat_exactly():
    pipeline = Pipeline.range(200, split_size=10).map(lambda x: x + 1)
    runs = []
    for _ in range(2):
        with Loader(pipeline, num_workers=2, deterministic=True, timeout=30) as loader:
            runs.append(list(loader))
    assert runs[0] == runs[1]
    assert sorted(runs[0]) == [x + 1 for x in range(200)]
    with Loader(pipeline, num_workers=2, sharding="static", timeout=30) as loader:
        assert sorted(loader) == [x + 1 for x in range(200)]


def test_take_is_global_not_per_worker():
    with Loader(Pipeline.range(1000).take(15), num_workers=2, timeout=30) as loader:
        assert len(list(loader)) == 15
        assert len(list(loader)) == 15  # the next epoch starts cleanly after an early stop


def test_element_larger_than_16_mib_round_trips():
    def big(split):
        yield np.full(5_000_000, split, dtype=np.int64)  # 40 MB, larger than the ring

    with Loader(Pipeline.from_generator(big, 2), num_workers=1, timeout=60,
                ring_bytes=16 << 20) as loader:
        out = sorted(loader, key=lambda a: int(a[0]))
        assert loader.stats()["segments"] == 2  # larger than the ring: a segment each
    assert [int(a[0]) for a in out] == [0, 1] and all(a.nbytes == 40_000_000 for a in out)
    assert all(int(a[-1]) == int(a[0]) for a in out)  # still readable after close
    with Loader(Pipeline.from_generator(big, 2), num_workers=1, timeout=60,
                transport="tcp") as loader:
        assert sorted(int(a[0]) for a in loader) == [0, 1]


def test_elements_held_past_what_the_ring_holds_bypass_it_and_stay_intact():
    def blocks(split):
        for _ in range(8):
            yield np.full(65536, split, dtype=np.uint8)

    # 24 MiB held, more than the ring grows to for these records (prefetch + 2 of them).
    # Records that find the ring full travel as frames ("private") or, when they reach
    # a segment's size (how many elements a record gathers depends on timing), in a
    # segment of their own: either way nothing waits for the user to let go.
    pipeline = Pipeline.from_generator(blocks, 48)
    with Loader(pipeline, num_workers=1, ring_bytes=1 << 20, timeout=60) as loader:
        kept = list(loader)  # holds every element: the ring fills up
        assert len(kept) == 384 and all(int(a[0]) == a[-1] for a in kept)
        stats = loader.stats()
        assert stats["private"] + stats["segments"] > 0
        assert sorted({int(a[0]) for a in kept}) == list(range(48))
    assert all(int(a[0]) == a[-1] for a in kept)  # still readable after close


def test_user_error_arrives_as_pipeline_error_with_the_worker_traceback():
    def fail(x):
        if x == 5:
            raise KeyError("missing label")
        return x

    with Loader(Pipeline.range(10).map(fail, name="labels"), num_workers=1,
                timeout=30) as loader, pytest.raises(KeyError) as info:
        list(loader)
    assert isinstance(info.value, PipelineError) and info.value.stage == "labels"
    assert "in fail" in info.value.traceback and "missing label" in info.value.traceback


def _fail_odd(x):
    if x % 2:
        raise ValueError("odd")
    return x


def test_on_error_skip_drops_and_counts():
    with Loader(Pipeline.range(20).map(_fail_odd), num_workers=1, on_error="skip",
                timeout=30) as loader:
        assert sorted(loader) == list(range(0, 20, 2))
        assert loader.stats()["skipped"] == 10


def test_no_broker_times_out_naming_the_address():
    start = time.monotonic()
    with Loader(Pipeline.range(3), broker="tcp://127.0.0.1:1", timeout=1.5) as loader, \
            pytest.raises(Timeout, match=re.escape("tcp://127.0.0.1:1")):
        list(loader)
    assert time.monotonic() - start < 30


def test_distributed_job_name_splits_elements_between_loaders():
    with service(workers=2) as (address, _):
        pipeline = Pipeline.range(1000)
        results: list[list[int]] = [[], []]
        loaders = [Loader(pipeline, broker=address, job_name="shared", timeout=30)
                   for _ in range(2)]
        try:
            threads = [threading.Thread(target=lambda i=i: results[i].extend(loaders[i]))
                       for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        finally:
            for loader in loaders:
                loader.close()
        assert sorted(results[0] + results[1]) == list(range(1000))


def test_same_job_name_with_another_pipeline_is_refused():
    with service(workers=1) as (address, _):
        with Loader(Pipeline.range(10), broker=address, job_name="j", timeout=30) as first:
            assert sorted(first) == list(range(10))
            with Loader(Pipeline.range(11), broker=address, job_name="j",
                        timeout=30) as second, pytest.raises(ValueError, match="job_name 'j'"):
                list(second)


def test_broker_and_workers_started_after_the_loader():
    broker, address = None, None
    from tests.service import free_port
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    with Loader(Pipeline.range(50), broker=address, timeout=30) as loader:
        broker, _ = start_broker(port)
        worker = start_worker(address)
        try:
            assert sorted(loader) == list(range(50))
        finally:
            stop(worker)
            stop(broker)


@pytest.mark.slow
def test_worker_added_mid_job_takes_part():
    def slow(x):
        time.sleep(0.002)
        return x

    with service(workers=1) as (address, procs):
        with Loader(Pipeline.range(3000).map(slow), broker=address, timeout=30) as loader:
            seen = []
            for i, x in enumerate(loader):
                seen.append(x)
                if i == 100:
                    procs.append(start_worker(address))
            assert sorted(seen) == list(range(3000))
            assert len(loader.stats()["per_worker"]) == 2


@pytest.mark.slow
def test_killing_four_of_five_workers_on_an_endless_pipeline_does_not_hang():
    with service(workers=5) as (address, procs):
        with Loader(Pipeline.range(100).repeat(), broker=address, timeout=30) as loader:
            start = time.monotonic()
            for i, _ in enumerate(loader):
                if i == 500:
                    for p in procs[:4]:
                        p.send_signal(signal.SIGKILL)
                if i == 20_000:
                    break
            assert time.monotonic() - start < 60
            wait_for(lambda: len(status(address)["workers"]) == 1, what="the purge")


def test_bad_frames_and_wrong_versions_are_refused_and_ignored():
    with service(workers=1) as (address, _):
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(address)
            for junk in ([b"garbage"], [b"a", b"b", b"c", b"d"], [VERSION, b"\xff", b"{}"],
                         [VERSION, bytes((Command.REGISTER,)), b"not json"]):
                sock.send_multipart(junk)
            sock.send_multipart([b"ZLP/0 py/2.7 cp/0", bytes((Command.STATUS,)), b"{}"])
            assert sock.poll(5000)
            reply = sock.recv_multipart()
            assert b"protocol mismatch" in reply[2] or b"ZLP/0" in reply[2]
            sock.send_multipart(encode(Command.STATUS, {}))
            wait_for(lambda: sock.poll(100), what="a STATUS answer after the junk")
        finally:
            sock.close(0)
            context.term()
        with Loader(Pipeline.range(5), broker=address, timeout=30) as loader:
            assert sorted(loader) == list(range(5))


def test_status_lists_workers_and_jobs():
    with service(workers=2) as (address, _):
        with Loader(Pipeline.range(100), broker=address, timeout=30) as loader:
            assert sorted(loader) == list(range(100))
            body = status(address)
            assert len(body["workers"]) == 2
            assert body["jobs"] and body["jobs"][0]["fingerprint"] == loader.pipeline.fingerprint
            assert {"host", "pid", "tasks", "elements_per_second"} <= set(body["workers"][0])


def test_close_leaves_no_process_or_segment():
    loader = Loader(Pipeline.range(10), num_workers=2, timeout=30)
    assert sorted(loader) == list(range(10))
    pids = [p.pid for p in loader._processes]
    loader.close()
    loader.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_an_iterator_keeps_its_loader_alive_and_lets_it_go_after_the_epoch():
    import gc
    import weakref

    # (before: "the Loader was closed while this iterator waited for data")
    assert sorted(x for x in Loader(Pipeline.range(3000, split_size=100), num_workers=2,
                                    timeout=30)) == list(range(3000))
    elements = iter(Loader(Pipeline.range(500), num_workers=2, timeout=30))
    gc.collect()
    assert sorted(elements) == list(range(500))
    loader = Loader(Pipeline.range(10), num_workers=1, timeout=30)
    pids = [p.pid for p in loader._processes]
    alive = weakref.ref(loader)
    elements = iter(loader)
    del loader
    assert alive() is not None  # held by its iterator
    assert sorted(elements) == list(range(10))
    del elements
    assert alive() is None  # the epoch over and the iterator gone: closed, workers gone
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_worker_killed_mid_epoch_does_not_hang_and_its_splits_are_rerun():
    def slow(x):
        time.sleep(0.005)
        return x

    with service(workers=3) as (address, procs):
        pipeline = Pipeline.range(600, split_size=5).map(slow)
        with Loader(pipeline, broker=address, timeout=30) as loader:
            start = time.monotonic()
            seen = []
            for i, x in enumerate(loader):
                seen.append(x)
                if i == 60:
                    procs[0].send_signal(signal.SIGKILL)
            assert set(seen) == set(range(600))  # at-least-once: repeats allowed, no loss
            assert time.monotonic() - start < 60
            assert sorted(loader) == list(range(600))  # the next epoch is whole again


@pytest.mark.slow
def test_splits_of_a_worker_killed_after_the_others_ended_are_read_in_a_rerun():
    def slow_start(x):
        if x < 5:
            time.sleep(0.4)  # split 0 holds its worker while the other finishes the epoch
        return x

    with service(workers=2) as (address, procs):
        pipeline = Pipeline.range(100, split_size=5).map(slow_start)
        with Loader(pipeline, broker=address, timeout=30) as loader:
            seen = []
            for x in loader:
                seen.append(x)
                if len(seen) == 95:  # everything but split 0, all from the fast worker
                    fast = set(loader.stats()["per_worker"])
                    (slow,) = [p for p in procs if p.pid not in fast]
                    slow.send_signal(signal.SIGKILL)
            assert sorted(set(seen)) == list(range(100))


CONSUMER = """
import signal, sys, time
# As from a terminal, even when this suite runs with SIGINT ignored (a background job).
signal.signal(signal.SIGINT, signal.default_int_handler)
from zloader import Loader, Pipeline
loader = Loader(Pipeline.range(10**9).map(lambda x: x), {where}, timeout=30)
for i, x in enumerate(loader):
    if i == 100:
        print("reading", flush=True)
    time.sleep(0.001)
"""


@contextlib.contextmanager
def _reading_consumer(where: str, **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """A CONSUMER process in a session of its own, once it is reading; killed (with its
    group) and its pipes closed on exit."""
    script = CONSUMER.format(where=where)
    consumer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                text=True, start_new_session=True, **popen)
    try:
        assert consumer.stdout is not None
        assert consumer.stdout.readline().strip() == "reading"
        yield consumer
    finally:
        if consumer.poll() is None:
            os.killpg(consumer.pid, signal.SIGKILL)
            consumer.wait()
        for pipe in (consumer.stdout, consumer.stderr):
            if pipe is not None:
                pipe.close()


def _segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"zloader-{os.getuid()}-{pid}-")]


@pytest.mark.slow
def test_consumer_killed_mid_epoch_releases_its_shared_memory():
    with service(workers=2) as (address, _), \
            _reading_consumer(f"broker={address!r}") as consumer:
        assert _segments_of(consumer.pid)  # it reads its co-located workers via rings
        consumer.send_signal(signal.SIGKILL)
        consumer.wait(10)
        wait_for(lambda: not _segments_of(consumer.pid), timeout=20,
                 what="the workers to remove the dead consumer's rings")
        # Its job is kept a while for it (it may only be stalled: see test_state.py's
        # test_a_job_whose_consumers_went_silent_lingers_and_one_they_left_does_not).
        assert len(status(address)["jobs"]) == 1


def test_ctrl_c_in_the_training_loop_ends_everything_without_worker_tracebacks():
    with _reading_consumer("num_workers=2", stderr=subprocess.PIPE) as consumer:
        os.killpg(consumer.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        consumer.wait(20)
        stderr = consumer.stderr.read()
        assert "KeyboardInterrupt" in stderr
        assert stderr.count("Traceback") == 1 and "worker.py" not in stderr
        assert "zloader/worker/" not in stderr
        wait_for(lambda: _group_gone(consumer.pid), timeout=10, what="the workers to exit")
        assert not _segments_of(consumer.pid)


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_user_modules_travel_by_value_to_workers_that_lack_them(tmp_path, monkeypatch):
    import importlib

    with service(workers=1) as (address, _):  # the worker's sys.path lacks tmp_path
        (tmp_path / "my_transforms.py").write_text("def triple(x):\n    return 3 * x\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        module = importlib.import_module("my_transforms")
        try:
            with Loader(Pipeline.range(10).map(module.triple), broker=address,
                        timeout=30) as loader:
                assert sorted(loader) == [3 * x for x in range(10)]
        finally:
            import sys
            sys.modules.pop("my_transforms", None)


@pytest.mark.slow
def test_a_split_that_kills_three_workers_is_reported_naming_it():
    def crash_on_seven(x):
        if x == 7:
            os._exit(3)  # the worker process dies, as with a segfault in a decoder
        return x

    with service(workers=4) as (address, _):
        pipeline = Pipeline.range(20, split_size=5).map(crash_on_seven)
        start = time.monotonic()
        with Loader(pipeline, broker=address, timeout=60) as loader, \
                pytest.raises(PipelineError, match="split 1") as info:
            list(loader)
        assert "died 3 times" in str(info.value)
        assert time.monotonic() - start < 60


def test_hybrid_local_workers_join_the_brokers_remote_ones():
    with service(workers=1) as (address, _):
        with Loader(Pipeline.range(2000, split_size=10).map(lambda x: x), broker=address,
                    num_workers=1, timeout=30) as loader:
            for _ in range(3):
                assert sorted(loader) == list(range(2000))
            wait_for(lambda: len(status(address)["workers"]) == 2, what="both workers")


def test_max_skipped_raises_once_exceeded():
    with Loader(Pipeline.range(200).map(_fail_odd), num_workers=1, on_error="skip",
                max_skipped=5, timeout=30) as loader, \
            pytest.raises(PipelineError, match="max_skipped=5"):
        list(loader)


@pytest.mark.slow
def test_all_workers_dead_raises_timeout_saying_so():
    with service(workers=1) as (address, procs):
        with Loader(Pipeline.range(10**9), broker=address, timeout=3) as loader:
            start = time.monotonic()
            with pytest.raises(Timeout, match="no worker"):
                for i, _ in enumerate(loader):
                    if i == 100:
                        procs[0].send_signal(signal.SIGKILL)
            assert time.monotonic() - start < 60


def test_workers_reconnect_to_a_restarted_broker():
    from tests.service import free_port

    port = free_port()
    broker, address = start_broker(port)
    worker = start_worker(address)
    try:
        wait_for(lambda: (status(address, 1.0) or {}).get("workers"), what="registration")
        broker.send_signal(signal.SIGKILL)
        broker.wait(10)
        broker, _ = start_broker(port)
        wait_for(lambda: (status(address, 1.0) or {}).get("workers"), timeout=30,
                 what="the worker to register with the new broker")
        with Loader(Pipeline.range(100), broker=address, timeout=30) as loader:
            assert sorted(loader) == list(range(100))
    finally:
        stop(worker)
        stop(broker)


@pytest.mark.slow
def test_large_in_memory_sources_reach_workers_from_the_loader():
    images = np.arange(3_000_000, dtype=np.float64).reshape(1000, 3000)  # 24 MB
    arrays = Pipeline.from_arrays({"x": images, "i": np.arange(1000)}).map(
        lambda e: (int(e["i"]), float(e["x"][0])))
    with Loader(arrays, num_workers=2, timeout=60) as loader:
        assert sorted(loader) == [(i, float(i * 3000)) for i in range(1000)]
    items = Pipeline.from_items([bytes([i % 256]) * 20_000 for i in range(500)])  # 10 MB
    with service(workers=1) as (address, _):
        with Loader(items.map(len), broker=address, timeout=60) as loader:
            assert list(loader) == [20_000] * 500


def test_bad_frames_to_a_worker_data_port_are_ignored():
    with service(workers=1) as (address, _):
        endpoint = status(address)["workers"][0]["endpoint"]
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            for junk in ([b"x"], [VERSION, b"\x05", b"[]"], [VERSION, bytes((Command.OPEN,)),
                                                              b'{"job": 5}'],
                         [b"ZLP/11 py/0.0 cp/0", bytes((Command.CREDIT,)), b"{}"]):
                sock.send_multipart(junk)
            assert sock.poll(5000)  # the worker answers ERROR to what it can parse...
            reply = sock.recv_multipart()
            assert reply[1] == bytes((Command.ERROR,))
        finally:
            sock.close(0)
            context.term()
        with Loader(Pipeline.range(20), broker=address, timeout=30) as loader:
            assert sorted(loader) == list(range(20))  # ...and keeps serving


@pytest.mark.slow
def test_worker_processes_option_starts_that_many_workers():
    broker, address = start_broker()
    supervisor = None
    try:
        wait_for(lambda: status(address, 1.0) is not None, what="the broker")
        supervisor = start_worker(address, processes=3)
        wait_for(lambda: len(status(address)["workers"]) == 3, what="three workers")
        pids = {w["pid"] for w in status(address)["workers"]}
        assert supervisor.pid not in pids and len(pids) == 3  # each a process of its own
        stop(supervisor)
        assert supervisor.returncode == 0
        for pid in pids:
            wait_for(lambda pid=pid: not _alive(pid), what=f"worker {pid} to exit")
    finally:
        if supervisor is not None:
            stop(supervisor)
        stop(broker)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_ring_too_small_for_its_records_grows_until_they_fit():
    def blocks(split):
        for _ in range(10):
            yield np.full(3 << 20, split, dtype=np.uint8)  # 3 MiB records

    pipeline = Pipeline.from_generator(blocks, 6)
    with Loader(pipeline, num_workers=1, ring_bytes=4 << 20, timeout=60) as loader:
        for _ in range(2):
            assert sorted(int(a[0]) for a in loader) == sorted(list(range(6)) * 10)
        stats = loader.stats()
        # the first record showed the 4 MiB ring too small: it grew at once, so few or no
        # records took the slow path (a socket or a segment of their own)...
        grown = stats["private"] + stats["segments"]
        for _ in range(2):
            for _ in loader:
                pass
        stats = loader.stats()
        # ...and the grown ring holds them: a ring too small would send them all the slow
        # way. (A few may still go so: after a restart at the region start, rule 6 of
        # transport/ring.py, a consumer that suddenly holds more than RING_RESTART_ROOM
        # records has the next ones find the ring full: a busy machine's timing.)
        assert stats["private"] + stats["segments"] - grown <= 120 // 3
        ring = loader._io.peers()[0].ring  # those in flight, held and being written
        assert ring.capacity >= (DEFAULT_PREFETCH + 2) * (3 << 20)


def test_spawned_workers_work_like_forked_ones():
    pipeline = Pipeline.range(100, shuffle_splits=True, seed=1).map(lambda x: x * 3)
    with Loader(pipeline, num_workers=2, start_method="spawn", timeout=30) as loader:
        assert sorted(loader) == [x * 3 for x in range(100)]
    with pytest.raises(ValueError, match="start_method must be one of"):
        Loader(pipeline, num_workers=1, start_method="thread")


@pytest.mark.slow
def test_an_embedded_consumer_killed_hard_leaves_nothing_after_the_next_loaders_sweep():
    import tempfile

    with _reading_consumer("num_workers=1") as consumer:
        prefix = f"zloader-{consumer.pid}-"
        leftover = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefix)]
        assert leftover  # its broker and worker sockets live there
        os.killpg(consumer.pid, signal.SIGKILL)  # the consumer and its forked worker
        consumer.wait(10)
        wait_for(lambda: _group_gone(consumer.pid), timeout=10, what="the group to die")
        with Loader(Pipeline.range(3), num_workers=1, timeout=20) as loader:  # sweeps
            assert sorted(loader) == [0, 1, 2]
        assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefix)]
        assert not _segments_of(consumer.pid)


def test_an_embedded_trainer_stopped_by_sigterm_leaves_nothing_behind():
    """SIGTERM (what SLURM, Kubernetes and `timeout` send) ends a trainer without running
    its cleanup: its own workers, which outlive it briefly, remove its rings and socket
    directory, with no later Loader needed to sweep."""
    import tempfile

    with _reading_consumer("num_workers=2") as consumer:
        prefix = f"zloader-{consumer.pid}-"
        assert _segments_of(consumer.pid)
        consumer.send_signal(signal.SIGTERM)  # the trainer only: its workers see it go
        wait_for(lambda: consumer.poll() is not None, timeout=20, what="the trainer to exit")
        wait_for(lambda: not _segments_of(consumer.pid), timeout=10,
                 what="the workers to remove the trainer's rings")
        wait_for(lambda: not [n for n in os.listdir(tempfile.gettempdir())
                              if n.startswith(prefix)], timeout=10,
                 what="the workers to remove the trainer's socket directory")


@pytest.mark.slow
def test_a_worker_drained_by_sigterm_finishes_its_splits_nothing_lost_or_repeated():
    def slow(x):
        time.sleep(0.003)
        return x

    with service(workers=2) as (address, procs):
        with Loader(Pipeline.range(600, split_size=20).map(slow), broker=address,
                    timeout=30) as loader:
            seen = []
            for x in loader:
                seen.append(x)
                if len(seen) == 100:
                    procs[0].send_signal(signal.SIGTERM)  # as a scale-down would
            assert sorted(seen) == list(range(600))  # exactly once: no split read twice
            assert procs[0].wait(30) == 0  # it left once done
            assert sorted(loader) == list(range(600))  # the other worker serves on


def _slow(x: int) -> int:
    time.sleep(0.002)
    return x


@pytest.mark.parametrize("sharding", ["static", "dynamic"])
def test_an_embedded_loader_whose_epoch_needs_a_dead_worker_raises_worker_exited(sharding):
    """Static sharding: the dead worker's index has no one else to make it. Dynamic: both
    of the Loader's workers died. Either way it says so once the survivors' elements are
    in (not after a 60 s timeout)."""
    with Loader(Pipeline.range(2000, split_size=10).map(_slow), num_workers=2,
                sharding=sharding, timeout=60) as loader:
        victims = loader._processes if sharding == "dynamic" else loader._processes[:1]
        start = time.monotonic()
        with pytest.raises(WorkerExited, match="killed by SIGKILL") as info:
            for i, _ in enumerate(loader):
                if i == 50:
                    for process in victims:
                        os.kill(process.pid, signal.SIGKILL)
        assert set(info.value.pids) == {p.pid for p in victims}
        assert isinstance(info.value, RuntimeError)
        assert time.monotonic() - start < 30  # does not hang until the timeout


@pytest.mark.slow
def test_an_embedded_loader_that_lost_one_of_two_dynamic_workers_completes_its_epoch():
    with Loader(Pipeline.range(600, split_size=10).map(_slow), num_workers=2,
                timeout=60) as loader:
        seen = []
        for x in loader:
            seen.append(x)
            if len(seen) == 50:
                os.kill(loader._processes[0].pid, signal.SIGKILL)
        assert sorted(seen) == list(range(600))  # exactly once: nothing lost or repeated


@pytest.mark.slow
def test_static_sharding_a_killed_workers_index_goes_to_its_replacement():
    def slow(x):
        time.sleep(0.002)
        return x

    with service(workers=2) as (address, procs):
        pipeline = Pipeline.range(400, split_size=10).map(slow)
        with Loader(pipeline, broker=address, sharding="static", timeout=30) as loader:
            seen = []
            for x in loader:
                seen.append(x)
                if len(seen) == 60:
                    procs[0].send_signal(signal.SIGKILL)
                    procs.append(start_worker(address))  # takes the dead one's index
            assert set(seen) == set(range(400))  # at least once: the index read again


@pytest.mark.slow
def test_a_loader_started_before_its_broker_registers_once_it_is_up_and_again_after_a_restart():
    """The Loader repeats its REGISTER while nobody answers: those queued before the broker
    binds all arrive at once and must register it once, for one job. A broker restarted
    without a work dir forgot the job: the waiting Loader registers again and is served."""
    from tests.service import free_port

    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    broker = worker = None
    try:
        with Loader(Pipeline.range(50), broker=address, timeout=20) as loader:
            time.sleep(1.5)  # the fault: no broker yet while the Loader repeats its REGISTER
            broker, _ = start_broker(port)
            wait_for(lambda: (status(address, 1.0) or {}).get("jobs"), what="the job")
            time.sleep(1.0)  # the job waits without a worker
            worker = start_worker(address)
            assert sorted(loader) == list(range(50))
            assert len(status(address)["jobs"]) == 1
            broker.send_signal(signal.SIGKILL)
            broker.wait(10)
            got: list[int] = []
            reader = threading.Thread(target=lambda: got.extend(loader))
            reader.start()  # the next epoch waits for a broker that is down
            time.sleep(1.5)
            broker, _ = start_broker(port)  # no --work-dir: it forgot the job
            reader.join(60)
            assert not reader.is_alive() and sorted(got) == list(range(50))
            assert len(status(address)["jobs"]) == 1
    finally:
        for process in (worker, broker):
            if process is not None:
                stop(process)


def test_a_closed_job_releases_its_name_and_workers_at_once():
    """The last consumer's close (BYE) releases its job and workers now: a job_name rerun
    with an edited pipeline is served, and another job's first element does not wait for
    the closed job to be collected (a heartbeat of 1 s: that took 3 s and more)."""
    from tests.service import BIN, free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    broker = subprocess.Popen([os.path.join(BIN, "zloader-broker"), "--bind", address,
                               "--heartbeat", "1.0", "--log-level", "error"])
    worker = start_worker(address)
    try:
        wait_for(lambda: len((status(address, 1.0) or {}).get("workers", [])) == 1,
                 what="the worker")
        with Loader(Pipeline.range(20), broker=address, job_name="x", timeout=30) as first:
            assert sorted(first) == list(range(20))
        with Loader(Pipeline.range(30).map(lambda x: x + 1), broker=address, job_name="x",
                    timeout=30) as edited:
            assert sorted(edited) == list(range(1, 31))
        with Loader(Pipeline.range(40), broker=address, timeout=30) as other:
            start = time.monotonic()
            next(iter(other))
            assert time.monotonic() - start < 2.0  # loose: the old job's linger took 3 s
    finally:
        stop(worker)
        stop(broker)


MANY_THREADS = """
import threading
from zloader import Loader, Pipeline

results, errors = [], []

def run():
    try:
        with Loader(Pipeline.range(20).map(lambda x: x + 1), num_workers=1,
                    timeout=30) as loader:
            results.append(sum(loader))
    except BaseException as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=run) for _ in range(50)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(len(results), sorted(set(results)), errors[:3], flush=True)
"""


def test_a_loader_made_with_over_a_thousand_descriptors_open_starts_and_ends():
    """A process holding many files (fifty Loaders, a dataset's open shards) gives a new
    Loader descriptors numbered 1024 and more: its forked workers' gate and the wait for
    a worker's exit must not use ``select`` (which cannot take them)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) < 1200:
        pytest.skip("RLIMIT_NOFILE below 1,200")
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert max(held) >= 1024
        with Loader(Pipeline.range(40, split_size=4), num_workers=2, timeout=30) as loader:
            assert sorted(int(x) for x in loader) == list(range(40))
    finally:
        for fd in held:
            os.close(fd)
        if soft < 1200:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_fifty_loaders_made_on_threads_at_once_all_run():
    """Forking while other threads import (numpy's lazy parts, zloader's own modules) must
    not leave a worker waiting forever for an import lock held by a thread it lacks. A
    fresh interpreter, so that the imports really happen while the Loaders fork."""
    out = subprocess.run([sys.executable, "-c", MANY_THREADS], capture_output=True,
                         text=True, timeout=150, start_new_session=True)
    assert out.stdout.strip() == f"50 [{sum(range(1, 21))}] []", out.stderr[-2000:]


@pytest.mark.slow
def test_a_loader_no_free_worker_serves_times_out_saying_the_workers_run_other_jobs():
    """A Loader made while a static job holds the broker's only worker (static jobs keep
    their workers: their indices are fixed, docs/pool.md): its Timeout says why, not
    that the workers may have died."""
    with service(workers=1) as (address, _), \
            Loader(Pipeline.range(10**6), broker=address, sharding="static",
                   timeout=30) as train:
        elements = iter(train)
        next(elements)
        with pytest.raises(Timeout, match="1 workers all run other jobs"), \
                Loader(Pipeline.range(10), broker=address, timeout=3) as validation:
            list(validation)
        del elements


class _SlowToPickle:
    """Stops cloudpickle, inside ``dumps``, until ``go`` is set (``inside`` says it has)."""

    inside = threading.Event()
    go = threading.Event()

    def __reduce__(self) -> tuple[Any, ...]:
        _SlowToPickle.inside.set()
        _SlowToPickle.go.wait(10)
        return (int, (0,))


def test_pipelines_pickled_on_two_threads_at_once_both_go_by_value():
    """cloudpickle's registry of modules pickled by value is the process's: a Loader made
    while another pickled its pipeline on another thread unregistered that one's user
    modules under it (ValueError)."""
    from zloader.client.shipment import dumps

    held = _SlowToPickle()
    errors: list[BaseException] = []

    def pickle(value: Any) -> None:
        try:
            dumps(Pipeline.range(3).map(lambda x, v=value: (x, v)))
        except BaseException as exc:
            errors.append(exc)

    first = threading.Thread(target=pickle, args=(held,))
    first.start()
    assert _SlowToPickle.inside.wait(10)
    second = threading.Thread(target=pickle, args=(1,))
    second.start()
    second.join(1)  # (waits for the first, which holds the registry)
    _SlowToPickle.go.set()
    first.join(10)
    second.join(10)
    assert not errors, errors
