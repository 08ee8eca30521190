"""PyTorch adapter: a ``torch.utils.data.IterableDataset`` over a zloader Pipeline.

This module is the only one in zloader that imports torch; import it explicitly
(``import zloader.torch``). In this version the pipeline runs in the iterating process;
give the dataset to a ``torch.utils.data.DataLoader`` with ``num_workers=0`` and
``batch_size=None`` (batch in the pipeline), or iterate it directly.

Element conversion (:func:`to_torch`): numpy arrays become tensors that share their memory
(``torch.from_numpy``, no copy) when the array is writable; read-only arrays (rows of
``Pipeline.from_arrays``, elements decoded from read-only memory) are copied, so that
writing to a tensor can never change data the pipeline owns. Numpy scalars become 0-d
tensors; containers keep their shape; everything else is passed through.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data

from zloader import _check
from zloader.pipeline import Pipeline

__all__ = ["IterableDataset", "to_torch"]


def to_torch(element: Any) -> Any:
    """Convert the numpy arrays and scalars in a nested element to tensors."""
    if isinstance(element, np.ndarray):
        if not element.flags.writeable:
            element = element.copy()
        return torch.from_numpy(element)
    if isinstance(element, np.generic) and not isinstance(element, (str, bytes)):
        return torch.from_numpy(np.asarray(element).copy())
    if isinstance(element, dict):
        return {key: to_torch(value) for key, value in element.items()}
    if isinstance(element, tuple) and hasattr(element, "_fields"):
        return type(element)(*(to_torch(value) for value in element))
    if isinstance(element, (list, tuple)):
        return type(element)(to_torch(value) for value in element)
    return element


class IterableDataset(torch.utils.data.IterableDataset):
    """Iterate a Pipeline as torch tensors, one epoch per iteration.

    Args:
        pipeline: the pipeline to run.
        epoch: the epoch of the first iteration; each new iteration advances it by one
            unless :meth:`set_epoch` is called first.

    Raises:
        TypeError: ``pipeline`` is not a Pipeline.
        RuntimeError: iterated inside a torch DataLoader worker (``num_workers > 0``),
            where every worker would yield the whole pipeline.
    """

    def __init__(self, pipeline: Pipeline, epoch: int = 0) -> None:
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"pipeline must be a zloader.Pipeline, got {type(pipeline).__name__}")
        self.pipeline = pipeline
        self.next_epoch = _check.integer("epoch", epoch, 0)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run ``epoch`` (as with ``DistributedSampler``)."""
        self.next_epoch = _check.integer("epoch", epoch, 0)

    def __iter__(self) -> Iterator[Any]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError(
                "zloader.torch.IterableDataset runs the pipeline itself: every torch worker "
                "would yield every element. Use DataLoader(dataset, num_workers=0, "
                "batch_size=None) and put batching in the pipeline.")
        epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
        return (to_torch(element) for element in self.pipeline.iter(epoch))
