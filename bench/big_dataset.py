"""An ImageNet-sized map-style dataset: construction to first batch, and a host's fetches.

A torchvision ``ImageFolder`` keeps ``samples``, a list of 1.28 M ``(path, class)``
tuples: its pickled form is about 67 MiB. This benchmark builds such a dataset in memory
(``__getitem__`` returns a small array, no file is read) and times, from the loader's
construction to its first batch of 256, side by side in one run:

* ``torch``: ``torch.utils.data.DataLoader(num_workers=2, shuffle=True)``;
* ``zloader.torch``: ``zloader.torch.DataLoader``, same arguments (forked workers that
  inherit the dataset, as torch's do);
* ``Loader embedded``: ``Loader(Pipeline.from_torch(ds).batch(256), num_workers=2)``
  (fingerprints the dataset; workers inherit it);
* ``Loader + broker``: the same Loader through ``zloader-broker`` and one
  ``zloader-worker --processes 2`` (the pipeline is pickled, served by the Loader, fetched
  once by the host: the ``fetches`` column).

Each system runs ``--repeat`` times (the median is reported) and the ratio to torch is
given; these machines are shared and noisy: read the ratios. Run:
``python -m bench.big_dataset [--repeat 3] [--out bench/results]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.utils.data

import zloader.torch as zt
from bench._common import free_port, provenance, stop
from zloader import Loader, Pipeline

SIZE = 1_281_167
BATCH = 256


class Folder(torch.utils.data.Dataset):  # type: ignore[misc]
    """What ``ImageFolder`` holds: ``samples``, a (path, class) per image."""

    def __init__(self, size: int = SIZE) -> None:
        self.samples = [(f"/data/imagenet/train/n{i % 1000:08d}/{i:08d}.JPEG", i % 1000)
                        for i in range(size)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        path, label = self.samples[index]
        return np.frombuffer(path[-13:-5].encode(), np.uint8).copy(), label


def first_batch(system: str, dataset: Folder, broker: str | None) -> dict[str, Any]:
    """Seconds from constructing ``system``'s loader to holding its first batch."""
    start = time.perf_counter()
    fetches = None
    if system == "torch":
        loader: Any = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=2,
                                                  shuffle=True)
        iterator = iter(loader)
        next(iterator)
        seconds = time.perf_counter() - start
        del iterator
    elif system == "zloader.torch":
        loader = zt.DataLoader(dataset, batch_size=BATCH, num_workers=2, shuffle=True)
        iterator = iter(loader)
        next(iterator)
        seconds = time.perf_counter() - start
        del iterator
        loader.close()
    else:
        pipeline = Pipeline.from_torch(dataset, split_size=4096).batch(BATCH)
        options: dict[str, Any] = ({"num_workers": 2} if broker is None
                                   else {"broker": broker})
        with Loader(pipeline, **options) as zloader_loader:
            next(iter(zloader_loader))
            seconds = time.perf_counter() - start
            fetches = zloader_loader.stats()["served"].get("pipeline", 0)
    return {"seconds": seconds, "fetches": fetches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--size", type=int, default=SIZE)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    made = time.perf_counter()
    dataset = Folder(args.size)
    made = time.perf_counter() - made
    port = free_port()
    broker = f"tcp://127.0.0.1:{port}"
    bin_dir = os.path.dirname(sys.executable)
    services = [subprocess.Popen([os.path.join(bin_dir, "zloader-broker"), "--bind", broker,
                                  "--log-level", "error"]),
                subprocess.Popen([os.path.join(bin_dir, "zloader-worker"), "--broker",
                                  broker, "--processes", "2", "--log-level", "error"])]
    systems = {"torch": None, "zloader.torch": None, "Loader embedded": None,
               "Loader + broker": broker}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    try:
        time.sleep(2.0)  # the workers register
        for _ in range(args.repeat):  # interleaved, so that noise hits every system alike
            for name, address in systems.items():
                runs[name].append(first_batch(name, dataset, address))
    finally:
        stop(services, 10.0)
    median = {name: statistics.median(r["seconds"] for r in results)
              for name, results in runs.items()}
    rows = ["| loader | construction to first batch (s, median) | vs torch | pipeline "
            "fetches per construction |", "|---|---|---|---|"]
    for name, seconds in median.items():
        fetches = [r["fetches"] for r in runs[name] if r["fetches"] is not None]
        rows.append(f"| {name} | {seconds:.2f} | {seconds / median['torch']:.1f}x | "
                    f"{max(fetches) if fetches else '-'} |")
    table = "\n".join(rows)
    print(f"dataset of {args.size:,} samples built in {made:.1f} s\n{table}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "big_dataset.json").write_text(json.dumps({
        "size": args.size, "repeat": args.repeat, "runs": runs, "median_seconds": median,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "versions": {"torch": torch.__version__},
        **provenance()}, indent=2))
    (out / "big_dataset.md").write_text(
        f"# Construction to first batch, {args.size:,}-sample map-style dataset\n\n"
        f"`python -m bench.big_dataset` (median of {args.repeat}; ratio to torch's "
        f"DataLoader, lower is better)\n\n{table}\n")


if __name__ == "__main__":
    main()
