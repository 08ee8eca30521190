"""GPU end-to-end benchmark: bf16 training steps on one GPU fed by the image pipeline.

    python -m bench.gpu_train [--scenarios LIST] [--window 20] [--warmup 6] [--workers W]
    python -m bench.gpu_train --smoke    # CPU, tiny model, 64x64 crops, 64 JPEGs, 3 s windows

The pipeline is that of bench/torch_loader.py: synthetic JPEG files (``--images``, default
2000, 500x375, quality 90, written by a process pool into a temporary directory and reused
across epochs), batches of 256 per trainer, decoded with PIL,
random resized crop (torchvision's algorithm, bench/_images.py) to 224x224 and a random
horizontal flip. Samples travel as HWC uint8 (a batch of 256 is 38.5 MB); the trainer
pins each batch, copies it to the GPU on a side stream (non_blocking) and there converts
it to a normalized channels_last float tensor (the same for every loader, none of which
pins memory itself). Every trainer runs the same loop: bf16
autocast, SGD (momentum 0.9), channels_last on CUDA, one synchronization per step (on a
blocking CUDA event, so that a waiting trainer leaves its core to the workers).

Scenarios (each in fresh trainer processes; ``--scenarios`` picks some):

- ``gpu-alone``: one ResNet-50 trainer on a synthetic batch already on the device: the
  GPU's own step rate, the ceiling of the one-trainer scenarios;
- ``dataloader``: one ResNet-50 trainer fed by ``torch.utils.data.DataLoader`` with W
  worker processes (default: cores - 1);
- ``zloader``: the same, fed by ``zloader.torch.DataLoader`` (the drop-in adapter: same
  dataset, same arguments) with the same W workers;
- ``search-dataloader``: a hyper-parameter search, K ResNet-18 trainers (default 4) on the
  one GPU, each with its own DataLoader of S/K workers (S: ``--search-workers``, default
  (cores - 1) rounded down to a multiple of K: 12 of 16 cores);
- ``search-zloader``: the K trainers share one zloader pipeline run (``Loader(share=True)``
  on a broker in this process and a pool of S zloader workers): the pipeline runs once and
  every trainer receives every batch;
- ``search-gpu-alone``: the K trainers on synthetic batches on the device: the ceiling of
  the search scenarios (run last: the first to go if time runs short).

Each trainer warms up (``--warmup`` seconds after its first step, at least 10 steps), then
all the trainers of a scenario measure over the same ``--window`` seconds of wall clock:
images/s, and the data-wait fraction: the time the loop spent blocked waiting for the next
batch (the batch is on the device when it is handed over, so this includes the copy) over
the window. The loop synchronizes with the GPU every step, so while it waits the GPU has
no work queued: the fraction is the share of step time the GPU waited for data.

Targets (from the issue, measured on one H200 with 16 cores): zloader / DataLoader, one
trainer, >= 1.0x; search: shared zloader / K DataLoaders, total images/s, >= 2.5x (the GPU
caps it near 2.7x there: search-gpu-alone / search-dataloader shows the cap here).

Time: the whole run must stay within ``--budget`` seconds (default 330: the issue allows
6 minutes on the GPU host, JPEG generation included). Before each scenario the script
checks what is left; it shortens the window (down to a quarter) or skips the scenario,
and says so in the results, rather than run over. Every trainer has a deadline to get
ready and one to report; past them it is killed and the scenario marked failed.

Clean-up: trainer processes stop when their window ends or when their standard input
closes (this script gone); the zloader worker pool watches this process; everything
started is terminated (then killed) on exit, Ctrl-C, SIGTERM or an error; the JPEG
directory is removed. The results record leftover child processes and /dev/shm segments.

Results: ``--out`` (default bench/results) / gpu_train.json and .md on a GPU,
gpu_train_smoke.* with ``--smoke``, gpu_train_cpu.* for a full run on CPU: a smoke run
never overwrites GPU figures. Without a GPU (and without ``--device``), the script runs
the smoke test. Imports: numpy, pillow, torch, zloader and its dependencies; torchvision's
ResNets when it is installed, else an equivalent built here (same layers, same parameter
count). Run it from the repository root (or with the root on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import json
import math
import multiprocessing
import os
import pathlib
import platform
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from bench._common import provenance, version
from bench._images import CROP, decode_augment, synthetic_photo
from zloader._command import worker_command

if TYPE_CHECKING:
    import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
DEV_SHM = pathlib.Path("/dev/shm")
SCENARIOS = ("gpu-alone", "dataloader", "zloader", "search-dataloader", "search-zloader",
             "search-gpu-alone")
MIN_WARMUP_STEPS = 10
NUM_CLASSES = 1000
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


@dataclass(frozen=True)
class Scenario:
    name: str
    search: bool  # K trainers with the search model; else one with the big model
    source: str  # "synthetic", "torch", "zloader" or "zloader-shared"
    label: str


SPECS = {spec.name: spec for spec in (
    Scenario("gpu-alone", False, "synthetic", "GPU alone (synthetic batch on the device)"),
    Scenario("dataloader", False, "torch", "torch DataLoader"),
    Scenario("zloader", False, "zloader", "zloader.torch.DataLoader"),
    Scenario("search-dataloader", True, "torch", "search: a torch DataLoader each"),
    Scenario("search-zloader", True, "zloader-shared", "search: one shared zloader run"),
    Scenario("search-gpu-alone", True, "synthetic", "search: GPU alone (synthetic batches)"),
)}


# --- the data (also imported by zloader's workers: no torch at module level) --------------

def _write_range(directory: str, start: int, stop: int) -> list[str]:
    paths = []
    for index in range(start, stop):
        path = os.path.join(directory, f"{index:05d}.jpg")
        image = synthetic_photo(np.random.default_rng([0, index]))
        Image.fromarray(image).save(path, "JPEG", quality=90)
        paths.append(path)
    return paths


def write_jpegs(directory: pathlib.Path, count: int, processes: int) -> list[str]:
    """``count`` synthetic photographs (bench/_images.py's), written by a process pool."""
    processes = max(1, min(processes, count))
    chunk = math.ceil(count / (processes * 4))
    ranges = [(str(directory), start, min(count, start + chunk))
              for start in range(0, count, chunk)]
    if processes == 1:
        return [path for args in ranges for path in _write_range(*args)]
    pool = multiprocessing.get_context("fork").Pool(processes)
    try:
        done = pool.starmap(_write_range, ranges)
        pool.close()
    finally:
        pool.terminate()
        pool.join()
    return [path for paths in done for path in paths]


def load_sample(index: int, paths: tuple[str, ...], size: int) -> tuple[np.ndarray, int]:
    """Sample ``index``: the image of file ``index mod len(paths)`` and its label."""
    file = index % len(paths)
    return decode_augment(paths[file], size), file % NUM_CLASSES


class ImageDataset:
    """Map-style dataset of ``length`` samples over the JPEG files (``load_sample``)."""

    def __init__(self, paths: list[str], length: int, size: int) -> None:
        self.paths = tuple(paths)
        self.length = length
        self.size = size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return load_sample(index, self.paths, self.size)


def shared_pipeline(paths: list[str], length: int, batch_size: int, size: int) -> Any:
    """The same samples as a zloader Pipeline, batched on the workers (one batch a split).
    Equal definitions give equal fingerprints: the K trainers attach to one job."""
    from zloader import Pipeline

    return (Pipeline.range(length, split_size=batch_size)
            .map(functools.partial(load_sample, paths=tuple(paths), size=size))
            .batch(batch_size, drop_remainder=True))


# --- models --------------------------------------------------------------------------------

def build_resnet(depth: int, num_classes: int = NUM_CLASSES) -> torch.nn.Module:
    """torchvision's ResNet-18/34/50/101/152 (v1.5: stride on the 3x3 convolution), the
    same layers and parameter count, for hosts without torchvision."""
    from torch import nn

    bottleneck = depth >= 50
    blocks = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3),
              152: (3, 8, 36, 3)}[depth]
    expansion = 4 if bottleneck else 1

    class Block(nn.Module):
        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = width * expansion
            convs = ([(cin, width, 1, 1), (width, width, 3, stride), (width, cout, 1, 1)]
                     if bottleneck else [(cin, width, 3, stride), (width, cout, 3, 1)])
            layers: list[nn.Module] = []
            for a, b, k, s in convs:
                layers += [nn.Conv2d(a, b, k, s, k // 2, bias=False), nn.BatchNorm2d(b),
                           nn.ReLU(inplace=True)]
            self.body = nn.Sequential(*layers[:-1])
            self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                           nn.BatchNorm2d(cout))
                             if stride != 1 or cin != cout else nn.Identity())
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.relu(self.body(x) + self.shortcut(x))

    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for stage, count in enumerate(blocks):
        width = 64 << stage
        for index in range(count):
            layers.append(Block(cin, width, 2 if stage and not index else 1))
            cin = width * expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    model = nn.Sequential(*layers)
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    return model


def tiny_cnn(num_classes: int = NUM_CLASSES) -> torch.nn.Module:
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes))


def make_model(name: str) -> tuple[torch.nn.Module, str]:
    """The model and where it came from ("torchvision", "builtin")."""
    if name == "tiny":
        return tiny_cnn(), "builtin"
    depth = int(name.removeprefix("resnet"))
    try:
        import torchvision
    except ImportError:
        return build_resnet(depth), "builtin"
    return getattr(torchvision.models, name)(weights=None), "torchvision"


# --- the trainer process --------------------------------------------------------------------

class Abort(Exception):
    """The benchmark process went away (this trainer's standard input closed)."""


def _to_host_tensor(value: Any, pin: bool) -> torch.Tensor:
    """A batch leaf as a CPU tensor; with ``pin``, a copy in pinned memory."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.pin_memory() if pin else value
    array = np.asarray(value)
    if pin:
        dtype = torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
        pinned = torch.empty(array.shape, dtype=dtype, pin_memory=True)
        np.copyto(pinned.numpy(), array)
        return pinned
    return torch.from_numpy(array if array.flags.writeable else array.copy())


class Feeder:
    """Iterates a loader on a thread: each batch is pinned and copied to the device on a
    side stream (CUDA), and handed over only once it is there; at most ``depth`` wait.
    The thread also creates and closes the loader (``open_batches``), so that a loader is
    used by one thread only."""

    _END = object()

    def __init__(self, open_batches: Callable[[], contextlib.AbstractContextManager[Any]],
                 device: torch.device, abort: threading.Event, depth: int = 3) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._abort = abort
        self._device = device
        self.stats: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(open_batches,),
                                        name="feeder", daemon=True)
        self._thread.start()

    def _run(self, open_batches: Callable[[], contextlib.AbstractContextManager[Any]]
             ) -> None:
        import torch

        cuda = self._device.type == "cuda"
        stream = torch.cuda.Stream(self._device) if cuda else None
        try:
            with open_batches() as (batches, stats):
                for images, labels in batches:
                    images = _to_host_tensor(images, cuda)
                    labels = _to_host_tensor(labels, cuda).long()
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            images = images.to(self._device, non_blocking=True)
                            labels = labels.to(self._device, non_blocking=True)
                        stream.synchronize()
                        for tensor in (images, labels):  # used on the default stream
                            tensor.record_stream(torch.cuda.default_stream(self._device))
                    if not self._put((images, labels)):
                        break
                    del images, labels
                self.stats = stats()
            self._put(self._END)
        except BaseException as exc:  # re-raised by the training loop
            self._put(exc)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=0.1)
                return True
        return False

    def __next__(self) -> Any:
        while True:
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if self._abort.is_set():
                    raise Abort from None
        if item is self._END:
            raise RuntimeError("the loader ended")
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self, timeout: float = 10.0) -> None:
        """Stop and close the loader (on the feeder's thread)."""
        self._stop.set()
        while True:  # unblock a put waiting for room
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout)


def _epochs(loader: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


@contextlib.contextmanager
def open_torch(config: dict[str, Any], system: str) -> Iterator[Any]:
    """A torch (or zloader.torch) DataLoader over the JPEG dataset."""
    import torch.utils.data

    if system == "zloader":
        import zloader.torch

        factory: Callable[..., Any] = zloader.torch.DataLoader
    else:
        factory = torch.utils.data.DataLoader
    dataset = ImageDataset(config["paths"], config["epoch_images"], config["crop"])
    loader = factory(dataset, batch_size=config["batch_size"], shuffle=True,
                     num_workers=config["workers"], drop_last=True, persistent_workers=True,
                     prefetch_factor=2, timeout=120,
                     generator=torch.Generator().manual_seed(config["index"]))
    try:
        yield _epochs(loader), dict
    finally:
        if system == "zloader":
            loader.close()
        else:
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None:
                iterator._shutdown_workers()


@contextlib.contextmanager
def open_shared(config: dict[str, Any]) -> Iterator[Any]:
    """A ``Loader(share=True)`` on the benchmark's broker: every trainer gets every batch."""
    from zloader import Loader

    pipeline = shared_pipeline(config["paths"], config["epoch_images"], config["batch_size"],
                               config["crop"])
    loader = Loader(pipeline, broker=config["broker"], share=True, num_workers=0,
                    timeout=120, share_window_bytes=config["share_window_bytes"])

    def stats() -> dict[str, Any]:
        found = loader.stats()
        return {key: found.get(key) for key in ("elements", "wait_seconds", "share_skipped",
                                                "share_replayed") if key in found}
    try:
        yield _epochs(loader), stats
    finally:
        loader.close()


def _watch_stdin(go: list[float], abort: threading.Event) -> None:
    """``GO <monotonic time>`` starts the window; end of input aborts the trainer.

    Reads file descriptor 0 directly: a thread blocked in ``sys.stdin`` holds its lock,
    and a DataLoader worker forked meanwhile would hang closing ``sys.stdin``."""
    pending = b""
    while chunk := os.read(0, 4096):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        go.extend(float(line.split()[1]) for line in lines if line.startswith(b"GO "))
    abort.set()


def _send(message: str) -> None:
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def trainer_main(config_path: str) -> None:
    """One trainer: warm up, say READY, measure from GO for ``window`` seconds, report."""
    born = time.monotonic()
    import torch

    with open(config_path) as file:
        config = json.load(file)
    torch.set_num_threads(1)  # no CPU math here: the cores belong to the workers
    device = torch.device(config["device"])
    cuda = device.type == "cuda"
    torch.manual_seed(config["index"])
    if cuda:
        torch.backends.cudnn.benchmark = True
    model, model_source = make_model(config["model"])
    memory = torch.channels_last if cuda else torch.contiguous_format
    model = model.to(device, memory_format=memory)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    criterion = torch.nn.CrossEntropyLoss()
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    batch_size, crop = config["batch_size"], config["crop"]

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        x = images.permute(0, 3, 1, 2).contiguous(memory_format=memory).float()
        x = x.sub_(mean).div_(std)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = criterion(model(x), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def synchronize() -> None:
        if cuda:
            event = torch.cuda.Event(blocking=True)  # sleeps, leaving the core to workers
            event.record()
            event.synchronize()

    go: list[float] = []
    abort = threading.Event()
    threading.Thread(target=_watch_stdin, args=(go, abort), daemon=True).start()
    feeder: Feeder | None = None
    source = config["source"]
    if source == "synthetic":
        generator = torch.Generator(device=device).manual_seed(config["index"])
        images = torch.randint(0, 256, (batch_size, crop, crop, 3), dtype=torch.uint8,
                               device=device, generator=generator)
        labels = torch.randint(0, NUM_CLASSES, (batch_size,), device=device,
                               generator=generator)
        batches: Any = itertools.repeat((images, labels))
    else:
        opener = (functools.partial(open_shared, config) if source == "zloader-shared"
                  else functools.partial(open_torch, config, source))
        batches = feeder = Feeder(opener, device, abort)
    steps = measured = 0
    wait = window_wait = 0.0
    first_step = ready = window_start = window_end = None
    durations: list[float] = []
    try:
        while True:
            if abort.is_set():
                raise Abort
            began = time.monotonic()
            images, labels = next(batches)
            got = time.monotonic()
            step(images, labels)
            del images, labels
            synchronize()
            now = time.monotonic()
            steps += 1
            if window_start is not None:
                measured += 1
                window_wait += got - began
                durations.append(now - began)
            else:
                wait += got - began
            if first_step is None:
                first_step = now
            if (ready is None and steps >= MIN_WARMUP_STEPS
                    and now - first_step >= config["warmup"]):
                ready = now
                _send("READY")
            if window_start is None and go and now >= go[0]:
                window_start = now
            elif window_start is not None and now - window_start >= config["window"]:
                window_end = now
                break
    except BaseException:  # leaving anyway: the loaders' workers watch this process
        if feeder is not None:
            feeder.close(timeout=2.0)
        raise
    stats: dict[str, Any] = {}
    if feeder is not None:
        feeder.close()
        stats = feeder.stats
    assert first_step is not None and ready is not None and window_start is not None
    seconds = window_end - window_start
    result = {
        "index": config["index"], "pid": os.getpid(), "steps": measured,
        "images": measured * batch_size, "seconds": seconds,
        "images_per_s": measured * batch_size / seconds,
        "wait_s": window_wait, "wait_fraction": window_wait / seconds,
        "step_s_median": statistics.median(durations),
        "warmup_steps": steps - measured, "warmup_wait_s": wait,
        "first_step_s": first_step - born, "ready_s": ready - born,
        "model": config["model"], "model_source": model_source,
        "parameters": sum(p.numel() for p in model.parameters()),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor()
        or platform.machine(),
        "torch": torch.__version__, "loader_stats": stats,
    }
    _send("RESULT " + json.dumps(result))


# --- the benchmark process -----------------------------------------------------------------

def child_env() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (the trainers and zloader
    workers import bench.gpu_train, and zloader from the tree when it is not installed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


class Trainer:
    """A trainer process; its READY and RESULT lines are collected on a thread."""

    def __init__(self, config: dict[str, Any], workdir: pathlib.Path) -> None:
        path = workdir / f"trainer-{config['scenario']}-{config['index']}.json"
        path.write_text(json.dumps(config))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.gpu_train", "--trainer", str(path)], cwd=REPO,
            env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = threading.Event()
        self.result: dict[str, Any] | None = None
        self.done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("READY"):
                self.ready.set()
            elif line.startswith("RESULT "):
                self.result = json.loads(line[len("RESULT "):])
        self.done.set()

    def go(self, at: float) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"GO {at}\n")
        self.process.stdin.flush()

    def failed(self) -> bool:
        return self.done.is_set() and self.result is None


def stop_all(processes: list[subprocess.Popen[Any]], grace: float = 10.0) -> None:
    """Close their input, wait a little, then SIGTERM, then SIGKILL, and reap them."""
    for process in processes:
        with contextlib.suppress(OSError):
            if process.stdin is not None:
                process.stdin.close()
    deadline = time.monotonic() + grace
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + 15.0  # a trainer closes its loader on SIGTERM
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_scenario(spec: Scenario, settings: dict[str, Any], workdir: pathlib.Path,
                 window: float, ready_by: float, end_by: float) -> dict[str, Any]:
    """Start the scenario's processes, wait until all trainers are warm, measure them over
    one window of wall clock, stop everything. Raises RuntimeError on a failure."""
    trainers_count = settings["trainers"] if spec.search else 1
    model = settings["search_model"] if spec.search else settings["model"]
    pool = settings["search_workers"] if spec.search else settings["workers"]
    per_trainer = pool // trainers_count if spec.source == "torch" else (
        pool if spec.source == "zloader" else 0)
    base = {"scenario": spec.name, "source": spec.source, "model": model,
            "device": settings["device"], "batch_size": settings["batch_size"],
            "crop": settings["crop"], "paths": settings["paths"],
            "epoch_images": settings["epoch_images"], "workers": per_trainer,
            "warmup": settings["warmup"], "window": window, "broker": None,
            "share_window_bytes": settings["share_window_bytes"]}
    started = time.monotonic()
    phases: dict[str, float] = {}
    pool_processes: list[subprocess.Popen[Any]] = []
    broker = None
    trainers: list[Trainer] = []
    try:
        if spec.source == "zloader-shared":
            from zloader.broker import Broker

            broker = Broker("tcp://127.0.0.1:0").start()
            base["broker"] = broker.endpoint
            pool_processes += [subprocess.Popen(
                worker_command(broker.endpoint, parent=os.getpid()), cwd=REPO, env=child_env(),
                stdin=subprocess.DEVNULL) for _ in range(pool)]
        for index in range(trainers_count):
            trainers.append(Trainer({**base, "index": index}, workdir))
        for polls in itertools.count():
            if all(t.ready.is_set() for t in trainers):
                break
            if polls % 20 == 19:
                note_descendants()  # the loaders' workers start now
            if any(t.failed() for t in trainers):
                raise RuntimeError("a trainer exited before it was ready (see its stderr)")
            if time.monotonic() > ready_by:
                raise RuntimeError("the trainers were not warm by the deadline")
            time.sleep(0.05)
        at = time.monotonic() + 0.05
        phases["ready"] = at - started
        for trainer in trainers:
            trainer.go(at)
        report_by = min(at + window + settings["report_grace"], end_by)
        while not all(t.result is not None or t.done.is_set() for t in trainers):
            if time.monotonic() > report_by:
                raise RuntimeError("a trainer did not report by the deadline")
            time.sleep(0.05)
        if any(t.result is None for t in trainers):
            raise RuntimeError("a trainer failed during the window (see its stderr)")
        phases["reported"] = time.monotonic() - started
    finally:  # the trainers first (their Loaders leave the broker), then the pool
        note_descendants()
        stop_all([t.process for t in trainers], grace=10.0)
        stop_all(pool_processes, grace=0.0)
        if broker is not None:
            broker.close()
        phases["stopped"] = time.monotonic() - started
    results = [t.result for t in trainers if t.result is not None]
    rates = [r["images_per_s"] for r in results]
    waits = [r["wait_fraction"] for r in results]
    return {"status": "ok", "label": spec.label, "trainers": trainers_count, "model": model,
            "model_source": results[0]["model_source"],
            "loader": spec.source, "workers": pool if spec.source != "synthetic" else 0,
            "workers_per_trainer": per_trainer, "window_s": window,
            "images_per_s": sum(rates), "per_trainer_images_per_s": rates,
            "wait_fraction": statistics.mean(waits), "per_trainer_wait_fraction": waits,
            "phases_s": phases, "results": results}


def ratio(report: dict[str, Any], top: str, bottom: str) -> float | None:
    a, b = report.get(top, {}), report.get(bottom, {})
    if a.get("status") == "ok" and b.get("status") == "ok" and b["images_per_s"] > 0:
        return float(a["images_per_s"] / b["images_per_s"])
    return None


RATIOS = (  # key, numerator, denominator, label, target
    ("zloader_vs_dataloader", "zloader", "dataloader",
     "one trainer: zloader / torch DataLoader", 1.0),
    ("search_zloader_vs_search_dataloader", "search-zloader", "search-dataloader",
     "search, total: shared zloader / a DataLoader each", 2.5),
    ("gpu_alone_vs_dataloader", "gpu-alone", "dataloader",
     "ceiling, one trainer: GPU alone / torch DataLoader", None),
    ("search_gpu_alone_vs_search_dataloader", "search-gpu-alone", "search-dataloader",
     "ceiling, search: GPU alone / a DataLoader each", None),
)


def ratios(scenarios: dict[str, Any], judged: bool) -> dict[str, Any]:
    out = {}
    for key, top, bottom, label, target in RATIOS:
        value = ratio(scenarios, top, bottom)
        holds = None
        if judged and target is not None and value is not None:
            holds = value >= target
        out[key] = {"label": label, "value": value, "target": target, "holds": holds}
    return out


def markdown(report: dict[str, Any]) -> str:
    scenarios = report["scenarios"]
    settings = report["settings"]
    lines = ["| scenario | trainers x model | workers | images/s (total) | each trainer | "
             "data wait | vs GPU alone |", "|---|---|---|---|---|---|---|"]
    for name in SCENARIOS:
        entry = scenarios.get(name)
        if entry is None:
            continue
        if entry["status"] != "ok":
            lines.append(f"| {name} | - | - | {entry['status']}: {entry.get('note', '')} "
                         "| - | - | - |")
            continue
        ceiling = scenarios.get("search-gpu-alone" if name.startswith("search")
                                else "gpu-alone", {})
        versus = (f"{entry['images_per_s'] / ceiling['images_per_s']:.2f}x"
                  if ceiling.get("status") == "ok" else "-")
        workers = (f"{entry['workers']}" + (f" ({entry['workers_per_trainer']} each)"
                                            if entry["loader"] == "torch"
                                            and entry["trainers"] > 1 else "")
                   if entry["loader"] != "synthetic" else "-")
        each = ", ".join(f"{r:,.0f}" for r in entry["per_trainer_images_per_s"])
        waits = entry["per_trainer_wait_fraction"]
        wait = (f"{entry['wait_fraction']:.1%}" if len(waits) == 1 else
                f"{entry['wait_fraction']:.1%} ({min(waits):.0%}-{max(waits):.0%})")
        shortened = " (shortened)" if entry["window_s"] < settings["window_s"] else ""
        lines.append(f"| {name}{shortened} | {entry['trainers']} x {entry['model']} | "
                     f"{workers} | {entry['images_per_s']:,.0f} | {each} | {wait} | "
                     f"{versus} |")
    lines += ["", "| figure | value | target | holds |", "|---|---|---|---|"]
    for entry in report["ratios"].values():
        value = f"{entry['value']:.2f}x" if entry["value"] is not None else "-"
        target = f">= {entry['target']:.2f}x" if entry["target"] is not None else "-"
        holds = ("-" if entry["target"] is None else
                 "n/a (not a GPU run)" if not report["judged"] else
                 "-" if entry["holds"] is None else "yes" if entry["holds"] else "no")
        lines.append(f"| {entry['label']} | {value} | {target} | {holds} |")
    return "\n".join(lines)


SEEN_PIDS = {os.getpid()}  # this process and every descendant seen (note_descendants)
SEGMENT_PID = re.compile(r"^(?:zloader-\d+-(\d+)-|torch_(\d+)_)")


def note_descendants() -> None:
    """Remember the pids of this process's descendants (trainers, their loaders' workers,
    the zloader pool), whose /dev/shm segments ``leftovers`` looks for."""
    with contextlib.suppress(ImportError):
        import psutil

        with contextlib.suppress(psutil.Error):
            SEEN_PIDS.update(p.pid for p in psutil.Process().children(recursive=True))


def leftovers(shm_before: set[str]) -> dict[str, list[str]]:
    """Child processes still alive, and new zloader/torch /dev/shm segments named after
    this process or a descendant (other users' runs make segments too)."""
    children: list[str] = []
    with contextlib.suppress(ImportError):
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                children.append(f"{child.pid} {' '.join(child.cmdline())[:100]}")
    segments = []
    if DEV_SHM.is_dir():
        for name in sorted(set(os.listdir(DEV_SHM)) - shm_before):
            match = SEGMENT_PID.match(name)
            if match and int(match.group(1) or match.group(2)) in SEEN_PIDS:
                segments.append(name)
    return {"child_processes": children, "shm_segments": segments}


OWNER = os.getpid()


def _raise_system_exit(signum: int, frame: Any) -> None:
    """SIGTERM runs the clean-up, as Ctrl-C does; in a forked child (a DataLoader worker,
    a JPEG writer) that inherited this handler, it terminates as by default."""
    if os.getpid() != OWNER:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise SystemExit(128 + signum)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda if available, else cpu (and then --smoke)")
    parser.add_argument("--smoke", action="store_true",
                        help="a quick check on CPU: tiny model, 64x64 crops, 64 JPEGs, "
                             "3 s windows, 2 workers")
    parser.add_argument("--window", type=float, default=None,
                        help="seconds measured per scenario (default 20; smoke 3)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of steps after the first before measuring (default 6; "
                             "smoke 1); at least 10 steps")
    parser.add_argument("--workers", type=int, default=None,
                        help="worker processes for one trainer (default: cores - 1; smoke 2)")
    parser.add_argument("--search-workers", type=int, default=None,
                        help="worker processes for the search scenarios in all (default: "
                             "--workers rounded down to a multiple of --trainers, at least "
                             "one a trainer)")
    parser.add_argument("--trainers", type=int, default=4, help="trainers in a search")
    parser.add_argument("--images", type=int, default=None,
                        help="JPEG files written (default 2000; smoke 64)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="per trainer (default 256; smoke 16)")
    parser.add_argument("--crop", type=int, default=None, help="default 224; smoke 64")
    parser.add_argument("--model", default=None,
                        help="one-trainer model: resnet18/34/50/101/152 or tiny "
                             "(default resnet50; smoke tiny)")
    parser.add_argument("--search-model", default=None,
                        help="search model (default resnet18; smoke tiny)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, among {', '.join(SCENARIOS)}")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds the whole run may take (default 330; smoke 240)")
    parser.add_argument("--out", default="bench/results",
                        help="directory for gpu_train.json/.md (gpu_train_smoke.* with "
                             "--smoke, gpu_train_cpu.* on CPU)")
    parser.add_argument("--trainer", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trainer is not None:
        return args
    models = ("tiny", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
    chosen = [s for s in args.scenarios.split(",") if s]
    if not chosen or set(chosen) - set(SCENARIOS):
        parser.error(f"--scenarios must be among {', '.join(SCENARIOS)}")
    args.scenarios = [s for s in SCENARIOS if s in chosen]
    for name in (args.model, args.search_model):
        if name is not None and name not in models:
            parser.error(f"models are {', '.join(models)}")
    for name in ("workers", "search_workers", "trainers", "images", "batch_size", "crop"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("window", "warmup", "budget"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name} must be positive")
    return args


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The settings of this run: the smoke defaults or the GPU ones, then the flags."""
    import torch

    cores = len(os.sched_getaffinity(0))
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device == "cpu" and not args.smoke:
            print("no GPU: running the CPU smoke test (--smoke)", file=sys.stderr)
            args.smoke = True
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    smoke = args.smoke

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else small if smoke else full

    workers = pick(args.workers, max(1, cores - 1), 2)
    trainers = args.trainers
    search_workers = args.search_workers or max(trainers, workers // trainers * trainers)
    batch_size = pick(args.batch_size, 256, 16)
    crop = pick(args.crop, CROP, 64)
    window = pick(args.window, 20.0, 3.0)
    return {
        "device": args.device, "smoke": smoke, "cores": cores, "workers": workers,
        "trainers": trainers, "search_workers": search_workers, "batch_size": batch_size,
        "crop": crop, "window_s": window, "warmup": pick(args.warmup, 6.0, 1.0),
        "images": pick(args.images, 2000, 64),
        "model": pick(args.model, "resnet50", "tiny"),
        "search_model": pick(args.search_model, "resnet18", "tiny"),
        "budget_s": pick(args.budget, 330.0, 240.0),
        # long epochs: no epoch ends inside a window (a bubble in every loader)
        "epoch_images": batch_size * (1024 if not smoke else 256),
        # each zloader worker keeps 8 batches for the trainers sharing them
        "share_window_bytes": max(1 << 26, 8 * batch_size * crop * crop * 3),
        "ready_timeout": 60.0 if smoke else 150.0,  # start, CUDA, cudnn autotune, warm-up
        "report_grace": 30.0,
        "overhead_guess": 15.0 if smoke else 30.0,  # a scenario's time besides its window
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trainer is not None:
        signal.signal(signal.SIGTERM, _raise_system_exit)
        try:
            trainer_main(args.trainer)
        except Abort:
            return 1
        except KeyboardInterrupt:  # the benchmark process stops the others
            return 130
        return 0
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _raise_system_exit)  # run the clean-up, as for Ctrl-C
    shm_before = set(os.listdir(DEV_SHM)) if DEV_SHM.is_dir() else set()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-gpu-train-"))
    scenarios: dict[str, Any] = {}
    try:
        # The JPEGs first, from a pool forked before torch is imported.
        cores = len(os.sched_getaffinity(0))
        images = args.images or (64 if args.smoke else 2000)
        paths = write_jpegs(workdir, images, cores)
        jpeg_s = time.monotonic() - started
        jpeg_bytes = statistics.mean(os.path.getsize(p) for p in paths)
        print(f"wrote {len(paths)} JPEGs, {jpeg_bytes / 1e3:.0f} kB on average, in "
              f"{jpeg_s:.1f} s", file=sys.stderr, flush=True)
        settings = resolve(args)
        settings.update(paths=paths, images=len(paths))
        budget = settings["budget_s"]
        overheads: list[float] = []
        end_by = started + budget  # then only the stopping (at most 25 s) and the report
        for name in args.scenarios:
            spec = SPECS[name]
            left = end_by - time.monotonic()
            overhead = max(overheads) if overheads else settings["overhead_guess"]
            window = settings["window_s"]
            if left < overhead + window:
                window = left - overhead
                if window < max(1.0, settings["window_s"] / 4):
                    scenarios[name] = {"status": "skipped", "label": spec.label,
                                       "note": f"time budget ({left:.0f} s left of "
                                               f"{budget:.0f})"}
                    print(f"[{name}] skipped: {left:.0f} s left of the {budget:.0f} s budget",
                          file=sys.stderr, flush=True)
                    continue
            began = time.monotonic()
            ready_by = min(began + settings["ready_timeout"], end_by - window - 5.0)
            try:
                result = run_scenario(spec, settings, workdir, window, ready_by, end_by)
            except RuntimeError as exc:
                scenarios[name] = {"status": "failed", "label": spec.label,
                                   "note": str(exc)}
                print(f"[{name}] failed: {exc}", file=sys.stderr, flush=True)
                continue
            result["seconds"] = time.monotonic() - began
            overheads.append(result["seconds"] - window)
            scenarios[name] = result
            print(f"[{name}] {result['images_per_s']:,.0f} images/s, data wait "
                  f"{result['wait_fraction']:.1%} ({result['seconds']:.1f} s)",
                  file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    import torch

    try:
        import zloader

        zloader_version = zloader.__version__
    except ImportError as exc:  # its dependencies missing: the zloader scenarios failed
        zloader_version = f"not importable ({exc})"
    judged = settings["device"] == "cuda" and not settings["smoke"]
    device_name = next((r["device_name"] for s in scenarios.values()
                        for r in s.get("results", [])), None)
    public = {key: value for key, value in settings.items() if key != "paths"}
    report = {
        "benchmark": "gpu_train",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"type": settings["device"], "name": device_name},
        "cores": settings["cores"], "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "torchvision": version("torchvision"), "zloader": zloader_version,
                     "numpy": np.__version__, "pillow": Image.__version__},
        "settings": public, "jpeg_seconds": jpeg_s, "jpeg_mean_bytes": jpeg_bytes,
        "dev_shm_bytes": shutil.disk_usage(DEV_SHM).total if DEV_SHM.is_dir() else None,
        "zloader_source": provenance(),
        "judged": judged, "scenarios": scenarios,
        "ratios": ratios(scenarios, judged),
    }
    report["leftovers"] = leftovers(shm_before)
    report["total_s"] = time.monotonic() - started
    table = markdown(report)
    kind = "smoke" if settings["smoke"] else settings["device"]
    head = (f"GPU training benchmark ({kind}): device {device_name}, {settings['cores']} "
            f"cores, torch {torch.__version__}, zloader {zloader_version}, "
            f"{report['date']}. Batch {settings['batch_size']} of {settings['crop']}x"
            f"{settings['crop']} crops from {settings['images']} JPEGs, bf16, "
            f"{settings['window_s']:g} s windows after {settings['warmup']:g} s of warm-up; "
            f"{settings['workers']} workers for one trainer, {settings['search_workers']} for "
            f"the {settings['trainers']} trainers of a search. Data wait: the share of the "
            f"window a trainer waited for its next batch (the GPU idle). Total "
            f"{report['total_s']:.0f} s (budget {settings['budget_s']:.0f} s).")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_train_smoke" if settings["smoke"] else (
        "gpu_train" if settings["device"] == "cuda" else "gpu_train_cpu")
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(f"{head}\n\n{table}\n")
    print(table)
    for what, found in report["leftovers"].items():
        if found:
            print(f"warning: leftover {what}: {found}", file=sys.stderr)
    print(f"elapsed: {report['total_s']:.1f} s")
    failed = [name for name, entry in scenarios.items() if entry["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    # Run as bench.gpu_train, not __main__, so that the functions that travel to zloader's
    # workers (the pipeline's map, the dataset) are pickled by reference.
    from bench import gpu_train

    try:
        sys.exit(gpu_train.main())
    except KeyboardInterrupt:  # everything is stopped by now
        print("interrupted", file=sys.stderr)
        sys.exit(130)
