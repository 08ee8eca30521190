"""One process of bench.sharing: a trainer (of one of the systems compared) or the
TensorSocket producer. Prints one JSON line when done.

    python -m bench._share_trainer ROLE CONFIG_FILE

Roles: ``zloader-shared``, ``zloader-unshared``, ``torch``, ``tensorsocket`` (trainers),
``tensorsocket-producer``, and the sweep's trainers (bench/_sweep.py): ``sweep-`` and one of
``zloader-shared``, ``zloader-unshared``, ``torch``. A trainer reads ``epochs`` epochs of
``images`` images as fast as it can (it reads one value of each batch) and reports when
each batch arrived, its own CPU time and its children's (a torch DataLoader's workers, an
embedded zloader's).
"""

from __future__ import annotations

import faulthandler
import functools
import json
import resource
import signal
import sys
import time
from typing import Any

import numpy as np

from bench._images import decode_augment

BATCH_SIZE = 64


def load_image(index: int, paths: tuple[str, ...]) -> tuple[np.ndarray, int]:
    """The [3/7] image sample (bench.torch_loader.ImageDataset), in numpy: float32 CHW in
    [0, 1] and a label."""
    file = index % len(paths)
    pixels = decode_augment(paths[file]).transpose(2, 0, 1)
    return np.multiply(pixels, np.float32(1 / 255), dtype=np.float32), file % 1000


def pipeline(paths: list[str], images: int) -> Any:
    from zloader import Pipeline

    return (Pipeline.range(images, split_size=BATCH_SIZE)
            .map(functools.partial(load_image, paths=tuple(paths))).batch(BATCH_SIZE))


def cpu() -> dict[str, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"self": me.ru_utime + me.ru_stime, "children": kids.ru_utime + kids.ru_stime}


def read(batches: Any, count: int, arrivals: list[float]) -> None:
    for batch in batches:
        first = batch[0]
        float(first.reshape(-1)[-1])  # the training loop touches the batch
        arrivals.append(time.perf_counter())
        count -= 1
    if count:
        raise RuntimeError(f"{count} batches short of an epoch")


def trainer(role: str, config: dict[str, Any]) -> dict[str, Any]:
    paths, images, epochs = config["paths"], config["images"], config["epochs"]
    workers = config["workers"]
    per_epoch = images // BATCH_SIZE
    arrivals: list[float] = []
    if role.startswith("zloader"):
        from zloader import Loader

        shared = role == "zloader-shared"
        kwargs: dict[str, Any] = ({"broker": config["broker"], "share": True, "num_workers": 0}
                                  if shared else {"num_workers": workers})
        with Loader(pipeline(paths, images), timeout=120, **kwargs) as loader:
            for _ in range(epochs):
                read(iter(loader), per_epoch, arrivals)
            stats = loader.stats()
    elif role == "torch":
        import torch.utils.data

        from bench.torch_loader import ImageDataset

        loader = torch.utils.data.DataLoader(ImageDataset(paths, images), batch_size=BATCH_SIZE,
                                             shuffle=True, num_workers=workers)
        for _ in range(epochs):
            read(iter(loader), per_epoch, arrivals)
        del loader
        stats = {}
    else:
        from tensorsocket import TensorConsumer

        ports = config["ports"]
        consumer = TensorConsumer(port=ports[0], ack_port=ports[1],
                                  heart_ports=(ports[2], ports[3]), batch_size=BATCH_SIZE)
        received = []
        for _ in range(epochs):  # TensorSocket's epoch: until its end marker
            before = len(arrivals)
            while len(arrivals) == before:  # an end marker before any batch: skip it
                try:
                    for batch in consumer:
                        read([batch], 1, arrivals)
                except StopIteration:
                    pass
            received.append(len(arrivals) - before)
        stats = {"batches_per_epoch": received, "expected_per_epoch": per_epoch}
    return {"role": role, "arrivals": arrivals, "cpu": cpu(), "stats": stats}


def producer(config: dict[str, Any]) -> dict[str, Any]:
    """TensorSocket's producer: one torch DataLoader, broadcast to the consumers."""
    import torch.utils.data
    from tensorsocket import TensorProducer

    from bench.torch_loader import ImageDataset

    loader = torch.utils.data.DataLoader(ImageDataset(config["paths"], config["images"]),
                                         batch_size=BATCH_SIZE, shuffle=True,
                                         num_workers=config["workers"])
    ports = config["ports"]
    produce = TensorProducer(loader, port=ports[0], ack_port=ports[1],
                             heart_ports=(ports[2], ports[3]))
    while len(produce.hb.consumers) < config["trainers"]:  # everyone from the start
        time.sleep(0.05)
    for _ in range(config["epochs"]):
        for _ in produce:
            pass
    time.sleep(0.5)  # the last acknowledgements
    produce.join()
    return {"role": "tensorsocket-producer", "cpu": cpu()}


def sweep_trainer(role: str, config: dict[str, Any]) -> dict[str, Any]:
    """A trainer of the sweep (bench/_sweep.py): trainer ``config["which"]``'s suffix;
    reports each epoch's seconds and whether it got every image once."""
    from bench._sweep import SUFFIXES, TorchSweep, pipeline

    paths, images, epochs = config["paths"], config["images"], config["epochs"]
    which, log = config["which"], config["log"]
    size, strength = SUFFIXES[which]
    if role == "sweep-torch":
        import torch.utils.data

        loader: Any = torch.utils.data.DataLoader(
            TorchSweep(paths, images, log, strength), batch_size=size, shuffle=True,
            num_workers=config["workers"])
    else:
        from zloader import Loader

        kwargs: dict[str, Any] = ({"broker": config["broker"], "share": True}
                                  if role == "sweep-zloader-shared"
                                  else {"num_workers": config["workers"]})
        loader = Loader(pipeline(paths, images, log, which), timeout=300, **kwargs)
    seconds, exact, stats = [], [], {}
    try:
        for _ in range(epochs):
            started = time.perf_counter()
            got: list[int] = []
            for pixels, indices in loader:
                float(np.asarray(pixels).reshape(-1)[-1])  # the training loop touches it
                got += np.asarray(indices).reshape(-1).tolist()
            seconds.append(time.perf_counter() - started)
            exact.append(sorted(got) == list(range(images)))
        if role != "sweep-torch":
            stats = loader.stats()
    finally:
        if role != "sweep-torch":
            loader.close()
    return {"role": role, "which": which, "seconds": seconds, "exact": exact, "cpu": cpu(),
            "replayed": stats.get("share_replayed", 0)}


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks, if it ever hangs
    role = sys.argv[1]
    with open(sys.argv[2]) as file:
        config = json.load(file)
    result = producer(config) if role == "tensorsocket-producer" else \
        sweep_trainer(role, config) if role.startswith("sweep-") else trainer(role, config)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
