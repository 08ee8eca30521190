"""Mixing benchmark: ``Pipeline.mix`` against tf.data's ``sample_from_datasets``, and what
the mix costs over its inputs read alone.

Three inputs over files generated first (into a temporary folder, or ``--data-dir``), each
row ``{"text": 100 characters, "id": int, "input": "a" | "b" | "c"}``: input **a** is
200,000 rows in 4 Parquet files (row groups of 10,000: 20 splits), **b** 100,000 rows in 8
JSON lines files (8 splits), **c** 50,000 rows in 2 Parquet files (row groups of 5,000: 10
splits). The ``input`` field names the input a row came from, so the realised
proportions are counted from the elements themselves (no extra stage). Weights 0.6 / 0.3
/ 0.1, seed ``--seed``, every input repeated so that none runs out; each run takes
``--elements`` N elements (default 1,000,000). Side by side in one run:

- **tf.data in-process**: ``tf.data.Dataset.sample_from_datasets`` over three datasets that
  read the same files: TensorFlow has no Parquet or general JSON reader, so each is a
  ``from_generator`` that yields column batches of 1,024 rows (Parquet: pyarrow's
  ``iter_batches``, columns to numpy; JSON lines: ``json.loads`` of each line, as zloader
  does) and ``.unbatch()``, so that tf.data makes one element (a dict) per row in its own
  C++ code, then ``.repeat()``. One element at a time (``as_numpy_iterator``) over
  ``--tf-elements`` elements (tf.data's per-element iteration is slow: its rate, not a
  million elements, is the point), and in batches of ``--batch-size`` over N.
- **zloader in-process**: ``Pipeline.mix([a, b, c], [0.6, 0.3, 0.1], seed=...,
  stop="never").take(N).iter(0)``, one element at a time (the median of ``--rounds``
  rounds, see below), and ``mix.batch(256).take(...)`` in batches.
- **zloader Loader**: the same pipelines in ``zloader.Loader(..., num_workers=--workers)``
  (default 2), one element at a time and in batches; timed from the Loader's construction
  to its last element.
- **The mix's cost**: in-process, one element at a time, ``--rounds`` rounds (default 5)
  in alternating order of: the three inputs read alone one after another (``a.repeat()``
  for 0.6 N elements, then b for 0.3 N, then c for 0.1 N: the same elements without the
  mix), the mix of N, and a control: the same three inputs' iterators interleaved by a
  plain Python loop over numpy draws (what interleaving three streams costs without
  zloader's machinery). Medians of wall seconds, and of this process's CPU seconds (what
  it spent itself, beside the time it waited on a shared machine); the mix's over the
  inputs' alone.

Every consumer does the same per element: it notes the element's ``input`` (a byte per
element), from which the proportions after 10,000 and after N elements are computed.
Targets (the issue): zloader >= 1x tf.data in-process (each row against tf.data's row of
the same granularity); the mix <= 1.10x the inputs read alone; realised proportions
within 1% of the weights, read as within one percentage point (|realised - weight| <=
0.01, the test suite's reading; 10,000 draws of a 0.6 weight have a standard deviation of
0.5 points). The tf.data runs come last, so that the Loader's forked workers do not
inherit TensorFlow. At the end the run checks that no worker process, /dev/shm segment or
socket folder of its own is left behind.

Writes ``mix.json`` and ``mix.md`` (the tables, rendered by ``bench.report``) into
``--out``. These machines are shared and noisy: read the ratios. Run: ``python -m
bench.mix [--elements N] [--rounds R] [--tf-elements N] [--workers W] [--batch-size B]
[--seed S] [--data-dir DIR] [--out bench/results]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import os
import pathlib
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import psutil

from bench._common import provenance, version
from bench.report import mix_tables
from zloader import Loader, Pipeline

NAMES = ("a", "b", "c")
WEIGHTS = (0.6, 0.3, 0.1)
INPUTS = {  # name: (format, rows, files, rows per row group)
    "a": ("parquet", 200_000, 4, 10_000),
    "b": ("jsonl", 100_000, 8, None),
    "c": ("parquet", 50_000, 2, 5_000),
}
FIELDS = ("text", "id", "input")
CHECKPOINT = 10_000
"""The first point at which the realised proportions are taken (then after N)."""
TOLERANCE = 0.01
"""Realised proportion against weight, absolute: one percentage point."""
MIX_TARGET = 1.10
TF_CHUNK = 1024
"""Rows per batch the tf.data generators yield (unbatched by tf.data)."""
DRAW_CHUNK = 1024
"""Draws per numpy call in the by-hand control (as the mix draws)."""
CODE: dict[str | bytes, int] = {**{name: ord(name) for name in NAMES},
                                 **{name.encode(): ord(name) for name in NAMES}}
"""An element's ``input`` (zloader: str, tf.data: bytes) as the byte a consumer notes."""
WORDS = ("the", "a", "of", "data", "loader", "input", "mix", "weight", "pipeline", "parquet",
         "json", "lines", "worker", "broker", "shard", "split", "element", "batch", "tensor",
         "model", "train", "step", "epoch", "seed", "token")


# --- data -----------------------------------------------------------------------------------

def _text(rng: random.Random) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < 101:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:100]


def make_data(root: pathlib.Path) -> dict[str, list[str]]:
    """Write the three inputs' files into ``root`` (unless its manifest says they are
    there already); their paths by input."""
    manifest = root / "manifest.json"
    wanted = {name: list(spec) for name, spec in INPUTS.items()}
    if manifest.exists() and json.loads(manifest.read_text()).get("inputs") == wanted:
        return json.loads(manifest.read_text())["files"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    files: dict[str, list[str]] = {}
    for name, (kind, rows, count, group) in INPUTS.items():
        per_file = rows // count
        files[name] = []
        for f in range(count):
            ids = range(f * per_file, (f + 1) * per_file)
            texts = [_text(rng) for _ in ids]
            path = root / f"{name}-{f:02d}.{kind}"
            if kind == "parquet":
                pq.write_table(pa.table({"text": texts, "id": list(ids),
                                         "input": [name] * per_file}),
                               path, row_group_size=group)
            else:
                with open(path, "w") as stream:
                    for i, text in zip(ids, texts, strict=True):
                        stream.write(json.dumps({"text": text, "id": i, "input": name}) + "\n")
            files[name].append(str(path))
    manifest.write_text(json.dumps({"inputs": wanted, "files": files}))
    return files


def zloader_inputs(files: dict[str, list[str]]) -> list[Pipeline]:
    return [Pipeline.from_jsonl(files[name]) if INPUTS[name][0] == "jsonl"
            else Pipeline.from_parquet(files[name]) for name in NAMES]


def mixed(files: dict[str, list[str]], seed: int) -> Pipeline:
    return Pipeline.mix(zloader_inputs(files), list(WEIGHTS), seed=seed, stop="never")


# --- consumers: every run notes each element's input, one byte per element ---------------

def note_elements(elements: Iterable[Any]) -> bytearray:
    tags = bytearray()
    append = tags.append
    for element in elements:
        append(CODE[element["input"]])
    return tags


def _names(column: Any) -> bytes:
    """A batch's ``input`` column as one byte per element: tf.data gives a numpy array of
    bytes, zloader a list of str."""
    if isinstance(column, np.ndarray):
        return b"".join(column.tolist())
    return "".join(column).encode()


def note_batches(batches: Iterable[Any]) -> bytearray:
    tags = bytearray()
    for batch in batches:
        tags += _names(batch["input"])
    return tags


def timed(run: Callable[[], bytearray]) -> tuple[float, bytearray]:
    start = time.perf_counter()
    tags = run()
    return time.perf_counter() - start, tags


def proportions(tags: bytearray, total: int) -> dict[str, Any]:
    """The realised proportions after CHECKPOINT and after ``total`` elements (of those
    the run took), each with its largest distance from the weights."""
    out: dict[str, Any] = {}
    for point in sorted({min(CHECKPOINT, len(tags)), min(total, len(tags))}):
        head = tags[:point]
        shares = {name: head.count(ord(name)) / point for name in NAMES}
        worst = max(abs(shares[n] - w) for n, w in zip(NAMES, WEIGHTS, strict=True))
        out[str(point)] = {"shares": shares, "largest_difference": worst,
                           "within": worst <= TOLERANCE}
    return out


def run_record(name: str, system: str, granularity: str, seconds: float, tags: bytearray,
               total: int, **extra: Any) -> dict[str, Any]:
    record = {"name": name, "system": system, "granularity": granularity,
              "elements": len(tags), "seconds": seconds,
              "elements_per_s": len(tags) / seconds,
              "proportions": proportions(tags, total), **extra}
    print(f"{name}: {len(tags):,} elements in {seconds:.2f} s, "
          f"{len(tags) / seconds:,.0f} elements/s", flush=True)
    return record


# --- the mix's cost in-process, and the zloader in-process element run ----------------------

def counts_of(total: int) -> list[int]:
    """Elements of each input read alone: the weights' shares of ``total``."""
    counts = [round(w * total) for w in WEIGHTS[:-1]]
    return [*counts, total - sum(counts)]


def read_alone(files: dict[str, list[str]], total: int) -> bytearray:
    tags = bytearray()
    for pipeline, count in zip(zloader_inputs(files), counts_of(total), strict=True):
        tags += note_elements(pipeline.repeat().take(count).iter(0))
    return tags


def read_mixed(files: dict[str, list[str]], total: int, seed: int) -> bytearray:
    return note_elements(mixed(files, seed).take(total).iter(0))


def by_hand(files: dict[str, list[str]], total: int, seed: int) -> bytearray:
    """The control: the inputs' own iterators interleaved by numpy draws in plain Python."""
    streams = [pipeline.repeat().iter(0) for pipeline in zloader_inputs(files)]
    rng = np.random.default_rng(seed)

    def elements() -> Iterator[Any]:
        left = total
        while left:
            draws = rng.choice(len(streams), size=min(left, DRAW_CHUNK), p=WEIGHTS)
            for which in draws.tolist():
                yield next(streams[which])
            left -= len(draws)
    return note_elements(elements())


def mix_cost(files: dict[str, list[str]], total: int, seed: int,
             rounds: int) -> tuple[dict[str, Any], bytearray]:
    """``rounds`` rounds of the inputs alone, the mix and the control, in alternating
    order; their seconds (wall, and this process's CPU), and the first round's mixed
    tags."""
    runs: dict[str, Callable[[], bytearray]] = {
        "alone": lambda: read_alone(files, total),
        "mix": lambda: read_mixed(files, total, seed),
        "by_hand": lambda: by_hand(files, total, seed),
    }
    seconds: dict[str, list[float]] = {key: [] for key in runs}
    cpu: dict[str, list[float]] = {key: [] for key in runs}
    first: bytearray | None = None
    same = True
    for round_ in range(rounds):
        order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
        for key in order:
            cpu_start = time.process_time()
            took, tags = timed(runs[key])
            cpu[key].append(time.process_time() - cpu_start)
            seconds[key].append(took)
            if len(tags) != total:
                raise RuntimeError(f"{key} read {len(tags)} elements, not {total}")
            if key == "mix":
                same = same and (first is None or tags == first)
                first = tags if first is None else first
        print(f"round {round_ + 1}/{rounds}: " + ", ".join(
            f"{key} {seconds[key][-1]:.2f} s (CPU {cpu[key][-1]:.2f} s)" for key in runs),
            flush=True)
    assert first is not None
    medians = {key: statistics.median(values) for key, values in seconds.items()}
    cpu_medians = {key: statistics.median(values) for key, values in cpu.items()}
    ratio, cpu_ratio = (medians["mix"] / medians["alone"],
                        cpu_medians["mix"] / cpu_medians["alone"])
    return {"rounds": rounds, "seconds": seconds, "median_s": medians,
            "cpu_seconds": cpu, "median_cpu_s": cpu_medians,
            "ratio": ratio, "by_hand_ratio": medians["by_hand"] / medians["alone"],
            "cpu_ratio": cpu_ratio,
            "by_hand_cpu_ratio": cpu_medians["by_hand"] / cpu_medians["alone"],
            "target": MIX_TARGET, "holds": ratio <= MIX_TARGET,
            "cpu_holds": cpu_ratio <= MIX_TARGET, "same_draws_each_round": same}, first


# --- zloader: batches in-process, and Loaders -----------------------------------------------

def loader_run(pipeline: Pipeline, workers: int, batched: bool,
               pids: set[int]) -> tuple[float, float, bytearray, dict[str, Any]]:
    """(seconds from construction to the last element, to the first, tags, stats)."""
    start = time.perf_counter()
    first = 0.0
    with Loader(pipeline, num_workers=workers, timeout=120) as loader:
        pids.update(process.pid for process in loader._processes)
        iterator = iter(loader)
        tags = bytearray()
        for item in iterator:
            first = time.perf_counter() - start
            tags += _names(item["input"]) if batched else bytes((CODE[item["input"]],))
            break
        tags += note_batches(iterator) if batched else note_elements(iterator)
        seconds = time.perf_counter() - start
        stats = loader.stats()
    return seconds, first, tags, {"stage_seconds": stats.get("stage_seconds"),
                                  "per_worker": list(stats.get("per_worker", {}).values())}


# --- tf.data --------------------------------------------------------------------------------

def tf_mix(files: dict[str, list[str]], seed: int) -> Any:
    """``sample_from_datasets`` over the three inputs read by tf.data, each repeated."""
    import tensorflow as tf

    spec = {"text": tf.TensorSpec((None,), tf.string), "id": tf.TensorSpec((None,), tf.int64),
            "input": tf.TensorSpec((None,), tf.string)}

    def parquet(paths: list[str]) -> Callable[[], Iterator[dict[str, Any]]]:
        def rows() -> Iterator[dict[str, Any]]:
            import pyarrow.parquet as pq

            for path in paths:
                for batch in pq.ParquetFile(path).iter_batches(batch_size=TF_CHUNK):
                    yield {field: batch.column(field).to_numpy(zero_copy_only=False)
                           for field in FIELDS}
        return rows

    def jsonl(paths: list[str]) -> Callable[[], Iterator[dict[str, Any]]]:
        def rows() -> Iterator[dict[str, Any]]:
            for path in paths:
                with open(path, "rb") as stream:
                    while lines := list(itertools.islice(stream, TF_CHUNK)):
                        values = [json.loads(line) for line in lines]
                        yield {field: [value[field] for value in values] for field in FIELDS}
        return rows

    datasets = [tf.data.Dataset.from_generator(
        (jsonl if INPUTS[name][0] == "jsonl" else parquet)(files[name]),
        output_signature=spec).unbatch().repeat() for name in NAMES]
    return tf.data.Dataset.sample_from_datasets(datasets, weights=list(WEIGHTS), seed=seed)


# --- what is left behind --------------------------------------------------------------------

def left_behind(pids: set[int]) -> dict[str, list[Any]]:
    """This process's children still there, and /dev/shm segments and socket folders of
    this process or its workers (named ``zloader-<uid>-<pid>-...`` and
    ``zloader-<pid>-...``)."""
    children = [f"{child.pid} ({child.status()})"
                for child in psutil.Process().children(recursive=True)
                if child.is_running()]
    owners = {str(pid) for pid in pids}
    shm = []
    with contextlib.suppress(OSError):
        shm = [name for name in os.listdir("/dev/shm") if name.startswith("zloader-")
               and len(name.split("-")) > 2 and name.split("-")[2] in owners]
    sockets = [name for name in os.listdir(tempfile.gettempdir())
               if name.startswith("zloader-") and name.split("-")[1] in owners]
    return {"processes": children, "shm_segments": shm, "socket_dirs": sockets}


# --- main -----------------------------------------------------------------------------------

def measure(args: argparse.Namespace, files: dict[str, list[str]]) -> dict[str, Any]:
    total, seed, batch, workers = args.elements, args.seed, args.batch_size, args.workers
    batches = math.ceil(total / batch)
    pids = {os.getpid()}
    runs: list[dict[str, Any]] = []

    cost, mixed_tags = mix_cost(files, total, seed, args.rounds)
    runs.append(run_record("zloader in-process", "zloader", "element",
                           cost["median_s"]["mix"], mixed_tags, total,
                           note=f"median of {args.rounds} rounds"))
    seconds, tags = timed(lambda: note_batches(
        mixed(files, seed).batch(batch).take(batches).iter(0)))
    runs.append(run_record(f"zloader in-process, batches of {batch}", "zloader", "batch",
                           seconds, tags, total,
                           same_draws_as_elements=tags[:total] == mixed_tags))
    for batched in (False, True):
        pipeline = (mixed(files, seed).batch(batch).take(batches) if batched
                    else mixed(files, seed).take(total))
        seconds, first, tags, stats = loader_run(pipeline, workers, batched, pids)
        runs.append(run_record(
            f"zloader Loader, {workers} workers" + (f", batches of {batch}" if batched else ""),
            "zloader", "batch" if batched else "element", seconds, tags, total,
            workers=workers, first_element_s=first, **stats,
            note=f"first element {first:.2f} s after construction"))

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    seconds, tf_tags = timed(lambda: note_batches(
        tf_mix(files, seed).take(total).batch(batch).as_numpy_iterator()))
    runs.append(run_record(f"tf.data in-process, batches of {batch}", "tf.data", "batch",
                           seconds, tf_tags, total))
    single = min(total, args.tf_elements)
    seconds, tags = timed(lambda: note_elements(
        tf_mix(files, seed).take(single).as_numpy_iterator()))
    runs.append(run_record("tf.data in-process", "tf.data", "element", seconds, tags, total,
                           same_draws_as_batches=tags == tf_tags[:single],
                           note=f"{single:,} elements (--tf-elements): its rate is the point"))

    reference = {run["granularity"]: run["elements_per_s"] for run in runs
                 if run["system"] == "tf.data"}
    for run in runs:
        if run["system"] == "zloader":
            run["vs_tf"] = run["elements_per_s"] / reference[run["granularity"]]
    order = {"element": 0, "batch": 1}
    runs.sort(key=lambda run: (order[run["granularity"]], run["system"] != "tf.data"))
    splits = {name: pipeline.source.num_splits
              for name, pipeline in zip(NAMES, zloader_inputs(files), strict=True)}
    return {"runs": runs, "mix_cost": cost, "splits": splits, "left_behind": left_behind(pids)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=1_000_000,
                        help="elements each run takes (default 1,000,000)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the in-process mix's cost (median; default 5)")
    parser.add_argument("--tf-elements", type=int, default=20_000,
                        help="elements tf.data yields one at a time (default 20,000)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--data-dir", help="where the data files go (and are reused from); "
                                           "default: a temporary folder")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if args.elements < 1 or args.rounds < 1 or args.tf_elements < 1:
        parser.error("--elements, --rounds and --tf-elements must be at least 1")
    with contextlib.ExitStack() as stack:
        root = pathlib.Path(args.data_dir) if args.data_dir else pathlib.Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-mix-")))
        started = time.perf_counter()
        files = make_data(root)
        print(f"data ready in {time.perf_counter() - started:.1f} s in {root}", flush=True)
        data = measure(args, files)
    data = {
        "benchmark": "mix", "elements": args.elements, "weights": list(WEIGHTS),
        "seed": args.seed, "workers": args.workers, "batch_size": args.batch_size,
        "tf_elements": min(args.elements, args.tf_elements), "tolerance": TOLERANCE,
        "inputs": {name: {"format": kind, "rows": rows, "files": count,
                          "splits": data["splits"][name]}
                   for name, (kind, rows, count, _) in INPUTS.items()},
        **{key: value for key, value in data.items() if key != "splits"},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {name: version(name) for name in ("tensorflow", "pyarrow", "numpy")},
        **provenance()}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mix.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = mix_tables(data)
    (out / "mix.md").write_text(
        f"Mixing benchmark (bench/mix.py), nproc {os.cpu_count()}, {args.elements:,} "
        f"elements a run, {args.workers} workers, batches of {args.batch_size}, zloader at "
        f"{data['commit'][:12]}.\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
