"""A DataLoader worker's random state: seeded as torch seeds its workers, captured and
restored (torch, numpy and ``random``) for ``state_dict``."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.random  # (imported on first use: here, once, not in each forked worker)
import torch
from torch.utils.data import dataloader as _torch_dataloader
from torch.utils.data._utils import worker as _torch_worker

from zloader._byfields import ByFields


@dataclass(eq=False, repr=False)
class Seeded(ByFields):
    """This worker process's seeding for the DataLoader whose batches it makes (a worker
    runs one task at a time): that loader's token, the base seed, the worker it was seeded
    as, the random state it was seeded to and the random state it last reported."""

    token: str
    base_seed: int
    worker: int
    initial: bytes
    reported: bytes


_SEEDED: Seeded | None = None
# A seeding at fork (:func:`early`) that raised: (token, base seed, worker, the error),
# raised by :func:`seeded` for that loader's first epoch, as torch's worker raises it.
_FAILED: tuple[str, int, int, Exception] | None = None


def seeded(token: str, reseed: bool, base_seed: int, worker: int, workers: int, dataset: Any,
           init_fn: Callable[[int], None] | None, resumed: bytes | None) -> Seeded:
    """This worker's seeding for the loader ``token``, at the start of an epoch.

    It is seeded as torch seeds its worker ``worker`` (``worker_init_fn`` included) when
    it last made another loader's batches, or when ``reseed`` brings a new base seed; a
    persistent worker asked to reseed with the base seed it has is set back to the state
    that seeding gave it (torch seeds a persistent worker once). Then, when the epoch
    resumes a loaded state (``resumed``: this worker's state then, empty for one as
    seeded), it takes that state, seeded afresh or not: a persistent
    worker has gone on drawing since that state was saved."""
    global _SEEDED, _FAILED
    fresh = (_SEEDED is None or _SEEDED.token != token or _SEEDED.worker != worker
             or (reseed and _SEEDED.base_seed != base_seed))
    if fresh:
        failed, _FAILED = _FAILED, None
        if failed is not None and failed[:3] == (token, base_seed, worker):
            raise failed[3]  # (worker_init_fn raised at fork: not run twice)
        seed_worker(base_seed, worker, workers, dataset, init_fn)
        state = capture_rng()
        _SEEDED = Seeded(token, base_seed, worker, state, state)
    assert _SEEDED is not None
    target = None
    if resumed is not None:  # load_state_dict: as this worker was then
        target = bytes(resumed) or _SEEDED.initial
    elif reseed and not fresh:
        target = _SEEDED.initial
    if target is not None:
        restore_rng(target)
        _SEEDED.reported = target
    return _SEEDED


def early(token: str, base_seed: int, worker: int, workers: int, dataset: Any,
          init_fn: Callable[[int], None] | None) -> bool:
    """Seed this process, just forked to be worker ``worker`` of the loader ``token``, as
    :func:`seeded` seeds it at that loader's first epoch (base seed ``base_seed``), as
    torch seeds its workers as they start: while the loader forks the others, not after
    the first batch's request has come. Its ``seeded`` then finds it done; an error
    (``worker_init_fn`` raised) is kept for it to raise, and False returned."""
    global _SEEDED, _FAILED
    try:
        seed_worker(base_seed, worker, workers, dataset, init_fn)
    except Exception as exc:
        _FAILED = (token, base_seed, worker, exc)
        return False
    state = capture_rng()
    _SEEDED = Seeded(token, base_seed, worker, state, state)
    return True


def seed_worker(base_seed: int, worker: int, workers: int, dataset: Any,
                init_fn: Callable[[int], None] | None) -> None:
    """Seed this worker exactly as torch seeds its worker ``worker`` (``_worker_loop``)."""
    torch.set_num_threads(1)
    seed = base_seed + worker
    random.seed(seed)
    _manual_seed(seed)
    np.random.seed(_torch_worker._generate_state(base_seed, worker))
    _torch_worker._worker_info = _torch_worker.WorkerInfo(
        id=worker, num_workers=workers, seed=seed, dataset=dataset)
    if isinstance(dataset, (torch.utils.data.IterDataPipe, torch.utils.data.MapDataPipe)):
        # as torch's iterator wraps worker_init_fn: a datapipe's sharding_filter keeps
        # this worker's share (of this process's rank's, when distributed)
        world, rank = _torch_dataloader._get_distributed_settings()
        torch.utils.data.graph_settings.apply_sharding(dataset, workers * world,
                                                       worker * world + rank)
    if init_fn is not None:
        init_fn(worker)


def _manual_seed(seed: int) -> None:
    """``torch.manual_seed(seed)``, as torch's worker calls it. Where no CUDA, XPU or MPS
    device can be used (no other generator to seed), only the CPU generator, which is all
    that call seeds there: it would also queue each device's seeding for a later device
    start, with the stack formatted for each (about 2 ms in a just forked worker, read
    from the source files)."""
    if torch.cuda.is_available() or torch.xpu.is_available() \
            or torch.backends.mps.is_available():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def capture_rng() -> bytes:
    """This process's torch, numpy and ``random`` global random states, packed: what a
    worker's dataset draws from (torch seeds all three in its workers)."""
    torch_state = torch.get_rng_state().numpy().tobytes()
    _, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    version, words, py_gauss = random.getstate()
    return b"".join([
        _RNG_HEAD.pack(len(torch_state)), torch_state,
        np.asarray(keys, dtype="<u4").tobytes(), _NP_TAIL.pack(pos, has_gauss, gauss),
        np.asarray(words, dtype="<u4").tobytes(),
        _PY_TAIL.pack(version, py_gauss is not None, py_gauss or 0.0)])


def unpack_rng(data: bytes) -> tuple[bytes, tuple[Any, ...], tuple[Any, ...]]:
    """The three states :func:`capture_rng` packed: (torch, numpy, random).

    Raises:
        ValueError: ``data`` is not such a packing (a corrupt or foreign state_dict).
    """
    try:
        (size,) = _RNG_HEAD.unpack_from(data, 0)
        at = _RNG_HEAD.size
        torch_state, at = data[at:at + size], at + size
        keys, at = np.frombuffer(data, "<u4", _MT_WORDS, at), at + 4 * _MT_WORDS
        pos, has_gauss, gauss = _NP_TAIL.unpack_from(data, at)
        at += _NP_TAIL.size
        words, at = np.frombuffer(data, "<u4", _MT_WORDS + 1, at), at + 4 * (_MT_WORDS + 1)
        version, has_py_gauss, py_gauss = _PY_TAIL.unpack_from(data, at)
        if (at + _PY_TAIL.size != len(data) or len(torch_state) != size
                or size != torch.get_rng_state().numel()):
            raise ValueError("wrong length")
    except (ValueError, struct.error) as exc:
        raise ValueError(f"not a worker random state saved by zloader.torch.DataLoader "
                         f"({exc})") from None
    return (torch_state,
            ("MT19937", keys.astype(np.uint32), pos, has_gauss, gauss),
            (version, tuple(int(w) for w in words), py_gauss if has_py_gauss else None))


def restore_rng(data: bytes) -> None:
    """Set this process's torch, numpy and ``random`` states to a :func:`capture_rng`."""
    torch_state, numpy_state, py_state = unpack_rng(data)
    torch.set_rng_state(torch.frombuffer(bytearray(torch_state), dtype=torch.uint8))
    np.random.set_state(numpy_state)
    random.setstate(py_state)


_RNG_HEAD = struct.Struct("<I")
_NP_TAIL = struct.Struct("<iid")
_PY_TAIL = struct.Struct("<i?d")
_MT_WORDS = 624
