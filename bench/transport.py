"""Transport benchmark: zloader's Loader against the loaders and transports it replaces.

Every throughput figure is taken at the consumer: after the first element and a warm-up
(``--warmup``, default 1 s), the consumer counts what it receives over a fixed window
(``--window``, default 5 s). It reads one byte of every array it receives, so a lazy
transport cannot skip the transfer, and does nothing else with the data. Producers yield
one preallocated batch again and again (``bench._peers.produce_large``), so the figures
measure transport, not production.

(a) Large batches, local, 2 workers: ``{"image": uint8 (64, 224, 224, 3), "label": int64
    (64,)}`` (9.6 MB); GB/s of array bytes received. zloader embedded
    (``Loader(Pipeline.from_generator(produce_large, splits=1000), num_workers=2)``) against
    ``torch.utils.data.DataLoader`` (2 workers, an IterableDataset over the same batch,
    ``batch_size=None``). Target: zloader >= 8x DataLoader.
(b) The same batches over TCP on 127.0.0.1: zloader with ``transport="tcp"`` against raw
    zero-copy ZeroMQ (one producer process PUSHing the preallocated arrays with
    ``copy=False``, the consumer PULLing with ``copy=False``: the floor any ZeroMQ transport
    pays) and the tf.data service (a DispatchServer and a WorkerServer in another process,
    ``distribute(processing_mode="parallel_epochs")``). A Python generator cannot be shipped
    to a tf.data worker in another process, so the tf-native
    ``Dataset.from_tensors({"image": tf.zeros(...), "label": tf.zeros(...)}).repeat()``
    stands in for the producer; note that its tensors are all zeros and tf.data's default
    compression (AUTO, i.e. snappy) therefore shrinks them, which can only flatter tf.data.
    Targets: zloader >= 2.5x tf.data service, zloader >= 0.8x raw ZeroMQ.
(c) Small elements (Python ints), elements/s: zloader embedded
    (``Loader(Pipeline.range(10**9), num_workers=2)``), DataLoader (2 workers, each yielding
    a disjoint part of the range), tf.data service (``Dataset.range(10**9)`` distributed as
    in (b)) and, as a reference, tf.data iterated in-process. Targets: zloader >= 250,000/s,
    >= 12x DataLoader, >= 50x tf.data service.
(d) Seconds from constructing ``Loader(Pipeline.range(1000), num_workers=2)`` to its first
    element, median of 3 fresh loaders (target <= 1 s); DataLoader (2 workers) as reference.
(e) What authentication costs on the data path: the batches of (a) through a
    ``zloader-broker`` process on 127.0.0.1, the Loader's 2 workers bound on TCP
    (``transport="tcp"``), with CURVE keys (``zloader keygen``: every frame encrypted) and
    without; and with keys but 2 workers started with ``--plain-data`` (a token, no
    encryption on the data sockets: the trusted-network option). Ratios: CURVE / the row.
(f) What exactly-once bookkeeping costs (every element carries its origin, see
    docs/reliability.md): the small elements of (c), embedded, 2 workers, with the default
    ``exactly_once=True`` and with ``exactly_once=False``. Ratio: on / off.
(g) The same for batches: ``Pipeline.range(10**9).shuffle(1024).batch(256)`` (a batch
    carries 256 origins), batches/s. Ratio: on / off.
(h) Large batches made afresh for every element, as a real decode makes them: zloader
    embedded (``Loader(Pipeline.range(10**9).map(fresh_batch), num_workers=2)``, where
    ``fresh_batch(i)`` is ``np.full((64, 224, 224, 3), i % 251, np.uint8)``) against what
    the host's memory allows (two forked processes, each making ``fresh_batch(i)`` and
    copying it once with ``np.copyto`` into a preallocated buffer it has already written;
    the sum of their GB/s over one window) and against ``DataLoader`` (2 workers, an
    IterableDataset of the same function). Targets: zloader >= 0.75x memory speed,
    >= 5x DataLoader. Unlike (a)-(g) this measures production and transport together.
    Each row also records the CPU seconds of all its processes over the window (the
    consumer and its workers; the two copying processes), per element: on a machine
    shared with other work the throughput of rows run one after another varies with the
    others' load, the CPU an element costs much less.

Ratios read "how many times better zloader is" (throughput: zloader / system; time:
system / zloader). These machines are shared and noisy: read the ratios, not the absolute
numbers. The systems run one after another in one run, each section's rows back to back.
A zloader row that cannot run (``zloader.Loader`` missing or failing) reads "unavailable:
<reason>"; the other rows still run.

The peers run in processes that ``python -m bench._peers`` starts (the ZeroMQ producer,
the tf.data servers, and the tf.data consumer, so that tensorflow never loads into this
process and DataLoader forks a process without it); all are stopped and joined before the
script exits, also on errors, Ctrl-C and SIGTERM. The results record the child processes
and the /dev/shm entries named after this process (zloader's ``zloader-UID-PID-...``) left
at exit; both should be empty. Other users' runs on a shared machine add /dev/shm entries
too, so all new entries are recorded separately, unattributed.

Run: ``python -m bench.transport [--window S] [--only a,b,c,d,...,h] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import pathlib
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench import _peers
from bench._common import join_or_kill, version

REPO = pathlib.Path(__file__).resolve().parent.parent
DEV_SHM = pathlib.Path("/dev/shm")
PEER_START_TIMEOUT_S = 120.0


# --- peer processes ----------------------------------------------------------------------

class Peer:
    """A ``python -m bench._peers ROLE`` process: JSON lines on stdout, commands on stdin,
    stderr kept in a temporary file for error messages. It exits when its stdin closes."""

    def __init__(self, role: str, *args: str) -> None:
        self.role = role
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")])))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench._peers", role, *args], cwd=REPO, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            text=True, start_new_session=True)  # a terminal Ctrl-C reaches only us
        self._messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith(_peers.PROTOCOL_PREFIX):
                self._messages.put(json.loads(line[len(_peers.PROTOCOL_PREFIX):]))
        self._messages.put(None)  # end of output

    def stderr_tail(self, chars: int = 400) -> str:
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace")
        lines = [line for line in text.splitlines()
                 if line.strip() and not line.startswith(("WARNING: All log", "I0000"))]
        return " | ".join(lines)[-chars:]

    def receive(self, timeout: float) -> dict[str, Any]:
        try:
            message = self._messages.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.role}: no answer in {timeout:.0f} s") from None
        if message is None:
            self._messages.put(None)
            code = self._process.wait()
            raise RuntimeError(f"{self.role} exited with status {code}: {self.stderr_tail()}")
        return message

    def request(self, message: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(message) + "\n")
        self._process.stdin.flush()
        return self.receive(timeout)

    def close(self) -> None:
        """Close stdin (the peer exits), then terminate and kill if it lingers; join."""
        with contextlib.suppress(OSError):
            if self._process.stdin is not None:
                self._process.stdin.close()
        for stop in (None, self._process.terminate, self._process.kill):
            if stop is not None:
                with contextlib.suppress(OSError):
                    stop()
            try:
                self._process.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        self._reader.join(timeout=5)
        self._stderr.close()


class TfPeers:
    """The tf.data service (dispatcher + worker, one process) and the tf.data consumer
    (another process), started together on first use and kept for all tf rows."""

    def __init__(self) -> None:
        self.client: Peer | None = None
        self.service: Peer | None = None
        self.address: str | None = None
        self.service_error: str | None = None
        self.client_error: str | None = None
        self.tensorflow: str | None = None

    def _start(self) -> None:
        if self.client is not None:
            return
        self.client = Peer("tf-client")
        self.service = Peer("tf-service")
        try:
            self.tensorflow = self.client.receive(PEER_START_TIMEOUT_S)["tensorflow"]
        except Exception as exc:
            self.client_error = f"tf.data consumer could not start: {exc}"
        try:
            answer = self.service.receive(PEER_START_TIMEOUT_S)
            if "error" in answer:
                raise RuntimeError(answer["error"])
            self.address = answer["address"]
        except Exception as exc:
            self.service_error = f"tf.data service could not start: {exc}"

    def run(self, kind: str, service: bool, window: float, warmup: float) -> dict[str, Any]:
        self._start()
        assert self.client is not None
        if self.client_error:
            raise RuntimeError(self.client_error)
        if service and self.service_error:
            raise RuntimeError(self.service_error)
        answer = self.client.request(
            {"kind": kind, "service": self.address if service else None, "window": window,
             "warmup": warmup}, timeout=window + warmup + PEER_START_TIMEOUT_S)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        result: dict[str, Any] = answer["result"]
        return result

    def close(self) -> None:
        for peer in (self.client, self.service):
            if peer is not None:
                peer.close()


# --- the measurements --------------------------------------------------------------------

def _close_dataloader_iterator(iterator: Any) -> None:
    """Stop and join a DataLoader iterator's workers now rather than at garbage collection."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def dataloader_throughput(dataset: Any, window: float, warmup: float,
                          cpu: bool = False) -> dict[str, Any]:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, timeout=120)
    iterator = iter(loader)
    try:
        return _peers.measure(iterator, window, warmup, cpu)
    finally:
        _close_dataloader_iterator(iterator)


def dataloader_large(window: float, warmup: float) -> dict[str, Any]:
    large, _ = _peers.torch_datasets()
    return dataloader_throughput(large(), window, warmup)


def dataloader_small(window: float, warmup: float) -> dict[str, Any]:
    _, ints = _peers.torch_datasets()
    return dataloader_throughput(ints(10**9), window, warmup)


def zloader_throughput(pipeline_fn: Callable[[Any], Any], window: float, warmup: float,
                       cpu: bool = False, **loader_kwargs: Any) -> dict[str, Any]:
    import zloader

    pipeline = pipeline_fn(zloader)
    with zloader.Loader(pipeline, num_workers=2, **loader_kwargs) as loader:
        return _peers.measure(iter(loader), window, warmup, cpu)


def _large_pipeline(zloader: Any) -> Any:
    return zloader.Pipeline.from_generator(_peers.produce_large, splits=1000)


def zloader_large(window: float, warmup: float) -> dict[str, Any]:
    return zloader_throughput(_large_pipeline, window, warmup)


def zloader_large_tcp(window: float, warmup: float) -> dict[str, Any]:
    return zloader_throughput(_large_pipeline, window, warmup, transport="tcp")


def zloader_small(window: float, warmup: float) -> dict[str, Any]:
    return zloader_throughput(lambda zloader: zloader.Pipeline.range(10**9), window, warmup)


def zloader_small_untracked(window: float, warmup: float) -> dict[str, Any]:
    return zloader_throughput(lambda zloader: zloader.Pipeline.range(10**9), window, warmup,
                              exactly_once=False)


def _batched(zloader: Any) -> Any:
    return zloader.Pipeline.range(10**9).shuffle(1024).batch(256)


def zloader_batched(window: float, warmup: float) -> dict[str, Any]:
    return zloader_throughput(_batched, window, warmup)


def zloader_batched_untracked(window: float, warmup: float) -> dict[str, Any]:
    return zloader_throughput(_batched, window, warmup, exactly_once=False)


def _fresh_pipeline(zloader: Any) -> Any:
    return zloader.Pipeline.range(10**9).map(_peers.fresh_batch)


def zloader_fresh(window: float, warmup: float) -> dict[str, Any]:
    return zloader_throughput(_fresh_pipeline, window, warmup, cpu=True)


def dataloader_fresh(window: float, warmup: float) -> dict[str, Any]:
    return dataloader_throughput(_peers.torch_fresh_dataset()(), window, warmup, cpu=True)


def memory_fresh(window: float, warmup: float, processes: int = 2) -> dict[str, Any]:
    """What the host's memory allows: ``processes`` forked processes each make a fresh
    batch and copy it once into warm memory (``bench._peers.copy_fresh``), over one window
    that starts for all of them at the same instant; the sum of their GB/s."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    results = context.Queue()
    begin = time.perf_counter() + warmup + 0.5  # 0.5 s: time for the forks to start
    children = [context.Process(target=_peers.copy_fresh, args=(begin, window, results),
                                daemon=True) for _ in range(processes)]
    for child in children:
        child.start()
    try:
        answers = [results.get(timeout=window + warmup + PEER_START_TIMEOUT_S)
                   for _ in children]
    finally:
        join_or_kill(children, 5)
        results.close()
        results.join_thread()
    rates = [nbytes / seconds / 1e9 for nbytes, seconds, _, _ in answers]
    copies = sum(answer[2] for answer in answers)
    cpu_s = sum(answer[3] for answer in answers)
    return {"gb_per_s": sum(rates), "per_process_gb_per_s": rates,
            "bytes": sum(answer[0] for answer in answers),
            "seconds": max(answer[1] for answer in answers), "elements": copies,
            "cpu_s": cpu_s, "cpu_ms_per_element": 1000 * cpu_s / copies}


def zloader_broker_tcp(window: float, warmup: float, keyed: bool,
                       plain_data: bool = False) -> dict[str, Any]:
    """The large batches from 2 workers on this host over TCP, through a broker process:
    the Loader's own workers, or (``plain_data``) a ``zloader-worker --plain-data``."""
    import socket

    import zloader
    from zloader.transport.keys import keygen

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        keys = keygen(pathlib.Path(tmp) / "keys") if keyed else None
        key_args = ["--keys", keys.path] if keys else []
        bin_dir = pathlib.Path(sys.executable).parent
        processes = [subprocess.Popen([str(bin_dir / "zloader-broker"), "--bind", address,
                                       "--log-level", "error", *key_args])]
        if plain_data:
            processes.append(subprocess.Popen(
                [str(bin_dir / "zloader-worker"), "--broker", address, "--processes", "2",
                 "--plain-data", *key_args]))
        try:
            with zloader.Loader(_large_pipeline(zloader), broker=address,
                                num_workers=0 if plain_data else 2, transport="tcp",
                                keys=keys, timeout=60) as loader:
                return _peers.measure(iter(loader), window, warmup)
        finally:
            for process in reversed(processes):
                process.send_signal(signal.SIGTERM)
                process.wait(15)


def zmq_large(window: float, warmup: float) -> dict[str, Any]:
    """Raw zero-copy ZeroMQ: a producer process PUSHes the preallocated arrays to us."""
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    peer: Peer | None = None
    try:
        socket.setsockopt(zmq.RCVHWM, 2)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, 60_000)
        port = socket.bind_to_random_port("tcp://127.0.0.1")
        peer = Peer("zmq-producer", f"tcp://127.0.0.1:{port}")
        peer.receive(PEER_START_TIMEOUT_S)

        def batches() -> Iterator[dict[str, np.ndarray]]:
            while True:
                image, label = socket.recv_multipart(copy=False)
                yield {"image": np.frombuffer(image.buffer, np.uint8).reshape(_peers.IMAGE_SHAPE),
                       "label": np.frombuffer(label.buffer, np.int64)}

        return _peers.measure(batches(), window, warmup)
    finally:
        if peer is not None:
            peer.close()
        socket.close()
        context.term()


def first_element_times(make_iterator: Callable[[], Any], close: Callable[[Any], None],
                        runs: int = 3) -> dict[str, Any]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        handle, iterator = make_iterator()
        try:
            _peers.touch(next(iterator))
            times.append(time.perf_counter() - start)
        finally:
            close(handle)
    return {"runs_s": times, "median_s": statistics.median(times)}


def zloader_first_element(window: float, warmup: float) -> dict[str, Any]:
    import zloader

    def make() -> tuple[Any, Any]:
        loader = zloader.Loader(zloader.Pipeline.range(1000), num_workers=2)
        try:
            return loader, iter(loader)
        except BaseException:
            loader.close()
            raise

    return first_element_times(make, lambda loader: loader.close())


def dataloader_first_element(window: float, warmup: float) -> dict[str, Any]:
    import torch.utils.data

    _, ints = _peers.torch_datasets()

    def make() -> tuple[Any, Any]:
        iterator = iter(torch.utils.data.DataLoader(ints(1000), batch_size=None,
                                                    num_workers=2, timeout=120))
        return iterator, iterator

    return first_element_times(make, _close_dataloader_iterator)


# --- the table ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One system of a section. ``target`` is ``(kind, bound)``: ``ratio`` (zloader at least
    ``bound`` times better than this system), ``min`` / ``max`` (zloader's own value), or
    None for a reference row."""

    section: str
    system: str
    measure: Callable[..., dict[str, Any]] | str  # a str names a tf row: "kind/service|local"
    target: tuple[str, float] | None = None
    note: str = ""

    @property
    def is_zloader(self) -> bool:
        return self.system.startswith("zloader")


TF_NOTE = ("another process; tf-native stand-in: from_tensors(tf.zeros(...)).repeat(), "
           "default compression (snappy) on all-zero tensors")
SECTIONS: dict[str, tuple[str, str, list[Row]]] = {
    "a": ("Large batches (64x224x224x3 uint8 + 64 int64), local, 2 workers", "gb_per_s", [
        Row("a", "zloader (embedded)", zloader_large),
        Row("a", "torch DataLoader", dataloader_large, ("ratio", 8.0),
            "IterableDataset, batch_size=None, fork"),
    ]),
    "b": ("The same batches over TCP (127.0.0.1)", "gb_per_s", [
        Row("b", "zloader (transport=\"tcp\")", zloader_large_tcp),
        Row("b", "raw ZeroMQ (zero-copy PUSH/PULL)", zmq_large, ("ratio", 0.8),
            "one producer process, copy=False both ends, HWM 2"),
        Row("b", "tf.data service", "large/service", ("ratio", 2.5), TF_NOTE),
    ]),
    "c": ("Small elements (Python ints), 2 workers", "elements_per_s", [
        Row("c", "zloader (embedded)", zloader_small, ("min", 250_000)),
        Row("c", "torch DataLoader", dataloader_small, ("ratio", 12.0),
            "IterableDataset, disjoint per worker, batch_size=None"),
        Row("c", "tf.data service", "small/service", ("ratio", 50.0),
            "Dataset.range(10**9), another process"),
        Row("c", "tf.data in-process", "small/local", None,
            "reference: Dataset.range(10**9) iterated eagerly, no workers"),
    ]),
    "d": ("Time to first element, Pipeline.range(1000) / 1000 ints, 2 workers", "median_s", [
        Row("d", "zloader", zloader_first_element, ("max", 1.0),
            "construction to first element, median of 3 fresh loaders"),
        Row("d", "torch DataLoader", dataloader_first_element, None,
            "reference: construction to first element, fork, median of 3"),
    ]),
    "e": ("Large batches over TCP through a broker: CURVE keys against none", "gb_per_s", [
        Row("e", "zloader, CURVE keys", functools.partial(zloader_broker_tcp, keyed=True)),
        Row("e", "zloader, no keys", functools.partial(zloader_broker_tcp, keyed=False), None,
            "the same, unauthenticated; ratio: keyed / unkeyed"),
        Row("e", "zloader, keys, workers --plain-data",
            functools.partial(zloader_broker_tcp, keyed=True, plain_data=True), None,
            "CURVE on the broker socket, a token on the data sockets (unencrypted); ratio: "
            "CURVE / this"),
    ]),
    "f": ("Small elements: exactly-once bookkeeping on against off", "elements_per_s", [
        Row("f", "zloader, exactly_once=True (default)", zloader_small),
        Row("f", "zloader, exactly_once=False", zloader_small_untracked, None,
            "no origins; ratio: on / off"),
    ]),
    "g": ("Shuffled batches of 256 ints: exactly-once on against off", "elements_per_s", [
        Row("g", "zloader, exactly_once=True (default)", zloader_batched),
        Row("g", "zloader, exactly_once=False", zloader_batched_untracked, None,
            "no origins; ratio: on / off (batches/s)"),
    ]),
    "h": ("Fresh large batches: np.full((64,224,224,3), i % 251, uint8) made for every "
          "element, 2 workers", "gb_per_s", [
        Row("h", "zloader (embedded), fresh batches", zloader_fresh, None,
            "Pipeline.range(10**9).map(fresh_batch); the consumer reads one byte of "
            "each array (_peers.touch), as in the DataLoader row"),
        Row("h", "memory speed: 2 processes, fresh batch + one copy", memory_fresh,
            ("ratio", 0.75),
            "fork; each makes fresh_batch(i) and np.copyto's it into a written buffer; "
            "sum of both over one window; no consumer (the copy reads every byte)"),
        Row("h", "torch DataLoader, fresh batches", dataloader_fresh, ("ratio", 5.0),
            "IterableDataset of fresh_batch, disjoint per worker, batch_size=None, fork; "
            "the consumer reads one byte of each array"),
    ]),
}


def format_value(metric: str, value: float) -> str:
    if metric == "gb_per_s":
        return f"{value:.2f} GB/s"
    if metric == "elements_per_s":
        return f"{value:,.0f}/s"
    return f"{value:.3f} s"


def evaluate(section: str, results: dict[str, dict[str, Any]]) -> list[dict[str, str]]:
    """The table cells of one section: value, ratio, target, holds."""
    _, metric, rows = SECTIONS[section]
    zloader_result = results[rows[0].system]
    zloader_value = zloader_result.get(metric) if zloader_result["error"] is None else None
    higher_is_better = metric != "median_s"
    cells = []
    for row in rows:
        result = results[row.system]
        value = result.get(metric) if result["error"] is None else None
        advantage = None
        if value is not None and zloader_value is not None:
            advantage = zloader_value / value if higher_is_better else value / zloader_value
        target, holds = "-", "-"
        if row.target is not None:
            kind, bound = row.target
            if kind == "ratio":
                target = f"zloader >= {bound:g}x"
                met = None if advantage is None else advantage >= bound
            else:
                target = f"{'>=' if kind == 'min' else '<='} {format_value(metric, bound)}"
                met = None if value is None else (value >= bound if kind == "min"
                                                  else value <= bound)
            holds = "n/a" if met is None else "yes" if met else "no"
        elif not row.is_zloader:
            target = "reference"
        cpu_ms = result.get("cpu_ms_per_element") if result["error"] is None else None
        zloader_cpu = (zloader_result.get("cpu_ms_per_element")
                       if zloader_result["error"] is None else None)
        cpu_text = ""
        if cpu_ms is not None:
            cpu_text = f"{cpu_ms:.2f} ms"
            if zloader_cpu and row is not rows[0]:
                cpu_text += f" (zloader / system at equal CPU: {cpu_ms / zloader_cpu:.2f}x)"
        cells.append({
            "system": row.system,
            "value": format_value(metric, value) if value is not None else result["error"],
            "ratio": f"{advantage:.2f}x" if advantage is not None else "n/a",
            "target": target, "holds": holds, "note": row.note, "cpu_ms": cpu_text})
    return cells


def markdown(section: str, cells: list[dict[str, str]]) -> str:
    title, metric, _ = SECTIONS[section]
    header = "throughput" if metric != "median_s" else "seconds"
    ratio = "zloader / system" if metric != "median_s" else "system / zloader"
    lines = [f"### ({section}) {title}", "",
             f"| system | {header} | {ratio} | target | holds | notes |",
             "|---|---|---|---|---|---|"]
    for cell in cells:
        value = cell["value"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {cell['system']} | {value} | {cell['ratio']} | {cell['target']} | "
                     f"{cell['holds']} | {cell['note']} |")
    cpu = [(cell["system"], cell["cpu_ms"]) for cell in cells if cell.get("cpu_ms")]
    if cpu:
        lines += ["", "CPU per element over the window, every process of the row (robust to "
                  "a shared machine's load, unlike throughput): " + "; ".join(
                      f"{system} {value}" for system, value in cpu) + "."]
    return "\n".join(lines)


# --- running -----------------------------------------------------------------------------

def child_processes() -> list[str]:
    """Live (non-zombie) child processes of this process, as "pid command"."""
    children = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            if int(ppid) == os.getpid() and state != "Z":
                command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                children.append(f"{stat.parent.name} {command.decode(errors='replace')[:80]}")
    return children


def run_row(row: Row, tf_peers: TfPeers, window: float, warmup: float) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        if isinstance(row.measure, str):
            kind, where = row.measure.split("/")
            result = tf_peers.run(kind, where == "service", window, warmup)
        else:
            result = row.measure(window, warmup)
        result["error"] = None
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        result = {"error": ("unavailable: " if row.is_zloader else "failed: ") + reason[:300]}
    result["wall_s"] = time.perf_counter() - start
    return result


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=5.0, help="seconds measured per row")
    parser.add_argument("--warmup", type=float, default=1.0,
                        help="seconds consumed before each window")
    parser.add_argument("--only", default="a,b,c,d,e,f,g,h",
                        help="sections to run, e.g. a,c")
    parser.add_argument("--out", default="bench/results", help="where to write results")
    args = parser.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown or not only:
        parser.error(f"--only takes letters among {','.join(SECTIONS)}, got {args.only!r}")
    signal.signal(signal.SIGTERM, _raise_system_exit)  # run the clean-up, as for Ctrl-C

    shm_before = set(os.listdir(DEV_SHM)) if DEV_SHM.is_dir() else set()
    started = time.perf_counter()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    tf_peers = TfPeers()
    try:
        for section in (s for s in SECTIONS if s in only):
            results[section] = {}
            for row in SECTIONS[section][2]:
                result = run_row(row, tf_peers, args.window, args.warmup)
                results[section][row.system] = result
                metric = SECTIONS[section][1]
                shown = (result["error"] if result["error"] is not None
                         else format_value(metric, result[metric]))
                print(f"[{section}] {row.system}: {shown}  ({result['wall_s']:.1f} s)",
                      file=sys.stderr, flush=True)
    finally:
        tf_peers.close()
    new_shm = sorted(set(os.listdir(DEV_SHM)) - shm_before) if DEV_SHM.is_dir() else []
    # zloader names its segments zloader-UID-PID-...; other users' runs add entries too
    leftover_shm = [name for name in new_shm if f"-{os.getpid()}-" in name]
    leftover_children = child_processes()

    tables = {section: evaluate(section, results[section]) for section in results}
    text = "\n\n".join(markdown(section, cells) for section, cells in tables.items())
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "transport",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "window_s": args.window, "warmup_s": args.warmup, "sections": list(results),
        "nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "torch": version("torch"),
                     "tensorflow": tf_peers.tensorflow or version("tensorflow"),
                     "pyzmq": version("pyzmq"), "zloader": version("zloader")},
        "total_s": time.perf_counter() - started,
        "results": results, "tables": tables,
        "pid": os.getpid(), "leftover_dev_shm": leftover_shm,
        "new_dev_shm_entries_any_process": new_shm,
        "leftover_child_processes": leftover_children,
    }
    (out / "transport.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "transport.md").write_text(
        f"Transport benchmark, window {args.window:g} s after a {args.warmup:g} s warm-up, "
        f"nproc {report['nproc']}. Ratios > 1 mean zloader is better; the machine is shared "
        "and noisy, so read the ratios, not the absolute numbers. The tf.data rows use a "
        "tf-native producer (a Python generator cannot run on a tf.data worker in another "
        "process).\n\n" + text + "\n")
    print(text)
    for what, leftovers in (("/dev/shm entries named after this process", leftover_shm),
                            ("child processes", leftover_children)):
        if leftovers:
            print(f"warning: {len(leftovers)} {what} left at exit: {leftovers}",
                  file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the peers are stopped by now
        print("interrupted", file=sys.stderr)
        sys.exit(130)
