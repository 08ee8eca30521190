"""Memory benchmark: what forked workers copy of the dataset, their base, and rings.

Side by side in one run, ``torch.utils.data.DataLoader`` and ``zloader.torch.DataLoader``
with the same arguments (``batch_size=256``, ``shuffle=True``, the default collate, one
seeded ``generator``), and zloader with ``pack_dataset=False`` as the control (its workers
read the lists as torch's do). Memory is each process's USS (pages mapped by it alone,
from /proc smaps, through psutil) unless said otherwise.

(1) **Copy on read.** Two map-style datasets, built in this process, whose classes know
    nothing of zloader: ``Folder`` holds ``samples``, a list of ``--paths`` (default 3 M)
    ``(path, label)`` tuples, as torchvision's ImageFolder does, and returns the pair;
    ``Captions`` holds a list of ``--dicts`` (default 1 M) dicts of a caption, an id and a
    size, and returns one. One copy of a dataset is the growth of this process's USS while
    it was built. Each loader reads one full epoch with ``--workers`` (default 8) forked
    workers; the figure is the sum over the workers of their USS growth, from when each
    has sent two batches (past start-up) to the epoch's last batch (before the workers
    stop), as a multiple of one copy.
    Target: <= 0.1 for zloader. Also the seconds from construction to the first batch
    (zloader packs the lists then), from there to the last batch, and both together.

(2) **Worker base.** A small ``Folder`` (4 batches per worker), ``--workers`` workers:
    each worker's USS once it has sent two batches (median over the workers). Target:
    zloader <= 2x torch.

(3) **Rings against workers.** ``Loader(Pipeline.range(N).batch(16), num_workers=W)`` for
    W in 8, 32, 64: the /dev/shm the Loader's segments hold (allocated blocks) and the
    total PSS of the Loader's process and its workers, both at their peak over the epoch
    (sampled every 0.2 s).

(4) **Memory over epochs.** Persistent workers (``persistent_workers=True``), ``--epochs``
    (default 20) epochs over a ``Folder`` of 200,000 samples: each worker's RSS after each
    epoch; the figure is the largest change of any worker against its value after epoch 2.
    Target: within 5% for zloader.

Writes ``memory.json``, ``memory.md`` (the tables) and ``memory.png`` (memory against
workers, and against epochs, for both loaders) into ``--out``. These machines are shared
and noisy: read the ratios. Run: ``python -m bench.memory [--paths N] [--dicts N]
[--workers N] [--epochs N] [--only 1,2,3,4] [--out bench/results]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import pathlib
import platform
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch
import torch.utils.data

import zloader
import zloader.torch as zt
from bench._common import provenance
from bench.report import memory_tables

MIB = 2**20
BATCH = 256
LOADERS = ("torch", "zloader", "zloader, pack_dataset=False")


class Folder(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``samples``: (path, label) pairs, as torchvision's ImageFolder keeps them."""

    def __init__(self, size: int) -> None:
        self.samples = [(f"/datasets/imagenet/train/n{i % 1000:08d}/n{i % 1000:08d}_"
                         f"{i:08d}.JPEG", i % 1000) for i in range(size)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[str, int]:
        return self.samples[index]


class Captions(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A list of dicts of atoms: a caption, an id and a size per sample."""

    def __init__(self, size: int) -> None:
        self.rows = [{"caption": f"a photograph of object {i % 9973} on a table, seen from "
                                 f"angle {i % 360}", "id": i, "size": 1000 + i % 5000}
                     for i in range(size)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


def uss(pid: int) -> int:
    return int(psutil.Process(pid).memory_full_info().uss)


def shm_private(pid: int) -> int:
    """Bytes of ``pid``'s USS in /dev/shm mappings (rings: transport, not the dataset)."""
    return sum(m.private_clean + m.private_dirty
               for m in psutil.Process(pid).memory_maps(grouped=True)
               if m.path.startswith("/dev/shm/"))


def make_loader(name: str, dataset: Any, workers: int, persistent: bool = False,
                seed: int = 0) -> Any:
    kwargs: dict[str, Any] = {
        "batch_size": BATCH, "shuffle": True, "num_workers": workers,
        "generator": torch.Generator().manual_seed(seed), "persistent_workers": persistent,
        "timeout": 600}
    if name == "torch":
        return torch.utils.data.DataLoader(dataset, **kwargs)
    return zt.DataLoader(dataset, pack_dataset=name == "zloader", **kwargs)


def started_up(iterator: Any, workers: int) -> int:
    """Take batches until every worker has sent two (batch ``j`` is worker ``j mod W``'s,
    for both loaders): the workers are past their start-up. Returns the batches taken."""
    for _ in range(2 * workers):
        next(iterator)
    return 2 * workers


def one_epoch(name: str, dataset: Any, workers: int) -> dict[str, Any]:
    """One epoch of ``dataset``: the workers' USS once started up and at their last
    batch, and times."""
    started = time.perf_counter()
    loader = make_loader(name, dataset, workers)
    iterator = iter(loader)
    total = len(loader)
    next(iterator)
    first = time.perf_counter()
    seen = 1 + started_up(iterator, workers)
    pids = [worker.pid for worker in iterator._workers]
    base = [uss(pid) for pid in pids]
    base_shm = [shm_private(pid) for pid in pids]
    end: list[int] = []
    for _ in iterator:
        seen += 1
        if seen == total:
            end = [uss(pid) for pid in pids]
            end_shm = [shm_private(pid) for pid in pids]
            done = time.perf_counter()
    del iterator, loader
    gc.collect()
    return {"batches": seen, "first_batch_s": first - started, "epoch_s": done - started,
            "base_uss": base, "end_uss": end,
            "growth": sum(e - b for e, b in zip(end, base, strict=True)),
            "shm_growth": sum(e - b for e, b in zip(end_shm, base_shm, strict=True))}


def copy_on_read(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for label, make, size in (("paths", Folder, args.paths), ("dicts", Captions, args.dicts)):
        gc.collect()
        before = uss(os.getpid())
        dataset = make(size)
        gc.collect()
        copy = uss(os.getpid()) - before
        runs = {name: one_epoch(name, dataset, args.workers) for name in LOADERS}
        for run in runs.values():
            run["growth_copies"] = run["growth"] / copy
        results[label] = {"samples": size, "one_copy": copy, "runs": runs}
        print(f"(1) {label}: one copy {copy / MIB:.0f} MiB; " + "; ".join(
            f"{name}: {run['growth_copies']:.2f} copies, epoch {run['epoch_s']:.1f} s"
            for name, run in runs.items()), flush=True)
        del dataset
    return results


def worker_base(args: argparse.Namespace) -> dict[str, Any]:
    dataset = Folder(BATCH * args.workers * 4)
    results = {}
    for name in LOADERS[:2]:
        loader = make_loader(name, dataset, args.workers)
        iterator = iter(loader)
        started_up(iterator, args.workers)
        time.sleep(0.5)
        sizes = [uss(worker.pid) for worker in iterator._workers]
        results[name] = {"uss": sizes, "median": statistics.median(sizes)}
        del iterator, loader
        gc.collect()
    print("(2) worker base: " + "; ".join(f"{n}: {r['median'] / MIB:.1f} MiB"
                                          for n, r in results.items()), flush=True)
    return results


def _segments_bytes(pids: set[int]) -> int:
    """/dev/shm blocks held by zloader segments of ``pids`` (their name holds the pid)."""
    total = 0
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if name.startswith("zloader-") and len(parts) > 2 and parts[2].isdigit() \
                and int(parts[2]) in pids:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join("/dev/shm", name)).st_blocks * 512
    return total


def _pss(pids: set[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += int(psutil.Process(pid).memory_full_info().pss)
    return total


def peak_while(run: Callable[[], None], pids: Callable[[], set[int]]) -> tuple[int, int]:
    """Run ``run``; the peak /dev/shm and total PSS of ``pids()`` meanwhile."""
    peak = [0, 0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            current = pids()
            peak[0] = max(peak[0], _segments_bytes(current))
            peak[1] = max(peak[1], _pss(current))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        run()
    finally:
        stop.set()
        thread.join()
    return peak[0], peak[1]


def rings(args: argparse.Namespace) -> list[dict[str, Any]]:
    points = []
    for workers in (8, 32, 64):
        pipeline = zloader.Pipeline.range(workers * 2000).batch(16)
        with zloader.Loader(pipeline, num_workers=workers) as loader:
            pids = {os.getpid()} | {p.pid for p in loader._processes}
            count = [0]

            def epoch(loader: zloader.Loader = loader, count: list[int] = count) -> None:
                count[0] = sum(1 for _ in loader)

            shm, pss = peak_while(epoch, lambda pids=pids: pids)
        points.append({"workers": workers, "batches": count[0], "shm_peak": shm,
                       "pss_peak": pss})
        print(f"(3) {workers} workers: /dev/shm {shm / MIB:.0f} MiB, PSS {pss / MIB:.0f} MiB",
              flush=True)
    return points


def over_epochs(args: argparse.Namespace) -> dict[str, Any]:
    dataset = Folder(200_000)
    results = {}
    for name in LOADERS[:2]:
        loader = make_loader(name, dataset, 4, persistent=True)
        rss: list[list[int]] = []
        for _ in range(args.epochs):
            iterator = iter(loader)
            for _ in iterator:
                pass
            rss.append([int(psutil.Process(w.pid).memory_info().rss)
                        for w in iterator._workers])
        del loader, iterator
        gc.collect()
        reference = rss[min(1, len(rss) - 1)]
        change = max(abs(r - ref) / ref for epoch in rss for r, ref in
                     zip(epoch, reference, strict=True))
        results[name] = {"rss": rss, "largest_change": change}
        print(f"(4) {name}: largest change of a worker's RSS against epoch 2: "
              f"{change:.1%}", flush=True)
    return results


def plot(data: dict[str, Any], out: pathlib.Path) -> None:
    from bench.report import figure, save

    fig, (left, right) = figure(2)
    if "rings" in data:
        workers = [p["workers"] for p in data["rings"]]
        left.plot(workers, [p["shm_peak"] / MIB for p in data["rings"]], "o-",
                  label="/dev/shm held")
        left.plot(workers, [p["pss_peak"] / MIB for p in data["rings"]], "s-",
                  label="total PSS")
        left.set_xlabel("workers")
        left.set_ylabel("MiB (zloader)")
        left.legend()
    if "over_epochs" in data:
        for name, result in data["over_epochs"].items():
            totals = [sum(epoch) / MIB for epoch in result["rss"]]
            right.plot(range(1, len(totals) + 1), totals, "o-", label=name)
        right.set_xlabel("epoch")
        right.set_ylabel("workers' RSS, MiB")
        right.legend()
    save(fig, out, "memory.png", "memory against workers and epochs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--paths", type=int, default=3_000_000)
    parser.add_argument("--dicts", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--only", default="1,2,3,4")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    sections = set(args.only.split(","))
    data: dict[str, Any] = {}
    if "2" in sections:
        data["worker_base"] = worker_base(args)
    if "1" in sections:
        data["copy_on_read"] = copy_on_read(args)
    if "3" in sections:
        data["rings"] = rings(args)
    if "4" in sections:
        data["over_epochs"] = over_epochs(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data.update({
        "workers": args.workers, "batch_size": BATCH,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "versions": {"torch": torch.__version__},
        **provenance()})
    (out / "memory.json").write_text(json.dumps(data, indent=2))
    lines = memory_tables(data)
    plot(data, out)
    (out / "memory.md").write_text(
        f"Memory benchmark (bench/memory.py), nproc {os.cpu_count()}, {args.workers} "
        f"workers, batches of {BATCH}, zloader at {data['commit'][:12]}.\n\n"
        + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
