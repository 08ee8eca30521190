"""First epoch against later ones, and time to first batch against torch's.

(1) ``Loader(Pipeline.range(20000), num_workers=2)``, three epochs: the first epoch's
    seconds over the median of the other two, and the first element's latency.
(2) A map-style in-memory dataset (512 float32 (3, 64, 64) tensors and an int), batch 32,
    two workers, no persistent workers: seconds from constructing the loader to its first
    batch, ``zloader.torch.DataLoader`` over ``torch.utils.data.DataLoader``.

Each figure is the median of ``--runs`` runs; run (1) and (2) alternate with an untimed
warm-up Loader first. ``--eager`` restores what a ring's writer did before
zloader/transport/prefault.py (fault the whole ring in when attaching), for a before/after
on the same host: ``python -m bench.first_epoch [--eager] [--runs 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any


def eager_rings() -> None:
    """Make ring writers fault the whole ring in when they attach (the old behaviour)."""
    from zloader.transport import prefault, ring, shm

    attach = shm.Segment.attach.__func__  # type: ignore[attr-defined]

    def populated(cls: Any, name: str, private: bool = False, reserve: bool = False,
                  populate: bool = True) -> Any:
        return attach(cls, name, private=private, reserve=True, populate=True)

    class Nothing:
        def __init__(self, *args: Any) -> None:
            self.done = threading.Event()
            self.done.set()

        def close(self) -> None:
            pass

    shm.Segment.attach = classmethod(populated)  # type: ignore[method-assign]
    ring.Prefaulter = prefault.Prefaulter = Nothing  # type: ignore[misc]


def loader_epochs() -> tuple[float, float]:
    """(first epoch / median later epoch, first element's seconds) of one Loader."""
    from zloader import Loader, Pipeline

    seconds, first = [], 0.0
    with Loader(Pipeline.range(20000), num_workers=2) as loader:
        for epoch in range(3):
            start = time.monotonic()
            for index, _ in enumerate(loader):
                if epoch == 0 and index == 0:
                    first = time.monotonic() - start
            seconds.append(time.monotonic() - start)
    return seconds[0] / statistics.median(seconds[1:]), first


def first_batch(dataset: Any, zloader_loader: bool) -> float:
    """Seconds from constructing a loader to its first batch."""
    import torch.utils.data

    import zloader.torch

    kind = zloader.torch.DataLoader if zloader_loader else torch.utils.data.DataLoader
    start = time.monotonic()
    loader = kind(dataset, batch_size=32, num_workers=2)
    batches = iter(loader)
    next(batches)
    took = time.monotonic() - start
    del batches
    if zloader_loader:
        loader.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    if args.eager:
        eager_rings()
    import torch

    dataset = torch.utils.data.TensorDataset(torch.randn(512, 3, 64, 64), torch.arange(512))
    loader_epochs()  # warm-up: the first Loader of a process also pays for fresh memory
    ratios, firsts, ours, theirs = [], [], [], []
    for _ in range(args.runs):
        ratio, first = loader_epochs()
        ratios.append(ratio)
        firsts.append(first)
        theirs.append(first_batch(dataset, zloader_loader=False))
        ours.append(first_batch(dataset, zloader_loader=True))
    rings = "eager rings (before)" if args.eager else "prefaulted rings"
    print(f"{rings}, median of {args.runs} runs:")
    print(f"  Loader(range(20000), 2 workers): first/later epoch {statistics.median(ratios):.2f}"
          f", first element {1e3 * statistics.median(firsts):.0f} ms")
    print(f"  time to first batch: zloader.torch {statistics.median(ours):.3f} s, torch "
          f"{statistics.median(theirs):.3f} s, ratio "
          f"{statistics.median(ours) / statistics.median(theirs):.2f}")


if __name__ == "__main__":
    main()
