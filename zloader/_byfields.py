"""Equality, hash and repr by a dataclass's fields, written once for every dataclass.

``@dataclass`` compiles an ``__eq__``, a ``__repr__`` and, when frozen, a ``__hash__`` for
each class it makes, at import: about 0.1 ms each, some 25 ms of what ``import zloader``
and a first Loader import. The dataclasses that inherit from :class:`ByFields` are declared
``eq=False, repr=False`` and get these methods instead; they behave as the compiled ones
(the fields that ``compare``, then those that ``repr``; two values are equal when of the
same class with equal fields), a little slower per call, and none of them is called on the
data path.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ByFields", "FrozenByFields"]

_NAMES: dict[type, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}


def _names(cls: type) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The names of ``cls``'s fields that compare, that show in its repr and that hash
    (as ``dataclasses`` picks them), worked out once per class."""
    names = _NAMES.get(cls)
    if names is None:
        fields = dataclasses.fields(cls)
        names = _NAMES[cls] = (
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
        names = _names(self.__class__)[0]
        return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in _names(self.__class__)[1])
        return f"{self.__class__.__qualname__}({shown})"


class FrozenByFields(ByFields):
    """:class:`ByFields` and ``__hash__`` by the fields (a frozen dataclass)."""

    __slots__ = ()

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(getattr(self, n) for n in _names(self.__class__)[2]))


