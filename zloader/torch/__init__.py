"""PyTorch adapters: a drop-in ``DataLoader`` and an ``IterableDataset`` over a Pipeline.

This package is the only part of zloader that imports torch; import it explicitly
(``import zloader.torch``).

:class:`DataLoader` takes what ``torch.utils.data.DataLoader`` takes; with ``num_workers > 0``
the batches are made by zloader worker processes and, for map-style datasets, they are the
same batches in the same order as torch's (same sampler draws, same worker seeding, batches
assigned to workers round-robin). :class:`IterableDataset` runs a Pipeline in the iterating
process (give it to a torch ``DataLoader`` with ``num_workers=0, batch_size=None``).
docs/torch.md lists what still differs from torch.

Modules: ``tensors`` (conversion, pinning and prefetch), ``dataset`` (IterableDataset),
``seeding`` (workers' random state), ``source`` (what the workers run), ``failures`` (a
failed batch carried as a value), ``passes`` (the iterators), ``dataloader`` (DataLoader).
"""

from __future__ import annotations

from zloader.torch.dataloader import DataLoader
from zloader.torch.dataset import IterableDataset
from zloader.torch.tensors import to_numpy, to_torch

__all__ = ["DataLoader", "IterableDataset", "to_numpy", "to_torch"]
