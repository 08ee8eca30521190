"""Helpers for ``bench.transport``: the producers, the consumer-side meter, the torch
datasets, and the peer processes (a raw ZeroMQ producer, a tf.data service, a tf.data
consumer) that ``bench.transport`` starts with ``python -m bench._peers ROLE``.

This module imports only numpy at the top: zloader's worker processes import it to find
``produce_large``, and the peer processes import only what their role needs.

Peer processes talk to the benchmark over stdin/stdout, one JSON object per line prefixed
with ``@@``. Every role exits when its stdin closes (how the benchmark stops it) or its
parent is gone, so a peer never outlives the benchmark, even one killed with SIGKILL.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

IMAGE_SHAPE = (64, 224, 224, 3)
LABEL_SHAPE = (64,)
BATCH_BYTES = int(np.prod(IMAGE_SHAPE)) + 8 * int(np.prod(LABEL_SHAPE))
BATCHES_PER_SPLIT = 50
PROTOCOL_PREFIX = "@@ "

_LARGE: dict[str, np.ndarray] | None = None


def large_batch() -> dict[str, np.ndarray]:
    """The one large batch of this process, allocated on first use and then reused, so
    that the benchmark measures transport, not production. Random bytes, so that no
    transport can profit from compressing them."""
    global _LARGE
    if _LARGE is None:
        rng = np.random.default_rng(0)
        _LARGE = {"image": rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8),
                  "label": np.arange(LABEL_SHAPE[0], dtype=np.int64)}
    return _LARGE


def produce_large(split: Any) -> Iterator[dict[str, np.ndarray]]:
    """The producer of section (a)/(b): the same preallocated batch, BATCHES_PER_SPLIT
    times per split."""
    batch = large_batch()
    for _ in range(BATCHES_PER_SPLIT):
        yield batch


def fresh_batch(i: int) -> np.ndarray:
    """The producer of section (h): a batch made afresh for every element, as a real
    decode makes one (a new array each call, filled with ``i % 251``)."""
    return np.full(IMAGE_SHAPE, i % 251, np.uint8)


def copy_fresh(begin: float, window: float, results: Any) -> None:
    """The reference of section (h), run in a forked process: make a fresh batch and copy
    it once into a preallocated, already written buffer of the same size, again and again.
    Counts the bytes copied from ``begin`` (a ``time.perf_counter()`` instant, the same
    clock in every process of the host) over ``window`` seconds, ending with the first copy
    done after the window closed, and puts ``(bytes, seconds, copies, cpu seconds)`` on
    ``results``."""
    target = np.ones(IMAGE_SHAPE, np.uint8)  # every page written: warm memory
    i = 0
    while time.perf_counter() < begin:  # the warm-up
        np.copyto(target, fresh_batch(i))
        i += 1
    nbytes = copies = 0
    cpu = time.process_time()
    while True:
        np.copyto(target, fresh_batch(i))
        i += 1
        copies += 1
        nbytes += target.nbytes
        now = time.perf_counter()
        if now >= begin + window:
            break
    results.put((nbytes, now - begin, copies, time.process_time() - cpu))


# --- the consumer side -------------------------------------------------------------------

def touch(element: Any) -> int:
    """Read one byte of every array (numpy, torch or tf tensor) in ``element`` so that a lazy
    transport cannot skip the transfer; return the arrays' total size in bytes (0 for
    Python scalars)."""
    if isinstance(element, dict):
        return sum(touch(value) for value in element.values())
    if isinstance(element, (list, tuple)):
        return sum(touch(value) for value in element)
    if isinstance(element, (int, float, bool, str, bytes)) or element is None:
        return 0
    array = np.asarray(element)  # zero-copy for numpy, CPU torch tensors and eager tf tensors
    if array.size:
        array.flat[array.size - 1]  # the read is the point
    return int(array.nbytes)


def measure(iterator: Iterator[Any], window: float, warmup: float,
            cpu: bool = False) -> dict[str, float]:
    """Consume ``iterator``: the first element, then ``warmup`` seconds, then count elements
    and array bytes over ``window`` seconds (ending with the first element received after
    the window closed). ``cpu``: also the CPU seconds this process and its descendants (a
    loader's workers) spent over the window, and per element."""
    start = time.perf_counter()
    touch(next(iterator))
    first = time.perf_counter()
    while time.perf_counter() - first < warmup:
        touch(next(iterator))
    cpu_start = _tree_cpu() if cpu else 0.0
    t0 = time.perf_counter()
    end = t0 + window
    elements = nbytes = 0
    while True:
        nbytes += touch(next(iterator))
        elements += 1
        now = time.perf_counter()
        if now >= end:
            break
    seconds = now - t0
    result = {"first_element_s": first - start, "elements": elements, "bytes": nbytes,
              "seconds": seconds, "elements_per_s": elements / seconds,
              "gb_per_s": nbytes / seconds / 1e9}
    if cpu:
        result["cpu_s"] = _tree_cpu() - cpu_start
        result["cpu_ms_per_element"] = 1000 * result["cpu_s"] / elements
    return result


def _tree_cpu() -> float:
    """CPU seconds this process and its live descendants have used so far."""
    import psutil

    from bench._common import tree_cpu

    return tree_cpu(psutil.Process())


# --- torch datasets (torch imported on first use) ----------------------------------------

@functools.cache
def torch_datasets() -> tuple[type, type]:
    """``(LargeDataset, IntsDataset)``: torch IterableDatasets for the DataLoader rows.
    Built on first use so that importing this module never imports torch; the DataLoader
    rows use the default (fork) start method, which needs no pickling of these classes."""
    import torch.utils.data

    class LargeDataset(torch.utils.data.IterableDataset):
        """Yields the preallocated large batch forever, in every worker."""

        def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
            batch = large_batch()
            while True:
                yield batch

    class IntsDataset(torch.utils.data.IterableDataset):
        """The ints ``range(stop)``; worker ``i`` of ``n`` yields ``range(i, stop, n)``."""

        def __init__(self, stop: int) -> None:
            self.stop = stop

        def __iter__(self) -> Iterator[int]:
            info = torch.utils.data.get_worker_info()
            worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
            return iter(range(worker, self.stop, workers))

    return LargeDataset, IntsDataset


@functools.cache
def torch_fresh_dataset() -> type:
    """A torch IterableDataset of section (h): worker ``i`` of ``n`` yields
    ``fresh_batch(j)`` for ``j`` in ``range(i, 10**9, n)`` (torch imported on first use)."""
    import torch.utils.data

    class FreshDataset(torch.utils.data.IterableDataset):
        """Fresh batches (``fresh_batch``), a disjoint part of the indices per worker."""

        def __iter__(self) -> Iterator[np.ndarray]:
            info = torch.utils.data.get_worker_info()
            worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
            return map(fresh_batch, range(worker, 10**9, workers))

    return FreshDataset


# --- peer processes ----------------------------------------------------------------------

def send(message: dict[str, Any]) -> None:
    sys.stdout.write(PROTOCOL_PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


def _exit_with_parent() -> None:
    """Exit as soon as the benchmark is gone (even killed with SIGKILL): a watchdog thread,
    since the main thread may be blocked in a send or a receive."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _exit_when_stdin_closes() -> None:
    def watch() -> None:
        sys.stdin.buffer.read()
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()


def zmq_producer(endpoint: str) -> None:
    """PUSH the preallocated batch, zero-copy, to ``endpoint`` until stdin closes."""
    import zmq

    _exit_when_stdin_closes()
    batch = large_batch()
    frames = [batch["image"], batch["label"]]
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.SNDHWM, 2)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    send({"ready": True})
    while True:
        socket.send_multipart(frames, copy=False)


def tf_service() -> None:
    """Start a tf.data DispatchServer and a WorkerServer on free ports, report the
    dispatcher's address, and serve until stdin closes."""
    try:
        import tensorflow as tf

        service = tf.data.experimental.service
        dispatcher = service.DispatchServer(service.DispatcherConfig(
            port=0, job_gc_check_interval_ms=1000, job_gc_timeout_ms=1000))
        servers = [dispatcher]  # referenced until exit: a collected server stops
        servers.append(service.WorkerServer(service.WorkerConfig(
            dispatcher_address=dispatcher.target.split("://", 1)[1], port=0,
            heartbeat_interval_ms=1000)))
    except Exception as exc:
        send({"error": f"{type(exc).__name__}: {exc}"})
        return
    send({"address": dispatcher.target})
    sys.stdin.buffer.read()  # until the benchmark closes our stdin
    os._exit(0)  # skips the servers' teardown, which can block; the OS frees everything


def _tf_dataset(kind: str) -> Any:
    import tensorflow as tf

    if kind == "large":
        return tf.data.Dataset.from_tensors({
            "image": tf.zeros(IMAGE_SHAPE, tf.uint8),
            "label": tf.zeros(LABEL_SHAPE, tf.int64)}).repeat()
    return tf.data.Dataset.range(10**9)


def tf_client() -> None:
    """Run the tf.data measurements the benchmark sends on stdin, one per line:
    ``{"kind": "large"|"small", "service": address|null, "window": s, "warmup": s}``."""
    import tensorflow as tf

    send({"ready": True, "tensorflow": tf.__version__})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            dataset = _tf_dataset(request["kind"])
            if request["service"]:
                dataset = dataset.apply(tf.data.experimental.service.distribute(
                    processing_mode="parallel_epochs", service=request["service"]))
            iterator = iter(dataset)
            result = measure(iterator, request["window"], request["warmup"])
            del iterator, dataset
            send({"result": result})
        except Exception as exc:
            send({"error": f"{type(exc).__name__}: {str(exc).strip()[:500]}"})
    os._exit(0)  # stdin closed: done; skip tensorflow's slow interpreter teardown


def main() -> None:
    # The benchmark process stops its peers; a Ctrl-C in the terminal is its business.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    role, *args = sys.argv[1:]
    roles = {"zmq-producer": zmq_producer, "tf-service": tf_service, "tf-client": tf_client}
    roles[role](*args)


if __name__ == "__main__":
    main()
