"""Codec benchmark: zloader's codec against pickle, the serializer the local loaders use.

For three element shapes it times a full round trip (encode, then decode from one
contiguous block, as a transport delivers it) with:

* ``zloader``   - zloader.codec (header + raw buffers, decode into views);
* ``pickle5-oob`` - pickle protocol 5 with out-of-band buffers (the fastest pickle path);
* ``pickle``    - plain in-band pickle (what ``multiprocessing`` queues send).

It reports the median time per round trip and the ratio to zloader (higher = zloader
faster). These machines are shared and noisy: read the ratios, not the absolute times.

Run: ``python -m bench.codec [--repeat N] [--out bench/results]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import pickle
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from zloader import codec


def elements() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "image batch (64x224x224x3 uint8)": {
            "image": rng.integers(0, 255, (64, 224, 224, 3), dtype=np.uint8),
            "label": np.arange(64),
        },
        "token batch (32x512 int32 + mask)": {
            "input_ids": rng.integers(0, 50_000, (32, 512), dtype=np.int32),
            "attention_mask": np.ones((32, 512), dtype=bool),
            "lengths": [512] * 32,
        },
        "small record (scalars + str)": {
            "id": 12345, "score": 0.5, "name": "sample-12345", "tags": ["a", "b"],
            "box": np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32),
        },
    }


def _block(buffers: list[Any]) -> list[memoryview]:
    """Copy buffers into one block and slice it, as a transport would deliver them."""
    sizes = [memoryview(b).nbytes for b in buffers]
    block = bytearray(sum(sizes))
    views, offset = [], 0
    for buf, size in zip(buffers, sizes, strict=True):
        block[offset:offset + size] = memoryview(buf).cast("B")
        views.append(memoryview(block)[offset:offset + size])
        offset += size
    return views


def zloader_round_trip(element: Any) -> Any:
    return codec.decode(_block(codec.encode(element)))


def pickle5_oob_round_trip(element: Any) -> Any:
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(element, protocol=5, buffer_callback=buffers.append)
    views = _block([head, *(b.raw() for b in buffers)])
    return pickle.loads(views[0], buffers=views[1:])


def pickle_round_trip(element: Any) -> Any:
    (view,) = _block([pickle.dumps(element, protocol=pickle.HIGHEST_PROTOCOL)])
    return pickle.loads(view)


CODECS: dict[str, Callable[[Any], Any]] = {
    "zloader": zloader_round_trip,
    "pickle5-oob": pickle5_oob_round_trip,
    "pickle": pickle_round_trip,
}


def measure(element: Any, repeat: int) -> dict[str, float]:
    """Median seconds per round trip for each codec, interleaved so that machine noise
    falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in CODECS}
    for fn in CODECS.values():
        fn(element)  # warm up
    for _ in range(repeat):
        for name, fn in CODECS.items():
            start = time.perf_counter()
            fn(element)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30, help="round trips per cell")
    parser.add_argument("--out", default="bench/results", help="where to write results")
    args = parser.parse_args()
    rows = []
    for label, element in elements().items():
        rows.append({"element": label, "seconds": measure(element, args.repeat)})
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "codec", "python": platform.python_version(),
              "numpy": np.__version__, "repeat": args.repeat, "rows": rows}
    (out / "codec.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| element | zloader | pickle5-oob | pickle | pickle5-oob / zloader | "
             "pickle / zloader |", "|---|---|---|---|---|---|"]
    for row in rows:
        t = row["seconds"]
        lines.append(f"| {row['element']} | {t['zloader'] * 1e6:,.1f} µs | "
                     f"{t['pickle5-oob'] * 1e6:,.1f} µs | {t['pickle'] * 1e6:,.1f} µs | "
                     f"{t['pickle5-oob'] / t['zloader']:.2f}x | "
                     f"{t['pickle'] / t['zloader']:.2f}x |")
    table = "\n".join(lines)
    (out / "codec.md").write_text(
        "Round trip (encode, copy into one block, decode), median of "
        f"{args.repeat}; ratio > 1 means zloader is faster.\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
