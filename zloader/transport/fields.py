"""The parts of a message record (zloader/transport/messages.py): checks of field values,
the field declaration :func:`fld`, and the :class:`Record` base that decodes a body field by
field and encodes it back.

A check takes a value parsed from JSON and returns it (or what it stands for: a tuple for a
list, a float for a number) or raises :class:`Wrong` saying what it must be; the record
names the command and the field in the :class:`ProtocolError` it raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from zloader._byfields import FrozenByFields
from zloader._defaults import MAX_FIELD_DEPTH, MAX_ITEMS, MAX_NAME
from zloader.lineage import unpack
from zloader.transport.protocol import Command, ProtocolError

__all__ = ["INDEX", "MAX_FIELD_DEPTH", "MAX_ITEMS", "MAX_NAME", "NAME", "PASS_KEY", "Body",
           "Check", "Record", "Wrong", "array", "boolean", "counts", "fld", "integer", "is_int",
           "list_of", "number", "obj", "optional", "packed", "short", "text"]


_ABSENT: Any = object()


class Wrong(Exception):
    """What is wrong with one value (the caller names the command and the field). A
    value that nests named fields (``REGISTER.options``) says which of them is wrong in
    ``field``, and what it held in ``value``."""

    def __init__(self, text: str, *, field: str | None = None, value: Any = _ABSENT) -> None:
        super().__init__(text)
        self.field = field
        self.value = value


Check = Callable[[Any], Any]
"""Returns the value checked (or converted: a float from an int), or raises Wrong."""


# --- checks -------------------------------------------------------------------------------

def is_int(value: Any) -> bool:
    """Whether ``value`` is a JSON integer (``True`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int | None = None, high: int | None = None) -> Check:
    """An integer in [low, high] (JSON's true and false are not integers)."""
    what = "an integer" + (f" >= {low}" if low is not None else "") \
        + (f" <= {high}" if high is not None else "")

    def check(value: Any) -> int:
        if not is_int(value) or (low is not None and value < low) \
                or (high is not None and value > high):
            raise Wrong(f"must be {what}")
        return int(value)
    check.bounds = (low, high)  # type: ignore[attr-defined]  # (list_of's bulk check)
    return check


def number(low: float, high: float) -> Check:
    """A number in [low, high], as a float."""
    def check(value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) \
                or not low <= value <= high:
            raise Wrong(f"must be a number from {low:g} to {high:g}")
        return float(value)
    return check


def text(longest: int = MAX_NAME, choices: tuple[str, ...] = ()) -> Check:
    """A string of at most ``longest`` characters (one of ``choices``, if given)."""
    def check(value: Any) -> str:
        if not isinstance(value, str) or len(value) > longest:
            raise Wrong(f"must be a string of at most {longest} characters")
        if choices and value not in choices:
            raise Wrong(f"must be one of {', '.join(map(repr, choices))}")
        return value
    return check


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Wrong("must be true or false")
    return value


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in ``value`` (iteratively), up to one past
    MAX_FIELD_DEPTH."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_FIELD_DEPTH:
                stack.extend((child, depth + 1)
                             for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def obj(value: Any) -> dict[str, Any]:
    """A JSON object, its contents checked by its reader (see the module's docstring)."""
    if not isinstance(value, dict):
        raise Wrong("must be a JSON object")
    if _depth(value) > MAX_FIELD_DEPTH:
        raise Wrong(f"nests deeper than {MAX_FIELD_DEPTH} levels")
    return value


def array(value: Any) -> list[Any]:
    """A JSON list, its entries checked by its reader."""
    if not isinstance(value, list) or len(value) > MAX_ITEMS:
        raise Wrong(f"must be a list of at most {MAX_ITEMS} entries")
    if _depth(value) > MAX_FIELD_DEPTH:
        raise Wrong(f"nests deeper than {MAX_FIELD_DEPTH} levels")
    return value


def list_of(entry: Check, shortest: int = 0, longest: int = MAX_ITEMS) -> Check:
    """A list of ``shortest`` to ``longest`` entries, each checked, as a tuple. A list of
    :func:`integer` entries is checked whole when it holds plain ints (a SPLIT's
    ``then``, a DISPATCH's items: hundreds of them), else entry by entry."""
    bounds = getattr(entry, "bounds", None)
    low, high = bounds if bounds is not None else (None, None)

    def check(value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list) or not shortest <= len(value) <= longest:
            raise Wrong(f"must be a list of {shortest} to {longest} entries")
        if bounds is not None and value and set(map(type, value)) == {int} \
                and (low is None or min(value) >= low) and (high is None or max(value) <= high):
            return tuple(value)  # (JSON's true and false are of type bool: not here)
        try:
            return tuple(entry(v) for v in value)
        except Wrong as exc:
            raise Wrong(f"entry: {exc}") from None
    return check


def counts(value: Any) -> dict[str, int]:
    """``{epoch: count}``: keys are epochs written as strings, values integers >= 0."""
    if not isinstance(value, dict) or len(value) > MAX_ITEMS:
        raise Wrong("must be a JSON object of epoch -> count")
    for key, count in value.items():
        if not key.lstrip("-").isdigit() or not is_int(count) or count < 0:
            raise Wrong(f"must map epochs to counts >= 0, has {key!r}: {count!r}")
    return value


def optional(check: Check) -> Check:
    """``check``, or null."""
    def maybe(value: Any) -> Any:
        return None if value is None else check(value)
    return maybe


def packed(value: Any) -> str:
    """A packed set of indices (zloader/lineage/intsets.py: base64 of a compressed bitmap)."""
    try:
        unpack(value)
    except ValueError as exc:
        raise Wrong(f"must be a packed set ({exc})") from None
    return str(value)


NAME = text()
INDEX = integer(0)
PASS_KEY = list_of(INDEX, 1, 64)
"""A pass key: the epoch, then one repetition index per repeat stage on workers."""


def fld(check: Check, default: Any = dataclasses.MISSING, *, wire: str | None = None,
        omit: bool = False) -> Any:
    """A record's field: how it is checked, its name on the wire, and whether its
    default is left out of the body (see the module's docstring)."""
    metadata = {"check": check, "wire": wire, "omit": omit}
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults: use a tuple or None")
    return dataclasses.field(default=default, metadata=metadata)


# --- records ------------------------------------------------------------------------------

R = TypeVar("R", bound="Body")
@dataclass(kw_only=True, eq=False, repr=False)
class Body(FrozenByFields):
    """A JSON object of checked fields, declared with :func:`fld`: decoded field by field
    (:meth:`from_body`) and encoded back (:meth:`to_body`). :class:`Record` is a message's;
    the broker's journal events are others (zloader/broker/events.py). Each kind is a
    ``@dataclass(kw_only=True, eq=False, repr=False)``: its ``__eq__``, ``__hash__``,
    ``__repr__`` and frozenness are :class:`~zloader._byfields.FrozenByFields`'s, by the
    fields, not compiled for each kind at import; two bodies are equal when of one kind
    with equal fields."""

    _spec: ClassVar[tuple[tuple[str, str, Check, Any, bool], ...]] = ()

    @classmethod
    def label(cls) -> str:
        """What an error calls a body of this kind."""
        return cls.__name__

    @classmethod
    def spec(cls) -> tuple[tuple[str, str, Check, Any, bool], ...]:
        """``(attribute, wire name, check, default, omit)`` per field, in wire order (a
        field declared without :func:`fld`, such as ``Register.blob``, is not in the
        body)."""
        if "_spec" not in cls.__dict__:
            cls._spec = tuple(
                (f.name, f.metadata.get("wire") or f.name, f.metadata["check"], f.default,
                 f.metadata["omit"]) for f in dataclasses.fields(cls) if "check" in f.metadata)
        return cls._spec

    @classmethod
    def from_body(cls: type[R], body: Mapping[str, Any]) -> R:
        """The record a body holds.

        Raises:
            ProtocolError: a field is missing, of the wrong type, out of range or of the
                wrong shape (the message names the command and the field).
        """
        values = {}
        for name, wire, check, default, _ in cls.spec():
            if wire not in body:
                if default is dataclasses.MISSING:
                    raise ProtocolError(f"{cls.label()}: field {wire!r} is missing")
                values[name] = default
                continue
            value = body[wire]
            try:
                values[name] = check(value)
            except Wrong as exc:
                raise ProtocolError(_refusal(cls.label(), wire, exc, value)) from None
        record = cls.checked(values)
        post_init = getattr(record, "__post_init__", None)
        if post_init is not None:
            post_init()
        return record

    @classmethod
    def checked(cls: type[R], values: dict[str, Any]) -> R:
        """The record of ``values`` (every field of the body; one declared without
        :func:`fld` reads as its default), known good: checked field by field, or made by
        this process. Built without the dataclass's ``__init__``, which sets each field
        through FrozenByFields' ``__setattr__`` (about 1 us a field): for the records made
        or decoded once per record or per split, and for every body decoded
        (:meth:`from_body`)."""
        record = object.__new__(cls)
        record.__dict__.update(values)
        return record

    def to_body(self) -> dict[str, Any]:
        """The body of this record, as docs/protocol.md gives it."""
        body = {}
        values = self.__dict__  # (a field left out of ``checked``'s values: its default)
        for name, wire, _, default, omit in self.spec():
            value = values[name] if name in values else getattr(self, name)
            if omit and value == default:
                continue
            body[wire] = value if value.__class__ in _AS_IS else _plain(value)
        return body


@dataclass(kw_only=True, eq=False, repr=False)
class Record(Body):
    """A message body; subclasses are the records of one command each."""

    COMMAND: ClassVar[Command]

    @classmethod
    def label(cls) -> str:
        return cls.COMMAND.name


def _refusal(label: str, wire: str, exc: Wrong, value: Any) -> str:
    """``COMMAND: field 'name' <what is wrong>, got <value>``; a nested field is named
    ``outer.inner``."""
    if exc.field is None:
        return f"{label}: field {wire!r} {exc}, got {short(value)}"
    name = f"{wire}.{exc.field}"
    if exc.value is _ABSENT:
        return f"{label}: field {name!r} {exc}"
    return f"{label}: field {name!r} {exc}, got {short(exc.value)}"


_AS_IS = frozenset({str, int, float, bool, type(None), dict, list, bytes})
"""The types a body holds as they are (most fields: checked without a lookup)."""


def _plain(value: Any) -> Any:
    """``value`` as JSON has it: the tuples a record holds for lists become lists again,
    a nested record (``JobOptions``) its body."""
    if value.__class__ in _AS_IS:
        return value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    to_body = getattr(value, "to_body", None)
    return to_body() if callable(to_body) else value


def short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."
