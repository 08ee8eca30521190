"""Tensors in and out of zloader: :func:`to_torch` and :func:`to_numpy` convert nested
elements, :class:`Prefetcher` pins batches and copies them to a device ahead of use.

Element conversion (:func:`to_torch`): numpy arrays become tensors that share their memory
(``torch.from_numpy``, no copy) when the array is writable; read-only arrays (rows of
``Pipeline.from_arrays``, elements decoded from read-only memory) are copied, so that
writing to a tensor can never change data the pipeline owns. Numpy scalars become 0-d
tensors; containers keep their shape; everything else is passed through.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from zloader._defaults import PREFETCH_STOP_SECONDS

_TENSOR_KINDS = frozenset("biufc")
"""numpy dtype kinds a tensor can hold (bool, ints, unsigned, floats, complex)."""


def to_torch(element: Any) -> Any:
    """Convert the numpy arrays and scalars in a nested element to tensors; arrays of a
    dtype no tensor holds (str, bytes, object, datetime64, structured: a collate's array
    of file names, pickled) stay arrays, as torch gives them."""
    if isinstance(element, np.ndarray):
        if element.dtype.kind not in _TENSOR_KINDS:
            return element
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


def to_numpy(element: Any, objects: bool = False) -> Any:
    """Convert the tensors in a nested element that numpy can hold to numpy arrays
    (sharing memory when the tensor is on the CPU), for the codec's array paths.

    Tensors numpy cannot hold stay tensors, which the codec carries as they are (no
    pickle): ``bfloat16``, ``float8_*`` and the other dtypes numpy lacks, nested tensors
    (``torch.nested``), and sparse or quantized ones (refused by the codec, or pickled whole
    where the Loader's own workers may pickle: ``Loader(objects=True)``). With ``objects``,
    a named tuple such as ``PackedSequence`` stays as it is too, to be pickled whole
    (keeping its type); without it, it arrives as a plain tuple.
    """
    if isinstance(element, torch.Tensor):
        tensor = element.detach()
        if tensor.is_nested or tensor.layout != torch.strided or tensor.is_quantized \
                or tensor.dtype not in NUMPY_DTYPES:
            return element
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        return tensor.resolve_conj().resolve_neg().numpy()
    if isinstance(element, dict):
        return {key: to_numpy(value, objects) for key, value in element.items()}
    if isinstance(element, list):
        return [to_numpy(v, objects) for v in element]
    if isinstance(element, tuple):
        if objects and type(element) is not tuple:
            return element
        return tuple(to_numpy(v, objects) for v in element)
    return element


NUMPY_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128})
"""The tensor dtypes ``Tensor.numpy()`` takes in every torch zloader supports."""


def apply_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {key: apply_tensors(value, fn) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(apply_tensors(value, fn) for value in batch)
    return batch
class Prefetcher:
    """Runs ``batches`` (``(batch, tag)`` pairs; the tag rides along untouched) on a
    thread that pins each batch and starts its copy to ``device``; at most ``depth``
    batches wait. Errors are re-raised in the consumer. The thread holds no reference to
    this object, so dropping it stops the thread."""

    _END = object()

    def __init__(self, batches: Iterator[Any], pin: bool, device: torch.device | None,
                 depth: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_prefetch, args=(batches, pin, device, self._queue, self._stop),
            name="zloader-pin", daemon=True)
        self._thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        while True:
            try:
                batch, event = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise StopIteration from None  # stopped by close()
        if batch is self._END:
            raise StopIteration
        if isinstance(batch, BaseException):
            raise batch
        if event is not None:
            torch.cuda.current_stream().wait_event(event)  # the copy is done before use
        return batch

    def close(self, timeout: float = PREFETCH_STOP_SECONDS) -> None:
        """Stop the thread; wait for it (up to ``timeout`` seconds) to leave the batch it
        is reading, so that nothing else reads from this epoch's Loader afterwards."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __del__(self) -> None:
        self._stop.set()


def _prefetch(batches: Iterator[Any], pin: bool, device: torch.device | None,
              out: queue.Queue[Any], stop: threading.Event) -> None:
    """The body of a :class:`Prefetcher`'s thread."""
    stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" \
        else None

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for batch, tag in batches:
            if pin:
                batch = apply_tensors(batch, lambda t: t.pin_memory())
            event = None
            if device is not None:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        batch = apply_tensors(batch, lambda t: t.to(device, non_blocking=True))
                        event = torch.cuda.Event()
                        event.record(stream)
                else:
                    batch = apply_tensors(batch, lambda t: t.to(device))
            if not put(((batch, tag), event)):
                return
        put((Prefetcher._END, None))
    except BaseException as exc:  # re-raised in the consumer's thread
        put((exc, None))
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
