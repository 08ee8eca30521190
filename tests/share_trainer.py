"""A trainer process for the sharing tests: reads a shared job, one JSON line per epoch.

    python tests/share_trainer.py BROKER N VARIANT EPOCHS [--delay S] [--lag L]
        [--window BYTES] [--block S] [--log PATH] [--workers-deterministic]
        [--suffix NAME] [--barrier DIR:N]

Each element's first value is its index in the epoch's source; every call of the
pipeline's map function appends one byte to ``--log`` (to count how often it ran).
``--suffix`` adds stages of this trainer's own after that map (:data:`SUFFIXES`: trainers
with other suffixes share the map's run); the indices of a batch's rows are reported
one by one. ``--barrier DIR:N``: once its Loader has registered, wait until N trainers'
have (a file each in DIR) before reading: all start the epoch together. Prints
``{"progress": k}`` after every 10 elements and ``{"epoch": e, "got": [...], "stats": {...}}``
after each epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from zloader import Loader, Pipeline


def make(n: int, variant: int, log: str | None) -> Pipeline:
    def element(x: int) -> np.ndarray:
        if log:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(fd, b".")
            os.close(fd)
        out = np.full(4096, variant, dtype=np.int64)  # 32 KiB
        out[0] = x
        return out

    return Pipeline.range(n, split_size=10, shuffle_splits=True, seed=7).map(element)


def brighter(a: np.ndarray) -> np.ndarray:
    out = a.copy()
    out[1:] += 1
    return out


def even(a: np.ndarray) -> bool:
    return int(a[0]) % 2 == 0


SUFFIXES = {
    "": lambda p: p,
    "batch10": lambda p: p.batch(10),
    "shuffle_batch25": lambda p: p.shuffle(64, seed=7).batch(25),
    "augment_batch4": lambda p: p.map(brighter).batch(4),
    "even": lambda p: p.filter(even),
}
"""A trainer's own stages after the shared map, by ``--suffix``."""


def indices(element: np.ndarray) -> list[int]:
    """The source indices of an element, or of a batch's rows."""
    return [int(element[0])] if element.ndim == 1 else [int(i) for i in element[:, 0]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("broker")
    parser.add_argument("n", type=int)
    parser.add_argument("variant", type=int)
    parser.add_argument("epochs", type=int)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--lag", default="block")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--block", type=float, default=10.0)
    parser.add_argument("--log", default=None)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--suffix", default="", choices=sorted(SUFFIXES))
    parser.add_argument("--barrier", default=None)
    args = parser.parse_args()
    pipeline = SUFFIXES[args.suffix](make(args.n, args.variant, args.log))
    with Loader(pipeline, broker=args.broker, share=True,
                deterministic=args.deterministic, share_lag=args.lag,
                share_window_bytes=args.window, share_block_seconds=args.block,
                timeout=30, prefetch=2) as loader:
        if args.barrier:
            barrier, count = args.barrier.rsplit(":", 1)
            open(os.path.join(barrier, str(os.getpid())), "w").close()
            while len(os.listdir(barrier)) < int(count):
                time.sleep(0.01)
        for _ in range(args.epochs):
            got = []
            for element in loader:
                before = len(got)
                got += indices(element)
                if len(got) // 10 > before // 10:
                    print(json.dumps({"progress": len(got)}), flush=True)
                if args.delay:
                    time.sleep(args.delay)
            print(json.dumps({"epoch": loader._epoch - 1, "got": got,
                              "stats": loader.stats()}), flush=True)


if __name__ == "__main__":
    main()
