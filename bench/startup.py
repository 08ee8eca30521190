"""Start-up benchmark: from a DataLoader's construction to its first batch, side by side.

``torch.utils.data.DataLoader`` and ``zloader.torch.DataLoader`` with the same arguments
(``batch_size=64``, the default collate, one seeded ``generator``), in one process, in
interleaved rounds (``--rounds``, default 5; the medians are reported). The datasets are
built before the clocks start and know nothing of zloader: ``Pairs`` holds a list of
``(path, label)`` tuples, as torchvision's ImageFolder does, and returns the pair.

(1) **First batch.** Construction to the first batch of a fresh iterator (so: sampling,
    packing, forking, the workers' start and the batch) for: a small dataset (10,000
    pairs) with 2 and with 8 workers; 1 M pairs, 4 workers, ``shuffle=True``; 3 M pairs,
    8 workers (bench.memory's case); 200,000 tuples, 2 workers (a new user's trial).
    Target: zloader no later than torch in every case, and the 1 M and 3 M cases within
    1.2x of the small one with the same loader.
(2) **The second epoch** without persistent workers (torch's default): from the second
    ``iter()`` to its first batch, for the small and the 1 M case.
(3) **Dataset size.** The first batch against the dataset's size (10 k to 3 M pairs, 4
    workers, ``shuffle=True``), for both loaders (``startup.png``).
(4) **import zloader** against ``import numpy``, each in a fresh interpreter with its
    bytecode cached (medians of ``--rounds``). Target: zloader's at most numpy's plus
    100 ms.
(5) **A warm pool.** A ``zloader-broker`` and 2 ``zloader-worker`` processes already
    running; ``Loader(pipeline, broker=...)`` to its first element for a pipeline the pool
    ran before (the same fingerprint) and for a new one, and a whole job of 200 elements.
    Targets: <= 50 ms, <= 100 ms, and the whole job <= 2x its first element.
(6) **Once running.** The trainer's process CPU (all its threads) per batch over an epoch
    of the 200,000-tuple case, for both loaders. Target: zloader <= 0.5x torch.
(7) **What is left** of zloader's first batch (1 M case): the top of a cProfile of the
    trainer's process, by cumulative time.
(8) **A fresh process**, as ``python train.py`` starts: torch imported (before the
    clock), then the loader's module imported (``zloader.torch``; torch's DataLoader came
    with torch) and the small 2-worker case to its first batch, in a new interpreter
    each round with the bytecode cached. Sections (1)-(3) run in one process, where the
    modules a first Loader imports are already there.
(9) **The CPU of the first batch**: for the 2-worker cases of (1), the CPU every process
    spent from construction to the first batch (the trainer's, all its threads; each
    worker's, and any process they started, read from /proc at the first batch, in ns).
    On a host with fewer idle cores than processes starting, the first batch cannot come
    sooner than that CPU divided by the cores: what a loader does on top of torch's then
    shows in its first batch whichever process does it.

(10) **The first batches**: construction to the 1st, 3rd, 10th and 50th batch of a fresh
    iterator, for the 2- and 4-worker cases of (1): what comes after the first batch
    (with a large dataset, zloader's workers wait for its packed copy after their first
    two batches, zloader/handoff.py).

Writes ``startup.json``, ``startup.md`` and ``startup.png`` into ``--out``. These
machines are shared and noisy: read the ratios. Run: ``python -m bench.startup
[--rounds N] [--only 1,2,3,4,5,6,7,8,9,10] [--out bench/results]``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import gc
import io
import os
import pathlib
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import psutil
import torch
import torch.utils.data

import zloader
import zloader.torch as zt
from bench._common import free_port, provenance, stop, write_results

BATCH = 64
SMALL, LARGE, LARGEST, TUPLES = 10_000, 1_000_000, 3_000_000, 200_000
CASES = (  # name, pairs, workers, shuffle
    ("small, 2 workers", SMALL, 2, True),
    ("small, 8 workers", SMALL, 8, True),
    ("1 M pairs, 4 workers", LARGE, 4, True),
    ("3 M pairs, 8 workers", LARGEST, 8, True),
    ("200 k tuples, 2 workers", TUPLES, 2, True),
)
SIZES = (10_000, 100_000, 1_000_000, 3_000_000)
LOADERS: dict[str, Any] = {"torch": torch.utils.data.DataLoader, "zloader": zt.DataLoader}


class Pairs(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``size`` (path, label) tuples, as torchvision's ImageFolder holds them."""

    def __init__(self, size: int) -> None:
        self.samples = [(f"/data/train/class_{i % 1000:04d}/img_{i:08d}.jpg", i % 1000)
                        for i in range(size)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[int, int]:
        path, label = self.samples[index]
        return len(path), label


def make(name: str, dataset: Any, workers: int, shuffle: bool, seed: int = 0) -> Any:
    return LOADERS[name](dataset, batch_size=BATCH, shuffle=shuffle, num_workers=workers,
                         generator=torch.Generator().manual_seed(seed), timeout=600)


def close(loader: Any) -> None:
    if hasattr(loader, "close"):
        loader.close()
    gc.collect()


def first_batch(name: str, dataset: Any, workers: int, shuffle: bool) -> float:
    """Seconds from construction to the first batch of a fresh iterator."""
    return first_batch_cpu(name, dataset, workers, shuffle)["wall"]


def _threads_cpu(pid: int) -> float:
    """CPU seconds the threads of process ``pid`` have run so far (/proc's schedstat, in
    ns: finer than the clock ticks of ``psutil.cpu_times``); 0 for one gone."""
    total = 0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError), \
                    open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[0])
    return total / 1e9


def first_batch_cpu(name: str, dataset: Any, workers: int,
                    shuffle: bool = True) -> dict[str, float]:
    """Construction to the first batch of a fresh iterator, and the CPU seconds the
    trainer's process and its descendants (at the first batch) spent meanwhile."""
    me = psutil.Process()
    gc.collect()
    started, cpu = time.perf_counter(), time.process_time()
    loader = make(name, dataset, workers, shuffle)
    iterator = iter(loader)
    next(iterator)
    wall, trainer = time.perf_counter() - started, time.process_time() - cpu
    children = sum(_threads_cpu(child.pid) for child in me.children(recursive=True))
    del iterator
    close(loader)
    return {"wall": wall, "trainer": trainer, "workers": children,
            "total": trainer + children}


def first_batch_cpus(args: argparse.Namespace, datasets: dict[int, Any]
                     ) -> list[dict[str, Any]]:
    rows = []
    for label, size, workers, _ in CASES:
        if workers != 2:
            continue
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in LOADERS}
        for _ in range(args.rounds):
            for name in LOADERS:
                runs[name].append(first_batch_cpu(name, datasets[size], workers))
        medians = {name: {key: statistics.median(run[key] for run in values)
                          for key in values[0]} for name, values in runs.items()}
        rows.append({"case": label, "workers": workers, "cores": os.cpu_count(), **medians})
        print(rows[-1], flush=True)
    return rows


RAMP = (1, 3, 10, 50)
"""(10): the batches whose arrival is timed, from construction."""


def ramp(name: str, dataset: Any, workers: int) -> list[float]:
    """Seconds from construction to each of the RAMP batches of a fresh iterator."""
    gc.collect()
    started = time.perf_counter()
    loader = make(name, dataset, workers, True)
    iterator = iter(loader)
    out = []
    for count in range(1, RAMP[-1] + 1):
        next(iterator)
        if count in RAMP:
            out.append(time.perf_counter() - started)
    del iterator
    close(loader)
    return out


def ramps(args: argparse.Namespace, datasets: dict[int, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, size, workers, _ in CASES:
        if workers > 4:
            continue
        runs: dict[str, list[list[float]]] = {name: [] for name in LOADERS}
        for _ in range(args.rounds):
            for name in LOADERS:
                runs[name].append(ramp(name, datasets[size], workers))
        rows.append({"case": label, **{
            name: [statistics.median(run[at] for run in values) for at in range(len(RAMP))]
            for name, values in runs.items()}})
        print(rows[-1], flush=True)
    return rows


def second_epoch(name: str, dataset: Any, workers: int) -> float:
    """Seconds from the second ``iter()`` (no persistent workers) to its first batch."""
    loader = make(name, dataset, workers, True)
    iterator = iter(loader)
    next(iterator)
    del iterator
    started = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    took = time.perf_counter() - started
    del iterator
    close(loader)
    return took


def interleaved(rounds: int, measure: Callable[[str], float]) -> dict[str, float]:
    """Median of ``rounds`` interleaved measures for each loader."""
    times: dict[str, list[float]] = {name: [] for name in LOADERS}
    for _ in range(rounds):
        for name in LOADERS:
            times[name].append(measure(name))
    return {name: statistics.median(values) for name, values in times.items()}


def first_batches(args: argparse.Namespace, datasets: dict[int, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, size, workers, shuffle in CASES:
        medians = interleaved(args.rounds, lambda name, size=size, workers=workers,
                              shuffle=shuffle: first_batch(name, datasets[size], workers,
                                                           shuffle))
        rows.append({"case": label, "size": size, "workers": workers, **medians})
        print(rows[-1], flush=True)
    return rows


def second_epochs(args: argparse.Namespace, datasets: dict[int, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, size, workers in (("small, 2 workers", SMALL, 2),
                                 ("1 M pairs, 4 workers", LARGE, 4)):
        medians = interleaved(args.rounds, lambda name, size=size, workers=workers:
                              second_epoch(name, datasets[size], workers))
        rows.append({"case": label, **medians})
        print(rows[-1], flush=True)
    return rows


def by_size(args: argparse.Namespace, datasets: dict[int, Any]) -> list[dict[str, Any]]:
    rows = []
    for size in SIZES:
        medians = interleaved(args.rounds, lambda name, size=size:
                              first_batch(name, datasets[size], 4, True))
        rows.append({"size": size, **medians})
        print(rows[-1], flush=True)
    return rows


def _cached_bytecode(cache: str) -> dict[str, str]:
    """The environment of a fresh interpreter with its bytecode cached as an installed
    package has it (in ``cache``: this environment may set PYTHONDONTWRITEBYTECODE, under
    which every import compiles the sources again); its first run writes the cache."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = cache
    return env


def _run(code: str, env: dict[str, str], *args: str) -> list[float]:
    """The numbers ``code`` prints, run in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                          text=True, check=True, env=env)
    return [float(word) for word in done.stdout.split()]


def imports(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of ``import numpy`` and ``import zloader``, each in a fresh
    interpreter (:func:`_cached_bytecode`)."""
    with tempfile.TemporaryDirectory(prefix="zloader-pyc-") as cache:
        env = _cached_bytecode(cache)

        def timed(module: str) -> float:
            return _run(f"import time; t = time.perf_counter(); import {module}; "
                        "print(time.perf_counter() - t)", env)[0]
        timed("numpy"), timed("zloader")  # (the bytecode written)
        numpy, ours = [], []
        for _ in range(max(args.rounds, 5)):
            numpy.append(timed("numpy"))
            ours.append(timed("zloader"))
    return {"numpy": statistics.median(numpy), "zloader": statistics.median(ours)}


FRESH = """
import sys, time
import torch
import torch.utils.data

class Pairs(torch.utils.data.Dataset):
    def __init__(self, size):
        self.samples = [(f"/data/train/class_{i % 1000:04d}/img_{i:08d}.jpg", i % 1000)
                        for i in range(size)]
    def __len__(self):
        return len(self.samples)
    def __getitem__(self, index):
        path, label = self.samples[index]
        return len(path), label

dataset = Pairs(int(sys.argv[2]))
started = time.perf_counter()
if sys.argv[1] == "zloader":
    from zloader.torch import DataLoader
else:
    from torch.utils.data import DataLoader
imported = time.perf_counter()
loader = DataLoader(dataset, batch_size=int(sys.argv[3]), shuffle=True, num_workers=2,
                    generator=torch.Generator().manual_seed(0), timeout=600)
iterator = iter(loader)
next(iterator)
print(imported - started, time.perf_counter() - imported)
"""


def fresh_process(args: argparse.Namespace) -> dict[str, Any]:
    """The small 2-worker case in a fresh interpreter (torch imported before the clock):
    median seconds of importing the loader's module, and of construction to first
    batch, for each loader, in interleaved rounds."""
    with tempfile.TemporaryDirectory(prefix="zloader-pyc-") as cache:
        env = _cached_bytecode(cache)
        for name in LOADERS:  # (the bytecode written)
            _run(FRESH, env, name, str(SMALL), str(BATCH))
        times: dict[str, list[list[float]]] = {name: [] for name in LOADERS}
        for _ in range(max(args.rounds, 5)):
            for name in LOADERS:
                times[name].append(_run(FRESH, env, name, str(SMALL), str(BATCH)))
    return {name: {"import": statistics.median(t[0] for t in values),
                   "first_batch": statistics.median(t[1] for t in values),
                   "both": statistics.median(t[0] + t[1] for t in values)}
            for name, values in times.items()}


def _double(value: int) -> int:
    return value * 2


def warm_pool(args: argparse.Namespace) -> dict[str, Any]:
    """A broker and 2 idle workers: a Loader's first element (a known pipeline and a new
    one) and a whole 200-element job, medians of ``--rounds``."""
    address = f"tcp://127.0.0.1:{free_port()}"
    bin_dir = os.path.dirname(sys.executable)
    processes = [subprocess.Popen([f"{bin_dir}/zloader-broker", "--bind", address,
                                   "--insecure", "--log-level", "warning"])]
    try:
        time.sleep(0.5)
        for _ in range(2):
            processes.append(subprocess.Popen(
                [f"{bin_dir}/zloader-worker", "--broker", address, "--insecure",
                 "--log-level", "warning"]))
        known = zloader.Pipeline.range(200).map(_double)

        def run(pipeline: zloader.Pipeline) -> tuple[float, float]:
            started = time.perf_counter()
            with zloader.Loader(pipeline, broker=address) as loader:
                elements = iter(loader)
                next(elements)
                first = time.perf_counter() - started
                count = 1 + sum(1 for _ in elements)
                whole = time.perf_counter() - started
            assert count == 200, count
            return first, whole
        deadline = time.monotonic() + 30
        while True:  # (the workers registered: a job runs)
            try:
                run(known)
                break
            except zloader.Timeout:
                if time.monotonic() > deadline:
                    raise
        known_first, known_whole, new_first = [], [], []
        for round_ in range(args.rounds):
            first, whole = run(known)
            known_first.append(first)
            known_whole.append(whole)
            fresh = zloader.Pipeline.range(200).map(_double).map(
                _double, name=f"double-{round_}-{time.time_ns()}", version=str(round_))
            new_first.append(run(fresh)[0])
        return {"known_first": statistics.median(known_first),
                "known_whole": statistics.median(known_whole),
                "new_first": statistics.median(new_first)}
    finally:
        stop(processes[::-1], 10)


def trainer_cpu(args: argparse.Namespace, datasets: dict[int, Any]) -> dict[str, Any]:
    """The trainer's process CPU per batch over one epoch of the 200 k case (2 workers,
    started before the clock: persistent workers, the second epoch measured)."""
    per_batch: dict[str, list[float]] = {name: [] for name in LOADERS}
    for _ in range(max(1, args.rounds // 2)):
        for name in LOADERS:
            loader = LOADERS[name](datasets[TUPLES], batch_size=BATCH, shuffle=True,
                                   num_workers=2, persistent_workers=True,
                                   generator=torch.Generator().manual_seed(0))
            for _ in loader:  # (the first epoch: start-up)
                pass
            cpu = time.process_time()
            batches = sum(1 for _ in loader)
            per_batch[name].append((time.process_time() - cpu) / batches)
            close(loader)
    return {name: statistics.median(values) for name, values in per_batch.items()}


def profile(datasets: dict[int, Any]) -> str:
    """The top of a cProfile of zloader's first batch, 1 M case: construction to the
    first batch only (not the close after it), by the time spent in each function."""
    first_batch("zloader", datasets[LARGE], 4, True)  # (warm)
    profiler = cProfile.Profile()
    profiler.enable()
    loader = make("zloader", datasets[LARGE], 4, True)
    iterator = iter(loader)
    next(iterator)
    profiler.disable()
    del iterator
    close(loader)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    return text.getvalue()


def plot(rows: list[dict[str, Any]], out: pathlib.Path) -> None:
    from bench.report import figure, save

    fig, (axis,) = figure(1)
    for name in LOADERS:
        axis.plot([r["size"] for r in rows], [r[name] for r in rows], "o-", label=name)
    axis.set_xscale("log")
    axis.set_xlabel("samples in the dataset")
    axis.set_ylabel("construction to first batch, s (4 workers)")
    axis.legend()
    save(fig, out, "startup.png", "first batch against dataset size")


def tables(data: dict[str, Any]) -> list[str]:
    lines = [f"# bench.startup ({data['date']}, {data['cpu_count']} CPUs, commit "
             f"{data['commit'][:10]})", ""]
    if "first_batch" in data:
        # the small case with as many workers: section 1's, or section 3's 10 k (4 workers)
        small = {row["workers"]: row for row in data["first_batch"] if row["size"] == SMALL}
        for row in data.get("by_size", []):
            if row["size"] == SIZES[0]:
                small.setdefault(4, row)
        lines += ["## (1) Construction to first batch (medians)", "",
                  "| case | torch | zloader | zloader / torch | zloader / small case, "
                  "same workers | torch / small case, same workers |",
                  "|---|---|---|---|---|---|"]
        for row in data["first_batch"]:
            base = small.get(row["workers"])
            grown = (f"{row['zloader'] / base['zloader']:.2f}x | "
                     f"{row['torch'] / base['torch']:.2f}x") \
                if base is not None and row["size"] != SMALL else " | "
            lines.append(f"| {row['case']} | {row['torch']:.3f} s | {row['zloader']:.3f} s | "
                         f"{row['zloader'] / row['torch']:.2f} | {grown} |")
        lines.append("")
    if "second_epoch" in data:
        lines += _against_torch("(2) Second epoch, no persistent workers: iter() to first "
                                "batch", "case", [(r["case"], r) for r in data["second_epoch"]])
    if "by_size" in data:
        lines += _against_torch("(3) First batch against dataset size (4 workers, shuffle)",
                                "samples", [(f"{r['size']:,}", r) for r in data["by_size"]])
    if "imports" in data:
        imp = data["imports"]
        lines += ["## (4) import time, fresh interpreter (medians)", "",
                  f"`import numpy` {imp['numpy'] * 1000:.0f} ms, `import zloader` "
                  f"{imp['zloader'] * 1000:.0f} ms: numpy + "
                  f"{(imp['zloader'] - imp['numpy']) * 1000:.0f} ms (target: + 100 ms)", ""]
    if "warm_pool" in data:
        warm = data["warm_pool"]
        lines += ["## (5) A warm pool (broker + 2 idle workers)", "",
                  "| figure | measured | target |", "|---|---|---|",
                  f"| first element, known pipeline | {warm['known_first'] * 1000:.1f} ms "
                  "| <= 50 ms |",
                  f"| first element, new pipeline | {warm['new_first'] * 1000:.1f} ms "
                  "| <= 100 ms |",
                  f"| whole 200-element job | {warm['known_whole'] * 1000:.1f} ms = "
                  f"{warm['known_whole'] / warm['known_first']:.1f}x its first element "
                  "| <= 2x |", ""]
    if "trainer_cpu" in data:
        cpu = data["trainer_cpu"]
        lines += ["## (6) Trainer's process CPU per batch, 200 k tuples, 2 workers", "",
                  f"torch {cpu['torch'] * 1e6:.0f} us, zloader {cpu['zloader'] * 1e6:.0f} us: "
                  f"{cpu['zloader'] / cpu['torch']:.2f}x (target <= 0.5x)", ""]
    if "profile" in data:
        lines += ["## (7) What is left of zloader's first batch (1 M case, cProfile, by own "
                  "time; the workers' start is the trainer's wait in `poll`/`acquire`)", "",
                  "```", *data["profile"].strip().splitlines()[:40], "```", ""]
    if "fresh" in data:
        fresh = data["fresh"]
        lines += ["## (8) A fresh process: small dataset, 2 workers, torch already imported "
                  "(medians)", "", "| figure | torch | zloader | zloader / torch |",
                  "|---|---|---|---|",
                  *(f"| {label} | {fresh['torch'][key] * 1000:.0f} ms | "
                    f"{fresh['zloader'][key] * 1000:.0f} ms | "
                    + (f"{fresh['zloader'][key] / fresh['torch'][key]:.2f} |"
                       if fresh['torch'][key] >= 1e-3 else "(torch's came with torch) |")
                    for label, key in (("import the loader's module", "import"),
                                       ("construction to first batch", "first_batch"),
                                       ("both", "both"))), ""]
    if "first_batch_cpu" in data:
        lines += ["## (9) The CPU of the first batch: every process, construction to the "
                  "first batch (medians)", "",
                  "| case | loader | first batch | trainer's CPU | workers' CPU | all the "
                  "CPU | all / cores | all / torch's all |", "|---|---|---|---|---|---|---|---|"]
        for row in data["first_batch_cpu"]:
            for name in LOADERS:
                cpu = row[name]
                lines.append(
                    f"| {row['case']} | {name} | {cpu['wall'] * 1000:.1f} ms | "
                    f"{cpu['trainer'] * 1000:.1f} ms | {cpu['workers'] * 1000:.1f} ms | "
                    f"{cpu['total'] * 1000:.1f} ms | "
                    f"{cpu['total'] / row['cores'] * 1000:.1f} ms | "
                    f"{cpu['total'] / row['torch']['total']:.2f} |")
        lines.append("")
    if "ramp" in data:
        lines += ["## (10) The first batches: construction to the n-th batch (medians)", "",
                  "| case | batch | torch | zloader | zloader / torch |", "|---|---|---|---|---|"]
        for row in data["ramp"]:
            for at, count in enumerate(RAMP):
                torch_s, zloader_s = row["torch"][at], row["zloader"][at]
                lines.append(f"| {row['case']} | {count} | {torch_s:.3f} s | "
                             f"{zloader_s:.3f} s | {zloader_s / torch_s:.2f} |")
        lines.append("")
    return lines


def _against_torch(title: str, what: str, rows: list[tuple[str, dict[str, float]]]
                   ) -> list[str]:
    """A table of seconds, torch's and zloader's, and their ratio, one row per label."""
    return [f"## {title}", "", f"| {what} | torch | zloader | zloader / torch |",
            "|---|---|---|---|",
            *(f"| {label} | {r['torch']:.3f} s | {r['zloader']:.3f} s | "
              f"{r['zloader'] / r['torch']:.2f} |" for label, r in rows), ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="1,2,3,4,5,6,7,8,9,10")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    sections = set(args.only.split(","))
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    datasets: dict[int, Any] = {}
    if sections & {"1", "2", "3", "6", "7", "9", "10"}:
        for size in sorted({SMALL, LARGE, LARGEST, TUPLES, *SIZES}):
            datasets[size] = Pairs(size)
    data: dict[str, Any] = {
        "batch_size": BATCH, "rounds": args.rounds,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "versions": {"torch": torch.__version__},
        **provenance()}
    if "4" in sections:
        data["imports"] = imports(args)
    if "8" in sections:
        data["fresh"] = fresh_process(args)
    if "5" in sections:
        data["warm_pool"] = warm_pool(args)
    if "1" in sections:
        data["first_batch"] = first_batches(args, datasets)
    if "2" in sections:
        data["second_epoch"] = second_epochs(args, datasets)
    if "3" in sections:
        data["by_size"] = by_size(args, datasets)
    if "6" in sections:
        data["trainer_cpu"] = trainer_cpu(args, datasets)
    if "7" in sections:
        data["profile"] = profile(datasets)
    if "9" in sections:
        data["first_batch_cpu"] = first_batch_cpus(args, datasets)
    if "10" in sections:
        data["ramp"] = ramps(args, datasets)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "by_size" in data:
        plot(data["by_size"], out)
    write_results(str(out), "startup", data, tables(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
