"""Equality, hash, repr and frozenness by a dataclass's fields, written once for all.

For each class it makes, ``@dataclass`` compiles an ``__eq__``, a ``__repr__`` and, when
frozen, a ``__hash__``, a ``__setattr__`` and a ``__delattr__`` (and an ``__init__`` that
sets each field through ``object.__setattr__``), at import: 0.1 ms or more each, some 60
ms of what ``import zloader`` and a first Loader import. zloader's dataclasses inherit
these methods from :class:`ByFields` (mutable) or :class:`FrozenByFields` instead and are
declared ``eq=False, repr=False`` (and not ``frozen``): they behave as the compiled ones
(the fields that ``compare``, that ``repr``, that ``hash``; two values are equal when of
the same class with equal fields; a frozen one's fields are set once, by its
``__init__``), a little slower per call, and none of them is on the data path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ByFields", "FrozenByFields"]


@dataclasses.dataclass(frozen=True)
class _Names:
    """The names of a class's fields: all, and those that compare, show in its repr and
    hash (as ``dataclasses`` picks them)."""

    every: frozenset[str]
    compare: tuple[str, ...]
    repr: tuple[str, ...]
    hash: tuple[str, ...]


_NAMES: dict[type, _Names] = {}


def _names(cls: type) -> _Names:
    """:class:`_Names` of ``cls``, worked out once per class."""
    names = _NAMES.get(cls)
    if names is None:
        fields = dataclasses.fields(cls)
        names = _NAMES[cls] = _Names(
            frozenset(f.name for f in fields),
            tuple(f.name for f in fields if f.compare),
            tuple(f.name for f in fields if f.repr),
            tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash)))
    return names


class ByFields:
    """``__eq__`` and ``__repr__`` by the fields (a mutable dataclass: unhashable, as
    ``@dataclass`` makes one with ``eq=True``)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        names = _names(self.__class__).compare
        return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in _names(self.__class__).repr)
        return f"{self.__class__.__qualname__}({shown})"


class FrozenByFields(ByFields):
    """:class:`ByFields`, ``__hash__`` by the fields, and frozen: ``__init__`` sets each
    field once; any other assignment or deletion raises ``FrozenInstanceError``, as on a
    ``frozen=True`` dataclass (``object.__setattr__`` still sets, for the few that cache
    a value in ``__post_init__``)."""

    __slots__ = ()

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(getattr(self, n) for n in _names(self.__class__).hash))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ or name not in _names(self.__class__).every:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
