"""File-format sources against the formats' own readers, side by side in one run.

* TFRecord records/s: zloader ``from_tfrecord`` (in-process, and a Loader with workers)
  against ``tf.data.TFRecordDataset`` (in-process, and with ``num_parallel_reads``).
* WebDataset samples/s: zloader ``from_webdataset`` in a Loader against ``webdataset`` in a
  torch ``DataLoader``, at equal workers.
* Parquet rows/s: zloader ``from_parquet(batch_rows=...)`` against pyarrow's own batch
  reader (``ParquetFile.iter_batches``), both in-process.
* Object storage: JSON lines files in a local S3 server (moto) that answers each request
  after an injected latency; ``parallel_reads=8`` against 1, one reading thread.
* Cache: a decode-heavy prefix (decode a JPEG and resize it, bench/_images.py's files)
  then ``.cache()``, through a Loader: the first epoch (computing and writing the cache)
  against the second (reading it), and an uncached epoch for reference.

The data is generated into a temporary folder first. These machines are shared and noisy:
read the ratios, not the absolute rates. Targets (issue 19): >= the reference reader at
equal CPU on each format; >= 5x from parallel_reads=8 when latency-bound; a cached second
epoch >= 5x the first for a decode-heavy prefix.

Run: ``python -m bench.sources [--scale S] [--workers W] [--latency SECONDS] [--out DIR]
[--only SECTION ...]``; with ``--only`` the sections run are merged into the results
already in ``--out`` (the others are kept as they were measured).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from bench._common import free_port, provenance, stop, version
from zloader import Loader, Pipeline

SLOWER = 0.1
"""A second, longer latency for the S3 run (seconds per request)."""


def rate(count_items: Callable[[], int]) -> tuple[float, int]:
    """(items per second, items) of one full run of ``count_items``."""
    start = time.perf_counter()
    items = count_items()
    return items / (time.perf_counter() - start), items


def count(iterable: Iterable[Any], size: Callable[[Any], int] = lambda _: 1) -> int:
    return sum(size(item) for item in iterable)


def make_tfrecords(root: pathlib.Path, files: int, per_file: int) -> str:
    import tensorflow as tf

    rng = np.random.default_rng(0)
    for f in range(files):
        with tf.io.TFRecordWriter(str(root / f"train-{f:03d}.tfrecord")) as writer:
            for i in range(per_file):
                feature = {
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                        value=[rng.bytes(512)])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 10])),
                }
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature=feature)).SerializeToString())
    return str(root / "train-*.tfrecord")


def bench_tfrecord(root: pathlib.Path, scale: int, workers: int) -> dict[str, float]:
    import tensorflow as tf

    pattern = make_tfrecords(root, 8, 2500 * scale)
    paths = sorted(str(p) for p in root.glob("train-*.tfrecord"))
    out = {
        "zloader in-process": rate(lambda: count(Pipeline.from_tfrecord(pattern)))[0],
        f"zloader Loader ({workers} workers)": rate(lambda: _loader_count(
            Pipeline.from_tfrecord(pattern).batch(256), workers, len))[0],
        "tf.data in-process": rate(lambda: count(
            tf.data.TFRecordDataset(paths).batch(256).as_numpy_iterator(), len))[0],
        f"tf.data num_parallel_reads={workers}": rate(lambda: count(
            tf.data.TFRecordDataset(paths, num_parallel_reads=workers).batch(256)
            .as_numpy_iterator(), len))[0],
    }
    return out


def _loader_count(pipeline: Pipeline, workers: int,
                  size: Callable[[Any], int] = lambda _: 1) -> int:
    with Loader(pipeline, num_workers=workers, timeout=120) as loader:
        return count(loader, size)


def bench_webdataset(root: pathlib.Path, scale: int, workers: int) -> dict[str, float]:
    import torch
    import webdataset as wds

    rng = np.random.default_rng(1)
    with wds.ShardWriter(str(root / "shard-%04d.tar"), maxcount=500 * scale,
                         encoder=False, verbose=0) as writer:
        for i in range(4000 * scale):
            writer.write({"__key__": f"s{i:07d}", "jpg": rng.bytes(4096),
                          "cls": str(i % 10).encode()})
    shards = sorted(str(p) for p in root.glob("shard-*.tar"))
    reference = wds.WebDataset(shards, shardshuffle=False, nodesplitter=wds.split_by_node,
                               workersplitter=wds.split_by_worker, empty_check=False)
    return {
        f"zloader Loader ({workers} workers)": rate(lambda: _loader_count(
            Pipeline.from_webdataset(shards), workers))[0],
        f"webdataset + torch DataLoader ({workers} workers)": rate(lambda: count(
            torch.utils.data.DataLoader(reference, batch_size=None,
                                        num_workers=workers)))[0],
    }


def bench_parquet(root: pathlib.Path, scale: int) -> dict[str, float]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 200_000 * scale
    table = pa.table({"id": np.arange(rows), "x": np.random.default_rng(2).random(rows),
                      "text": [f"row {i}" for i in range(rows)]})
    path = root / "table.parquet"
    pq.write_table(table, path, row_group_size=rows // 8)

    def pyarrow_batches() -> int:
        return count(pq.ParquetFile(path).iter_batches(batch_size=4096),
                     lambda b: b.num_rows)

    return {
        "zloader batch_rows=4096 in-process": rate(lambda: count(
            Pipeline.from_parquet([path], batch_rows=4096), lambda b: len(b["id"])))[0],
        "pyarrow iter_batches(4096) + to_numpy": rate(lambda: count(
            (_numpy(b) for b in pq.ParquetFile(path).iter_batches(batch_size=4096)),
            lambda b: len(b["id"])))[0],
        "pyarrow iter_batches(4096), arrow only": rate(pyarrow_batches)[0],
        "zloader rows in-process": rate(lambda: count(Pipeline.from_parquet([path])))[0],
        "pyarrow to_pylist rows": rate(lambda: count(
            row for b in pq.ParquetFile(path).iter_batches() for row in b.to_pylist()))[0],
    }


def _numpy(batch: Any) -> dict[str, Any]:
    return {"id": batch.column(0).to_numpy(), "x": batch.column(1).to_numpy(),
            "text": batch.column(2).to_pylist()}


SERVE = """
import logging, sys, time
from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server
logging.getLogger("werkzeug").setLevel(logging.ERROR)
app = DomainDispatcherApplication(create_backend_app)
latency = float(sys.argv[2])
def slow(environ, start_response):
    time.sleep(latency)
    return app(environ, start_response)
make_server("127.0.0.1", int(sys.argv[1]), slow, threaded=True).serve_forever()
"""


class SlowS3:
    """moto's S3 app, in a process of its own, behind a WSGI layer that waits ``latency``
    seconds before it answers each request."""

    def __init__(self, latency: float) -> None:
        import socket
        import subprocess
        import sys

        self.port = free_port()
        self.process = subprocess.Popen([sys.executable, "-c", SERVE, str(self.port),
                                         str(latency)])
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.close()
                    raise RuntimeError("the S3 server did not start") from None
                time.sleep(0.1)
        self.options = {"key": "bench", "secret": "bench", "client_kwargs": {
            "endpoint_url": f"http://127.0.0.1:{self.port}", "region_name": "us-east-1"}}

    def close(self) -> None:
        stop([self.process], 10)


def bench_s3(latency: float, scale: int) -> dict[str, float]:
    import boto3

    server = SlowS3(latency)
    try:
        client = boto3.client("s3", endpoint_url=server.options["client_kwargs"]["endpoint_url"],
                              region_name="us-east-1", aws_access_key_id="bench",
                              aws_secret_access_key="bench")
        client.create_bucket(Bucket="bench")
        files = 64 * scale
        for f in range(files):
            body = "".join(json.dumps({"f": f, "i": i}) + "\n" for i in range(50))
            client.put_object(Bucket="bench", Key=f"rows/{f:04d}.jsonl", Body=body.encode())
        out = {}
        for k in (1, 8):
            pipeline = Pipeline.from_jsonl("s3://bench/rows/*.jsonl",
                                           storage_options=server.options, parallel_reads=k)
            out[f"parallel_reads={k}"] = rate(lambda p=pipeline: count(p))[0]
        return out
    finally:
        server.close()


CACHE_IMAGE = 224
"""The side the cache benchmark's prefix resizes each decoded JPEG to."""


def decode_resized(path: str) -> np.ndarray:
    """The decode-heavy prefix: read a JPEG, decode it, resize it to 224x224 (HWC uint8)."""
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB").resize((CACHE_IMAGE, CACHE_IMAGE)))


def bench_cache(root: pathlib.Path, scale: int, workers: int,
                rounds: int = 3) -> dict[str, float]:
    """Epoch 1 of a cached decode prefix (computes and writes), epoch 2 (reads the cache),
    and an epoch of the same pipeline without the cache, each through a Loader; the median
    of ``rounds`` rounds, each with a fresh cache folder (the machine is shared: one slow
    moment should not make a ratio)."""
    import statistics

    from bench._images import write_jpegs

    folder = root / "jpegs"
    folder.mkdir()
    paths = write_jpegs(folder, 128) * 4 * scale  # 512 decodes per epoch at scale 1
    source = Pipeline.from_items(paths, split_size=16)
    names = ("epoch 1: compute and write the cache", "epoch 2: read the cache",
             "no cache, an epoch")
    measured: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        cached = source.map(decode_resized).cache(root / f"cache-{round_}").batch(32)
        with Loader(cached, num_workers=workers, timeout=300) as loader:
            for name in names[:2]:
                measured[name].append(rate(lambda: count(loader, len))[0])
        with Loader(source.map(decode_resized).batch(32), num_workers=workers,
                    timeout=300) as loader:
            measured[names[2]].append(rate(lambda: count(loader, len))[0])
    return {name: statistics.median(values) for name, values in measured.items()}


def cache_ratio(rates: dict[str, float]) -> float:
    """The cached second epoch's rate over the first's."""
    first, second = list(rates.values())[:2]
    return second / first


def table(title: str, rates: dict[str, float], unit: str) -> list[str]:
    best = max(rates.values())
    lines = [f"### {title}", "", f"| reader | {unit}/s | vs best |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {value:,.0f} | {value / best:.2f} |" for name, value in rates.items()]
    return [*lines, ""]


SECTIONS = ("tfrecord", "webdataset", "parquet", "s3", "s3 slower", "cache")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="multiply the data sizes")
    parser.add_argument("--workers", type=int, default=2, help="workers of each loader")
    parser.add_argument("--latency", type=float, default=0.02,
                        help="seconds the S3 server waits per request")
    parser.add_argument("--out", default="bench/results", help="where to write results")
    parser.add_argument("--only", action="append", choices=SECTIONS, metavar="SECTION",
                        help=f"run only this section (repeat for more: {', '.join(SECTIONS)})"
                             " and merge it into the results already in --out")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    record: dict[str, Any] = {}
    if args.only and (out / "sources.json").exists():
        record = json.loads((out / "sources.json").read_text())
    results: dict[str, Any] = record.get("results", {})
    with tempfile.TemporaryDirectory() as folder:
        root = pathlib.Path(folder)
        runs: dict[str, Callable[[], dict[str, float]]] = {
            "tfrecord": lambda: bench_tfrecord(root, args.scale, args.workers),
            "webdataset": lambda: bench_webdataset(root, args.scale, args.workers),
            "parquet": lambda: bench_parquet(root, args.scale),
            "s3": lambda: bench_s3(args.latency, args.scale),
            "s3 slower": lambda: bench_s3(SLOWER, args.scale),
            "cache": lambda: bench_cache(root, args.scale, args.workers),
        }
        for name in args.only or SECTIONS:
            results[name] = runs[name]()
            print(name, json.dumps(results[name], indent=1), flush=True)
    run = {"args": vars(args), "machine": {"cpus": os.cpu_count(),
                                           "python": platform.python_version()},
           "versions": {p: version(p) for p in ("tensorflow", "webdataset", "pyarrow",
                                                "torch", "fsspec", "s3fs", "moto", "pillow")},
           **provenance()}
    if args.only and record:  # the other sections keep the run that measured them
        merged = record.setdefault("merged", {})
        for name in args.only:
            merged[name] = run
    else:
        record = {"benchmark": "sources", **run}
    record["results"] = results
    if "s3" in results:
        record["s3_speedup_8_vs_1"] = results["s3"]["parallel_reads=8"] / \
            results["s3"]["parallel_reads=1"]
    if "cache" in results:
        record["cache_speedup_epoch2_vs_epoch1"] = cache_ratio(results["cache"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "sources.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = markdown(record)
    (out / "sources.md").write_text("\n".join(lines))
    print("\n".join(lines))


def markdown(record: dict[str, Any]) -> list[str]:
    """sources.md from the record: each section measured, with how it was run."""
    args, results = record["args"], record["results"]
    lines = ["# File-format sources against their own readers", "",
             f"`python -m bench.sources --scale {args['scale']} --workers {args['workers']} "
             f"--latency {args['latency']}` on {record['machine']['cpus']} CPUs (shared, "
             "noisy: read the ratios).", ""]
    for name, title, unit in [("tfrecord", "TFRecord", "records"),
                              ("webdataset", "WebDataset", "samples"),
                              ("parquet", "Parquet", "rows")]:
        if name in results:
            lines += table(title, results[name], unit)
    if "s3" in results and "s3 slower" in results:
        s3, slower = results["s3"], results["s3 slower"]
        latency = args["latency"] * 1000
        lines += table(f"S3 with {latency:.0f} ms per request, one thread", s3, "rows")
        lines += table(f"S3 with {SLOWER * 1000:.0f} ms per request, one thread", slower,
                       "rows")
        lines += [f"parallel_reads=8 against 1: {record['s3_speedup_8_vs_1']:.1f}x at "
                  f"{latency:.0f} ms, "
                  f"{slower['parallel_reads=8'] / slower['parallel_reads=1']:.1f}x at "
                  f"{SLOWER * 1000:.0f} ms (target >= 5x when latency-bound). moto spends "
                  "some milliseconds of CPU on each request, in one process: with 8 reads "
                  "in flight on a small shared machine the server's CPU, not the latency, "
                  "bounds the short-latency run.", ""]
    if "cache" in results:
        run = record.get("merged", {}).get("cache", record)
        cache_args = run["args"]
        lines += table(f"Cache: decode and resize JPEGs, then .cache(), a Loader with "
                       f"{cache_args['workers']} workers", results["cache"], "images")
        lines += [f"Measured by `python -m bench.sources --only cache --workers "
                  f"{cache_args['workers']} --scale {cache_args['scale']}` on "
                  f"{run['machine']['cpus']} CPUs, the median of 3 rounds (each with a "
                  "fresh cache). The cached second epoch reads "
                  f"{record['cache_speedup_epoch2_vs_epoch1']:.1f}x as fast as the first, "
                  "which decodes and writes (target >= 5x for a decode-heavy prefix); the "
                  "uncached epoch shows what writing the cache costs the first.", ""]
    return lines

if __name__ == "__main__":
    main()
