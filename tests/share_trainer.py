"""A trainer process for the sharing tests: reads a shared job, one JSON line per epoch.

    python tests/share_trainer.py BROKER N VARIANT EPOCHS [--delay S] [--lag L]
        [--window BYTES] [--block S] [--log PATH] [--workers-deterministic]

Each element's first value is its index in the epoch's source; every call of the
pipeline's map function appends one byte to ``--log`` (to count how often it ran). Prints
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
    args = parser.parse_args()
    with Loader(make(args.n, args.variant, args.log), broker=args.broker, share=True,
                deterministic=args.deterministic, share_lag=args.lag,
                share_window_bytes=args.window, share_block_seconds=args.block,
                timeout=30, prefetch=2) as loader:
        for _ in range(args.epochs):
            got = []
            for element in loader:
                got.append(int(element[0]))
                if len(got) % 10 == 0:
                    print(json.dumps({"progress": len(got)}), flush=True)
                if args.delay:
                    time.sleep(args.delay)
            print(json.dumps({"epoch": loader._epoch - 1, "got": got,
                              "stats": loader.stats()}), flush=True)


if __name__ == "__main__":
    main()
