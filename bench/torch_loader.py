"""DataLoader benchmark: ``zloader.torch.DataLoader`` against ``torch.utils.data.DataLoader``.

Both loaders get the same arguments (``num_workers=2``, ``batch_size=64``, ``shuffle=True``,
the default collate, ``timeout=120``, and per round the same seeded ``generator``, so that
they should draw the same batches: the results record whether they did). The consumer
reads one element of every tensor of every batch, so that a lazy path cannot skip the
transfer, and does nothing else with the data. Each epoch is ``--samples`` samples
(default 2048, 32 batches).

(1) Image pipeline as users write it. The benchmark writes 256 synthetic JPEG files
    (500x375 RGB, quality 90, smooth gradients plus noise so that they compress like
    photographs) into a temporary directory. A map-style ``Dataset`` opens and decodes one
    with PIL, takes a random resized crop to 224x224 (scale 0.08-1, ratio 3/4-4/3,
    torchvision's algorithm written out with ``random``), flips it horizontally with
    p=0.5 and returns a float32 CHW tensor in [0, 1] and an int label; the file list is
    repeated to fill the epoch. Figures:

    * images/s. *steady*: over the window from the 4th batch received to the 4th-last
      (away from the filling of the 2 x 2 batches in flight at the start and their
      draining at the end, so that the work in flight is alike at both ends): what a long
      epoch sees. *whole epoch*: all images / seconds from constructing the loader to the
      last batch (includes start-up, see (3)).
    * CPU-seconds per image: user + system CPU of this process and all its descendants.
      Exited children count through ``os.times()`` (the children this process reaped:
      torch joins its workers, zloader waits for its worker processes), live ones through
      psutil (their own CPU plus their reaped children, over ``children(recursive=True)``).
      *steady*: over the steady window. *lifecycle*: from construction to after
      ``close()``, when every worker has been reaped, per image (includes worker start-up:
      zloader starts fresh interpreters that import torch, torch forks).

    Targets: images/s zloader / torch >= 0.95; CPU-s per image zloader / torch < 1.

(2) Transfer-bound: a map-style dataset returns one float32 (3, 224, 224) tensor,
    allocated once per process, and an int; batch 64 (38.5 MB a batch). Batches/s and GB/s
    of tensor bytes received, steady and whole epoch as in (1). Target: zloader / torch
    >= 3.

(3) Start-up, image dataset of (1): seconds from constructing the loader to its first
    batch, from the runs of (1) (default arguments; target: zloader <= 2 s); and, with
    ``persistent_workers=True`` for both, after a full first epoch, seconds from the second
    ``iter()`` to its first batch (target: zloader / torch <= 1). For reference, the
    seconds from the last batch of a run of (1) to all its workers stopped (the end of
    the epoch, then ``close()``).

Every figure is the median of ``--runs`` runs (default 3), each on a fresh loader; the
runs alternate torch, zloader, torch, ... so that machine noise falls on both alike, and an
untimed warm-up epoch of each loader (2 batches) comes first. The ratio column is always
zloader / torch: higher is better for throughput, lower for CPU and seconds. These machines
are shared and noisy: read the ratios, not the absolute numbers. Under each table, the CPU
that other processes used during the runs (machine-wide busy time, hypervisor steal
included, less this benchmark's own), in cores: a run that others crowded shows there.
zloader runs from the working tree (an editable install); the results name its commit and
uncommitted files.

Every loader is closed (torch: its iterators' workers shut down; zloader: ``close()``)
right after its run, also on errors, Ctrl-C and SIGTERM, and the JPEG directory is
removed. The results record, per run, what was left after close: ``/dev/shm`` segments
named after this process or one of its workers (``zloader-UID-PID-...``, ``torch_PID_...``)
and the zloader Loader's socket directory; and at exit the live child processes. All
should be empty. (Other users' zloader runs on a shared machine create segments too; those
are not counted.) For zloader the results also hold its Loader's ``stats()``.

Run: ``python -m bench.torch_loader [--samples N] [--runs N] [--out bench/results]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import torch
import torch.utils.data

from bench._common import provenance, version
from bench._images import CROP, JPEG_FILES, decode_augment, write_jpegs

DEV_SHM = pathlib.Path("/dev/shm")
NUM_WORKERS = 2
BATCH_SIZE = 64
TIMEOUT_S = 120
WARMUP_SAMPLES = 2 * BATCH_SIZE
STEADY_SKIP = 2 * NUM_WORKERS  # batches in flight: torch's default prefetch_factor 2 a worker
SYSTEMS = ("torch", "zloader")
NAMES = {"torch": "torch DataLoader", "zloader": "zloader.torch.DataLoader"}


# --- the data ----------------------------------------------------------------------------

class ImageDataset(torch.utils.data.Dataset):
    """JPEG file -> random resized crop 224 -> random horizontal flip -> float CHW in [0, 1]."""

    def __init__(self, paths: list[str], length: int) -> None:
        self.paths = paths
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        file = index % len(self.paths)
        pixels = torch.from_numpy(decode_augment(self.paths[file]))  # HWC uint8
        return pixels.permute(2, 0, 1).contiguous().float().div_(255.0), file % 1000


class TransferDataset(torch.utils.data.Dataset):
    """The same float32 (3, 224, 224) tensor for every index, allocated on first use in each
    process (never pickled), and an int label."""

    def __init__(self, length: int) -> None:
        self.length = length
        self._tensor: torch.Tensor | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"length": self.length, "_tensor": None}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self._tensor is None:
            self._tensor = torch.rand((3, CROP, CROP), generator=torch.Generator().manual_seed(0))
        return self._tensor, index % 1000


# --- measuring ---------------------------------------------------------------------------

def cpu_seconds(seen: set[int] | None = None) -> float:
    """User + system CPU seconds of this process and all its descendants, live or exited.

    ``os.times()`` gives this process (all its threads) and the children it has reaped,
    with what those had reaped in turn; psutil gives each live descendant's own CPU plus
    its reaped children. A child that exits between the two reads could be missed, so
    sample only when none is exiting (the loaders are fully started or fully closed).
    The pids of the live descendants are added to ``seen``.
    """
    live = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            live += times.user + times.system + times.children_user + times.children_system
            if seen is not None:
                seen.add(child.pid)
    own = os.times()
    return live + own.user + own.system + own.children_user + own.children_system


def touch(batch: Any) -> tuple[int, float]:
    """Read one element (the last) of every tensor in ``batch``; return the bytes of the
    tensors and a fingerprint of the values read."""
    if isinstance(batch, torch.Tensor):
        if batch.numel() == 0:
            return 0, 0.0
        return batch.numel() * batch.element_size(), float(batch.reshape(-1)[-1].item())
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        total, mark = 0, 0.0
        for item in batch:
            size, value = touch(item)
            total, mark = total + size, mark * 31 + value
        return total, mark
    return 0, 0.0


def batch_samples(batch: Any) -> int:
    return len(batch[1])  # the labels


def make_loader(system: str, dataset: Any, seed: int, persistent: bool = False) -> Any:
    if system == "zloader":
        import zloader.torch

        factory: Callable[..., Any] = zloader.torch.DataLoader
    else:
        factory = torch.utils.data.DataLoader
    return factory(dataset, batch_size=BATCH_SIZE, shuffle=True, num_workers=NUM_WORKERS,
                   timeout=TIMEOUT_S, persistent_workers=persistent,
                   generator=torch.Generator().manual_seed(seed))


def close_loader(system: str, loader: Any, iterators: list[Any]) -> None:
    """Stop the loader's workers now: torch's live in its iterators, zloader's in the
    loader."""
    if system == "zloader":
        loader.close()
        return
    for iterator in iterators:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


SEGMENT_PID = re.compile(r"^(?:zloader-\d+-(\d+)-|torch_(\d+)_)")


def leftovers(before: set[str], pids: set[int], paths: list[str]) -> list[str]:
    """What this run left: new /dev/shm segments of zloader (``zloader-UID-PID-...``) or
    torch (``torch_PID_...``) created by this process or one of its children in ``pids``,
    and those of ``paths`` (the zloader Loader's socket directory) that still exist."""
    found = [path for path in paths if os.path.exists(path)]
    if DEV_SHM.is_dir():
        for name in sorted(set(os.listdir(DEV_SHM)) - before):
            match = SEGMENT_PID.match(name)
            if match and int(match.group(1) or match.group(2)) in pids:
                found.append(f"/dev/shm/{name}")
    return found


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all processes, and time stolen by the
    hypervisor); Linux counts guest time inside user and nice."""
    times = psutil.cpu_times()
    return sum(getattr(times, field, 0.0) for field in
               ("user", "nice", "system", "irq", "softirq", "steal"))


def zloader_internals(loader: Any) -> tuple[dict[str, Any], list[str]]:
    """The zloader DataLoader's stats() (of its latest pass) and the socket directories of
    this process's embedded Loaders (checked for leftovers after close)."""
    stats = dict(loader.stats())
    if not stats:
        return {}, []
    stats["per_worker"] = {str(pid): count for pid, count in stats["per_worker"].items()}
    root = tempfile.gettempdir()
    dirs = [os.path.join(root, name) for name in os.listdir(root)
            if name.startswith(f"zloader-{os.getpid()}-")]
    return stats, dirs


def run_epochs(system: str, dataset: Any, seed: int, *,
               persistent: bool = False) -> dict[str, Any]:
    """One loader: construct, one full epoch (and with ``persistent`` the first batch of a
    second one), close. Times are perf_counter seconds from construction.

    The steady window runs from the receipt of batch ``STEADY_SKIP - 1`` to that of batch
    ``batches - STEADY_SKIP - 1``: away from both the filling of the workers' prefetch at
    the start and its draining at the end, so that the work in flight is alike at both
    ends of the window.
    """
    before = set(os.listdir(DEV_SHM)) if DEV_SHM.is_dir() else set()
    pids = {os.getpid()}
    iterators: list[Any] = []
    internals: tuple[dict[str, Any], list[str]] = ({}, [])
    machine_busy = busy_seconds()
    cpu: dict[str, float] = {"construct": cpu_seconds()}
    start = time.perf_counter()
    loader = make_loader(system, dataset, seed, persistent)
    result: dict[str, Any] = {"system": system, "seed": seed}
    batches = len(loader)
    window = (STEADY_SKIP - 1, batches - STEADY_SKIP - 1) if batches > 2 * STEADY_SKIP else None
    arrivals, samples, sizes, marks = [], [], [], []
    try:
        iterator = iter(loader)
        iterators.append(iterator)
        for index in range(batches):
            batch = next(iterator)
            size, mark = touch(batch)
            arrivals.append(time.perf_counter() - start)
            sizes.append(size)
            marks.append(mark)
            samples.append(batch_samples(batch))
            del batch
            if index == 0:
                cpu["first_batch"] = cpu_seconds(pids)
            if window and index in window:
                cpu[f"batch_{index}"] = cpu_seconds(pids)
        cpu["last_batch"] = cpu_seconds(pids)
        if next(iterator, None) is not None:
            raise RuntimeError(f"{system}: more than len(loader) = {batches} batches")
        if persistent:
            second = time.perf_counter()
            iterator = iter(loader)
            iterators.append(iterator)
            touch(next(iterator))
            result["epoch2_first_batch_s"] = time.perf_counter() - second
            cpu_seconds(pids)
        if system == "zloader":
            internals = zloader_internals(loader)
    finally:
        closing = time.perf_counter()
        close_loader(system, loader, iterators)
        result["close_s"] = time.perf_counter() - closing
    result["closed_s"] = time.perf_counter() - start
    result["stop_s"] = result["closed_s"] - arrivals[-1] if len(arrivals) == batches else None
    cpu["closed"] = cpu_seconds(pids)
    others = busy_seconds() - machine_busy - (cpu["closed"] - cpu["construct"])
    result["other_load_cores"] = max(0.0, others) / result["closed_s"]
    count, total = sum(samples), sum(sizes)
    result.update(
        samples=count, batches=batches, bytes=total, fingerprint=marks,
        first_batch_s=arrivals[0], last_batch_s=arrivals[-1],
        epoch_per_s=count / arrivals[-1],
        epoch_gb_per_s=total / arrivals[-1] / 1e9,
        lifecycle_cpu_per_sample=(cpu["closed"] - cpu["construct"]) / count,
        cpu_s={key: value - cpu["construct"] for key, value in cpu.items()},
        arrivals_s=arrivals, zloader_stats=internals[0],
        leftovers=leftovers(before, pids, internals[1]))
    if window:
        a, b = window
        seconds = arrivals[b] - arrivals[a]
        in_window = sum(samples[a + 1:b + 1])
        result.update(
            steady_window=[a, b], steady_per_s=in_window / seconds,
            steady_gb_per_s=sum(sizes[a + 1:b + 1]) / seconds / 1e9,
            steady_cpu_per_sample=(cpu[f"batch_{b}"] - cpu[f"batch_{a}"]) / in_window)
    return result


def alternate(label: str, runs: int, measure: Callable[[str, int], dict[str, Any]]
              ) -> dict[str, list[dict[str, Any]]]:
    """``runs`` rounds of torch then zloader, each on a fresh loader and the round's seed."""
    results: dict[str, list[dict[str, Any]]] = {system: [] for system in SYSTEMS}
    for round_ in range(runs):
        for system in SYSTEMS:
            result = measure(system, 1000 + round_)
            results[system].append(result)
            print(f"[{label}] round {round_ + 1}/{runs} {system}: "
                  f"{result['steady_per_s']:,.1f} samples/s steady, first batch "
                  f"{result['first_batch_s']:.2f} s, closed at {result['closed_s']:.1f} s",
                  file=sys.stderr, flush=True)
    return results


# --- the tables --------------------------------------------------------------------------

@dataclass(frozen=True)
class Figure:
    """One measured quantity: ``key`` in each run's result, shown with ``fmt``. ``target``
    is ``("ratio>=", x)`` / ``("ratio<=", x)`` / ``("ratio<", x)`` on zloader / torch, or
    ``("max", x)`` on zloader's own value, or None."""

    key: str
    label: str
    fmt: Callable[[float, dict[str, Any]], str]
    target: tuple[str, float] | None
    note: str = ""


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(run[key]) for run in runs)


def holds(target: tuple[str, float], ratio: float, value: float) -> bool:
    kind, bound = target
    return {"ratio>=": ratio >= bound, "ratio<=": ratio <= bound, "ratio<": ratio < bound,
            "max": value <= bound}[kind]


def describe(target: tuple[str, float]) -> str:
    kind, bound = target
    if kind == "max":
        return f"zloader <= {bound:g} s"
    return f"zloader / torch {kind[5:]} {bound:.2f}x"


def section_rows(figures: list[Figure], results: dict[str, list[dict[str, Any]]]
                 ) -> list[dict[str, Any]]:
    rows = []
    for figure in figures:
        medians = {system: median_of(results[system], figure.key) for system in SYSTEMS}
        ratio = medians["zloader"] / medians["torch"]
        for system in SYSTEMS:
            zloader_row = system == "zloader"
            met = holds(figure.target, ratio, medians[system]) if (
                zloader_row and figure.target) else None
            rows.append({
                "system": NAMES[system], "figure": figure.label,
                "value": medians[system],
                "shown": f"{figure.label}: {figure.fmt(medians[system], results[system][0])}",
                "ratio": ratio if zloader_row else None,
                "target": (describe(figure.target) if zloader_row and figure.target
                           else "baseline" if not zloader_row else "-"),
                "holds": "-" if met is None else "yes" if met else "no",
                "note": figure.note if zloader_row else ""})
    return rows


def markdown(title: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"### {title}", "", "| system | figure | ratio (zloader / torch) | target | holds "
             "| notes |", "|---|---|---|---|---|---|"]
    for row in rows:
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
        lines.append(f"| {row['system']} | {row['shown']} | {ratio} | {row['target']} | "
                     f"{row['holds']} | {row['note']} |")
    return "\n".join(lines)


def per_s(unit: str) -> Callable[[float, dict[str, Any]], str]:
    return lambda value, _: f"{value:,.1f} {unit}/s"


def batches_and_gb(value: float, run: dict[str, Any]) -> str:
    """Batches/s, and GB/s at the run's mean batch size."""
    return f"{value:,.2f} batches/s = {value * run['bytes'] / run['batches'] / 1e9:.2f} GB/s"


def ms_per(unit: str) -> Callable[[float, dict[str, Any]], str]:
    return lambda value, _: f"{value * 1e3:.2f} ms CPU/{unit}"


def seconds(value: float, _: dict[str, Any]) -> str:
    return f"{value:.3f} s"


IMAGE_FIGURES = [
    Figure("steady_per_s", "images/s, steady", per_s("images"), ("ratio>=", 0.95),
           "4th to 4th-last batch"),
    Figure("epoch_per_s", "images/s, whole epoch", per_s("images"), ("ratio>=", 0.95),
           "construction to last batch: includes start-up"),
    Figure("steady_cpu_per_sample", "CPU-s/image, steady", ms_per("image"), ("ratio<", 1.0),
           "this process + workers, 4th to 4th-last batch"),
    Figure("lifecycle_cpu_per_sample", "CPU-s/image, lifecycle", ms_per("image"),
           ("ratio<", 1.0), "construction to after close (workers reaped): includes start-up"),
]
TRANSFER_FIGURES = [
    Figure("steady_batches_per_s", "steady", batches_and_gb, ("ratio>=", 3.0),
           "4th to 4th-last batch"),
    Figure("epoch_batches_per_s", "whole epoch", batches_and_gb, ("ratio>=", 3.0),
           "construction to last batch: includes start-up"),
]
STARTUP_FIGURES = [
    Figure("first_batch_s", "construction to first batch", seconds, ("max", 2.0),
           "default arguments (the runs of section 1)"),
    Figure("epoch2_first_batch_s", "epoch 2: iter() to first batch", seconds,
           ("ratio<=", 1.0), "persistent_workers=True, after a full epoch 1"),
    Figure("stop_s", "last batch to workers stopped", seconds, None,
           "reference: end of epoch + close(), the runs of section 1"),
]


# --- running -----------------------------------------------------------------------------

def child_processes() -> list[str]:
    """Live child processes of this process, as "pid status command"."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            found.append(f"{child.pid} {child.status()} {' '.join(child.cmdline())[:80]}")
    return found


def load_note(results: dict[str, list[dict[str, Any]]]) -> str:
    loads = {system: statistics.median(run["other_load_cores"] for run in results[system])
             for system in SYSTEMS}
    return ("Other processes kept busy, median over the runs: "
            f"{loads['torch']:.2f} cores during torch's, {loads['zloader']:.2f} during "
            f"zloader's (of {len(os.sched_getaffinity(0))}).")


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2048,
                        help="samples per epoch, in every section")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--out", default="bench/results", help="where to write results")
    args = parser.parse_args()
    least = (2 * STEADY_SKIP + 2) * BATCH_SIZE
    if args.samples < least or args.runs < 1:
        parser.error(f"--samples must be >= {least} and --runs >= 1")
    signal.signal(signal.SIGTERM, _raise_system_exit)  # run the clean-up, as for Ctrl-C

    started = time.perf_counter()
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-torch-loader-"))
    try:
        paths = write_jpegs(workdir, JPEG_FILES)
        jpeg_bytes = statistics.mean(os.path.getsize(p) for p in paths)
        print(f"wrote {len(paths)} JPEGs, {jpeg_bytes / 1e3:.0f} kB on average, in "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        images = ImageDataset(paths, args.samples)
        warmup = {system: run_epochs(system, ImageDataset(paths, WARMUP_SAMPLES), 0)
                  for system in SYSTEMS}
        results = {
            "images": alternate("1 images", args.runs,
                                lambda system, seed: run_epochs(system, images, seed)),
            "transfer": alternate(
                "2 transfer", args.runs,
                lambda system, seed: run_epochs(system, TransferDataset(args.samples),
                                                seed)),
            "persistent": alternate(
                "3 persistent", args.runs,
                lambda system, seed: run_epochs(system, images, seed, persistent=True)),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for runs in results["transfer"].values():
        for run in runs:
            run["steady_batches_per_s"] = run["steady_per_s"] / BATCH_SIZE
            run["epoch_batches_per_s"] = run["epoch_per_s"] / BATCH_SIZE
    startup = {system: [{"first_batch_s": a["first_batch_s"], "stop_s": a["stop_s"],
                         "epoch2_first_batch_s": b["epoch2_first_batch_s"]}
                        for a, b in zip(results["images"][system],
                                        results["persistent"][system], strict=True)]
               for system in SYSTEMS}
    same_batches = {
        section: all(t["fingerprint"] == z["fingerprint"] for t, z in
                     zip(results[section]["torch"], results[section]["zloader"], strict=True))
        for section in results}
    both = {system: results["images"][system] + results["persistent"][system]
            for system in SYSTEMS}
    sections = {
        "1": (f"(1) Image pipeline: JPEG decode + random resized crop + flip, "
              f"{args.samples} images, batch {BATCH_SIZE}, {NUM_WORKERS} workers",
              section_rows(IMAGE_FIGURES, results["images"]), load_note(results["images"])),
        "2": (f"(2) Transfer-bound: float32 (3, 224, 224) + int, {args.samples} samples, "
              f"batch {BATCH_SIZE}, {NUM_WORKERS} workers",
              section_rows(TRANSFER_FIGURES, results["transfer"]),
              load_note(results["transfer"])),
        "3": ("(3) Time to first batch, image dataset",
              section_rows(STARTUP_FIGURES, startup), load_note(both)),
    }
    leftover_runs = [f"{section} {run['system']} seed {run['seed']}: {path}"
                     for section, by_system in [("warmup", {s: [r] for s, r in warmup.items()}),
                                                *results.items()]
                     for runs in by_system.values() for run in runs
                     for path in run["leftovers"]]
    leftover_children = child_processes()
    text = "\n\n".join(f"{markdown(title, rows)}\n\n{note}"
                       for title, rows, note in sections.values())
    source = provenance()

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "torch_loader",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "samples": args.samples, "runs": args.runs, "batch_size": BATCH_SIZE,
        "num_workers": NUM_WORKERS, "jpeg_files": JPEG_FILES,
        "jpeg_mean_bytes": jpeg_bytes, "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "torch": torch.__version__, "pillow": version("pillow"),
                     "psutil": version("psutil"), "zloader": version("zloader")},
        "total_s": time.perf_counter() - started,
        "same_batches_as_torch": same_batches,
        "zloader_source": source,
        "tables": {key: rows for key, (_, rows, _) in sections.items()},
        "warmup": warmup, "results": results,
        "pid": os.getpid(), "leftovers_after_close": leftover_runs,
        "leftover_child_processes": leftover_children,
    }
    (out / "torch_loader.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "torch_loader.md").write_text(
        f"DataLoader benchmark, zloader.torch.DataLoader against torch.utils.data.DataLoader, "
        f"{NUM_WORKERS} workers each, median of {args.runs} alternating runs, nproc "
        f"{report['nproc']}, torch {torch.__version__}, zloader from the working tree at "
        f"{source['commit'][:12]} ({len(source['uncommitted'])} uncommitted files under "
        "zloader/). The ratio is zloader / torch: higher "
        "is better for throughput, lower for CPU and seconds. The machine is shared and "
        "noisy, so read the ratios, not the absolute numbers. Same batches as torch (same "
        f"seeded generator): {same_batches}. Leftovers after close: "
        f"{leftover_runs or 'none'}; child processes at exit: {leftover_children or 'none'}."
        f"\n\n{text}\n")
    print(text)
    for what, found in (("leftovers after close", leftover_runs),
                        ("child processes at exit", leftover_children)):
        if found:
            print(f"warning: {len(found)} {what}: {found}", file=sys.stderr)
    if not all(same_batches.values()):
        print(f"warning: batches differ from torch's: {same_batches}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the loaders are closed by now
        print("interrupted", file=sys.stderr)
        sys.exit(130)
