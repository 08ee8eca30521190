"""Command-line entry points: ``zloader``, ``zloader-broker`` and ``zloader-worker``."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from zloader._version import __version__

__all__ = ["broker_main", "main", "worker_main"]


class Progress:
    """A one-line progress bar on a terminal, or a line every few seconds elsewhere."""

    def __init__(self, total: int, unit: str, stream: TextIO, interval: float = 0.1) -> None:
        self.total = total
        self.unit = unit
        self.stream = stream
        self.tty = stream.isatty()
        self.interval = interval if self.tty else 5.0
        self.start = time.monotonic()
        self.last = 0.0
        self.done = 0

    def update(self, count: int) -> None:
        self.done += count
        now = time.monotonic()
        if now - self.last >= self.interval or self.done >= self.total:
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        fraction = min(self.done / self.total, 1.0) if self.total else 1.0
        bar = "#" * int(fraction * 30)
        line = (f"[{bar:<30}] {self.done}/{self.total} {self.unit} "
                f"{self.done / elapsed:,.0f} {self.unit}/s")
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _demo(args: argparse.Namespace) -> int:
    from zloader.demo import demo_pipeline

    pipeline = demo_pipeline(args.images, args.batch_size, args.size)
    progress = Progress(args.images, "images", sys.stderr)
    start = time.monotonic()
    images = 0
    for batch in pipeline:
        count = len(batch["label"])
        images += count
        progress.update(count)
    elapsed = time.monotonic() - start
    progress.close()
    print(f"zloader demo: {images} images ({args.size}x{args.size}, decode + crop + flip + "
          f"normalize, batches of {args.batch_size}) in {elapsed:.2f} s = "
          f"{images / elapsed:,.0f} images/s, in this process")
    return 0


def _fingerprint(args: argparse.Namespace) -> int:
    from zloader.pipeline import Pipeline

    module_name, _, attribute = args.target.partition(":")
    if not attribute:
        print("zloader fingerprint: give MODULE:NAME, e.g. my_training.data:pipeline",
              file=sys.stderr)
        return 2
    obj: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    if callable(obj) and not isinstance(obj, Pipeline):
        obj = obj()
    if not isinstance(obj, Pipeline):
        print(f"zloader fingerprint: {args.target} is a {type(obj).__name__}, not a Pipeline",
              file=sys.stderr)
        return 2
    print(obj.fingerprint if obj.shareable else f"{obj.fingerprint} (unshareable)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zloader", description="zloader: ML input pipelines on CPU worker processes.")
    parser.add_argument("--version", action="version", version=f"zloader {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser(
        "demo", help="run the demo job (synthetic image decode and augmentation)",
        description="Run a synthetic image pipeline (decode, random crop, flip, normalize, "
                    "batch) and report its throughput.")
    demo.add_argument("--images", type=_positive, default=20000, help="images (default 20000)")
    demo.add_argument("--batch-size", type=_positive, default=64, help="default 64")
    demo.add_argument("--size", type=_positive, default=64, help="image side (default 64)")
    demo.set_defaults(run=_demo)
    fp = commands.add_parser(
        "fingerprint", help="print the fingerprint of a pipeline",
        description="Import MODULE and print the fingerprint of the Pipeline at NAME (or "
                    "returned by calling NAME with no arguments).")
    fp.add_argument("target", metavar="MODULE:NAME")
    fp.set_defaults(run=_fingerprint)
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``zloader``: the user-facing command."""
    args = build_parser().parse_args(argv)
    result: int = args.run(args)
    return result


def _not_yet(prog: str, argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=f"{prog}: part of zloader's service, which this version "
                               f"({__version__}) does not include yet.")
    parser.add_argument("--version", action="version", version=f"zloader {__version__}")
    parser.parse_args(argv)
    print(f"{prog}: zloader {__version__} runs pipelines in-process only; the broker and "
          "worker service is not part of this version.", file=sys.stderr)
    return 2


def broker_main(argv: Sequence[str] | None = None) -> int:
    """``zloader-broker``: not available in this version (says so and exits 2)."""
    return _not_yet("zloader-broker", argv)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """``zloader-worker``: not available in this version (says so and exits 2)."""
    return _not_yet("zloader-worker", argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
