"""Torch tensors in the element codec (zloader/codec.py), without importing torch.

A value is a tensor when torch is already imported in this process and the value is an
instance of its ``Tensor`` (a process that never imported torch holds no tensor), so
encoding never imports torch. A dense tensor travels as its dtype's name, its shape and its
memory (C-contiguous, on the CPU), whatever its dtype (``bfloat16``, ``float8_*``,
``uint16``... all but the quantized ones); a nested tensor (``torch.nested``) as its layout,
its dtype and its component tensors. Decoding imports torch when a header holds a tensor:
the sender had torch, so the element's reader is expected to have it too.

Nothing here is pickled: the header names a dtype, which is looked up among torch's dtypes,
never imported or called on a peer's word.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import numpy as np

from zloader.errors import CodecError

LAYOUTS = ("strided", "jagged")
"""The layouts of nested tensors the codec carries, by their names in torch."""


_PLAIN = {1: "uint8", 2: "int16", 4: "int32", 8: "int64", 16: "complex128"}
"""For each element size, a dtype of that size every torch copies."""


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (False whenever torch is not imported)."""
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    return tensor is not None and isinstance(value, tensor)


def is_nested(value: Any) -> bool:
    """Whether the tensor ``value`` is a nested one."""
    return bool(getattr(value, "is_nested", False))


def dense_parts(value: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """A dense tensor as ``(dtype name, shape, its bytes)``: detached, on the CPU, with
    conjugate and negative views resolved and made C-contiguous (a copy only when it is
    not already so). The bytes are a view that keeps the tensor's memory alive.

    Raises:
        TypeError: a sparse, quantized or otherwise unstrided tensor, which the codec does
            not carry (the message says how to convert it), or one whose memory torch
            cannot give (on the ``meta`` device).
    """
    torch = sys.modules["torch"]
    tensor = value.detach()
    if tensor.layout != torch.strided:
        raise TypeError(f"a tensor of layout {tensor.layout} is not supported; convert it "
                        "with .to_dense() in the dataset or a map stage")
    if tensor.is_quantized:
        raise TypeError(f"a quantized tensor ({tensor.dtype}) is not supported; convert it "
                        "with .dequantize() in the dataset or a map stage")
    name = str(tensor.dtype).removeprefix("torch.")
    try:
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.resolve_conj().resolve_neg()
        if not tensor.is_contiguous():
            # copied as a plain dtype of the same size: torch copies every dtype that way,
            # not all of them as themselves (int4, uint1... have no copy kernel)
            plain = getattr(torch, _PLAIN.get(tensor.dtype.itemsize, ""), tensor.dtype)
            tensor = tensor.view(plain).contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy()  # shares the tensor's memory
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        raise TypeError(f"a tensor of {value.dtype} on {value.device} cannot be read as "
                        f"memory: {exc}") from None
    return name, tuple(tensor.shape), raw.data


def nested_parts(value: Any) -> tuple[str, str, list[Any]]:
    """A nested tensor as ``(layout name, dtype name, component tensors)``.

    Raises:
        TypeError: a layout other than :data:`LAYOUTS`, or components torch cannot give.
    """
    layout = str(value.layout).removeprefix("torch.")
    if layout not in LAYOUTS:
        raise TypeError(f"a nested tensor of layout {value.layout} is not supported")
    try:
        components = list(value.detach().unbind())
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        raise TypeError(f"a nested tensor's components cannot be read: {exc}") from None
    return layout, str(value.dtype).removeprefix("torch."), components


def torch_module() -> Any:
    """torch, imported now if it was not yet (a header holds a tensor).

    Raises:
        CodecError: torch is not installed here.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise CodecError("the element holds a torch tensor, but torch cannot be imported "
                         "here: install torch where elements are read") from None


def dtype_of(name: str) -> Any:
    """torch's dtype named ``name`` (``"bfloat16"``).

    Raises:
        CodecError: no such dtype, or a quantized one.
    """
    torch = torch_module()
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or name.startswith(("qint", "quint")):
        raise CodecError(f"unknown or unsupported tensor dtype {name!r}")
    return dtype


def dense(dtype: Any, shape: tuple[int, ...], data: memoryview) -> Any:
    """The tensor of ``dtype`` and ``shape`` over ``data`` (its bytes, as many as the
    shape needs: the caller checks), sharing that memory when it is writable. Read-only
    memory (a frame of a socket, a cache file's mapping) is copied: a tensor has no
    read-only form, and writing to it must never change memory the sender owns.

    Raises:
        CodecError: torch cannot build it.
    """
    torch = torch_module()
    raw = np.frombuffer(data, dtype=np.uint8)
    if not raw.flags.writeable:
        raw = raw.copy()
    try:
        return torch.from_numpy(raw).view(dtype).reshape(shape)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise CodecError(f"a tensor of shape {shape} and dtype {dtype} cannot be built: "
                         f"{exc}") from None


def nested(layout: str, dtype: Any, components: list[Any]) -> Any:
    """The nested tensor of ``components`` (tensors of ``dtype``) in ``layout``.

    Raises:
        CodecError: an unknown layout, a component that is not a tensor of ``dtype``, or
            components torch cannot nest.
    """
    torch = torch_module()
    if layout not in LAYOUTS:
        raise CodecError(f"unknown nested tensor layout {layout!r}")
    for component in components:
        if not isinstance(component, torch.Tensor) or component.dtype != dtype \
                or component.is_nested:
            raise CodecError(f"a nested tensor of {dtype} holds a component that is not a "
                             f"tensor of that dtype ({type(component).__name__})")
    try:
        return torch.nested.nested_tensor(components, dtype=dtype,
                                          layout=getattr(torch, layout))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise CodecError(f"a nested tensor of {len(components)} components cannot be "
                         f"built: {exc}") from None
