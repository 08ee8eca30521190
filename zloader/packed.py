"""Large read-only lists packed out of Python objects, so that forked workers share them.

A forked worker that reads a list of a million ``(path, label)`` pairs writes each pair's
reference count, so every page of the list that it touches becomes its own copy: over an
epoch each worker ends up with a private copy of the dataset (pytorch/pytorch#13246). Before
it forks its workers, a Loader packs such lists into anonymous shared memory (:func:`plan`);
each worker, and only the worker, then reads the packed form through a
:class:`PackedSequence` that decodes one element per access, and never touches the list
again. The trainer's objects are left as they are. A worker that writes into a packed list
(a memo cache filled in ``__getitem__``) gets its own plain copy of it at the first write,
as a torch worker's write copies the pages it touches: nothing else sees the write.

What is packed (docs/pipeline.md, "Packed datasets"): an exact ``list`` or ``tuple`` of at
least ``PACK_MIN_ITEMS`` elements, each an atom (None, bool, int, float, complex, str,
bytes), a tuple of atoms (nested tuples too) or a dict of str keys to such values, held by
the pipeline's source (``from_items``' items, the file lists of the file sources, a
generator's splits, a ``from_torch`` dataset that is itself a list) or by an attribute of a
map-style dataset object (torchvision's ``samples``, ``imgs`` and ``targets``), or of a
torch dataset it holds (``Subset.dataset``). Every value must be of exactly one of those
types: marshal refuses a subclass (an ``IntEnum``, a ``StrEnum`` key, a named tuple) or,
for a ``bytes`` subclass or any other buffer, silently returns its base type, so a list
holding one anywhere is left as it is. Everything else is left alone.

Layout: lists of ints (or floats) only are one int64 (float64) array; any other packs each
element with ``marshal`` format 2 (no back-references, no code: the same bytes the
fingerprint hashes, see :func:`flat_chunks`) after an int64 offset table.
"""

from __future__ import annotations

import collections.abc
import contextlib
import itertools
import logging
import marshal
import mmap
import operator
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zloader._byfields import ByFields
from zloader._defaults import (
    PACK_CHUNK_ITEMS,
    PACK_DATASET_DEPTH,
    PACK_MAX_DEPTH,
    PACK_MIN_ITEMS,
    PACK_SAMPLE,
)

__all__ = ["PACK_MIN_ITEMS", "Found", "PackedSequence", "Swap", "Writer", "copied_bytes",
           "flat_chunks", "found", "install", "log_packed", "marshal_into", "marshal_offsets",
           "offered", "pack", "plan", "prepare"]

log = logging.getLogger("zloader.packed")

_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_PACKABLE = _ATOMS | {tuple, dict}
_MARSHAL_VERSION = 2  # no back-references: an element's bytes do not depend on the others
_loads = marshal.loads
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in at once, where it can
_HEADER: dict[type, bytes] = {list: b"[", tuple: b"("}  # marshal's type code of a list, a tuple


_WRITING = threading.Lock()
"""Held while a written :class:`PackedSequence` becomes its own list (two threads of one
worker writing at once must write into the same list)."""


class PackedSequence(collections.abc.MutableSequence):
    """A list or tuple whose elements live packed in shared memory.

    Indexing decodes one element afresh (equal to the packed one; a changed copy does not
    change the packed one); a slice is a list (or tuple) of elements. Compares equal to a
    list (tuple) with equal elements, and pickles as one.

    A packed list takes every write a list takes (an item or a slice set or deleted,
    ``append``, ``+=``, ``sort``...): the first one decodes it into this process's own
    plain list, which it reads and writes from then on, as a torch worker's first write
    copies the pages of the list it touches. The shared memory, and every other process's
    view, are unchanged. A packed tuple cannot be changed, as a tuple cannot. It is not a
    ``list`` (``isinstance`` says so), which it could only be by holding its elements in
    Python objects; ``pack_dataset=False`` leaves a dataset's lists as they are.
    """

    __slots__ = ("_blob", "_count", "_items", "_kind", "_memory", "_offsets", "_type",
                 "_values", "flat")

    def __init__(self, memory: mmap.mmap, count: int, kind: str, type_: type) -> None:
        self._memory = memory
        self._count = count
        self._kind = kind
        self._type = type_
        self._items: list[Any] | None = None  # this process's own list, once written
        self.flat = False  # marshalled, of atoms or of tuples of atoms (see flat_chunks)
        view = memoryview(memory)
        if kind == "marshal":
            table = 8 * (count + 1)
            self._offsets: Any = view[:table].cast("q")
            self._blob: Any = view[table:]
            self._values: Any = None
        else:
            self._offsets = self._blob = None
            self._values = view[:8 * count].cast(kind)  # type: ignore[call-overload]

    @property
    def nbytes(self) -> int:
        """The shared memory it takes."""
        return len(self._memory)

    @property
    def layout(self) -> tuple[int, str, type]:
        """``(count, kind, type)``: with its memory, what makes the same view again in
        another process (zloader/handoff.py)."""
        return self._count, self._kind, self._type

    def __len__(self) -> int:
        return self._count if self._items is None else len(self._items)

    def __getitem__(self, index: Any) -> Any:
        if type(index) is int and 0 <= index < self._count and self._items is None:
            offsets = self._offsets  # (most reads: kept short)
            if offsets is None:
                return self._values[index]
            return _loads(self._blob[offsets[index]:offsets[index + 1]])
        if self._items is not None:
            return self._items[index]
        if isinstance(index, slice):
            return self._type(map(self._get, range(*index.indices(self._count))))
        at = operator.index(index)
        if at < 0:
            at += self._count
        if not 0 <= at < self._count:
            raise IndexError(f"{self._type.__name__} index out of range")
        return self._get(at)

    def _get(self, at: int) -> Any:
        if self._values is not None:
            return self._values[at]
        offsets = self._offsets
        return _loads(self._blob[offsets[at]:offsets[at + 1]])

    def __iter__(self) -> Iterator[Any]:
        if self._items is not None:
            return iter(self._items)
        return map(self._get, range(self._count))

    # --- writes: into this process's own list (see the class docstring) -----------------

    def _own(self, what: str) -> list[Any]:
        """The list this process writes into, decoded from the packed one at the first
        write; a packed tuple raises the TypeError a tuple would."""
        items = self._items
        if items is None:
            if self._type is not list:
                raise TypeError(f"'{self._type.__name__}' object does not support {what}")
            with _WRITING:
                items = self._items
                if items is None:
                    items = self._items = list(map(self._get, range(self._count)))
        return items

    def __setitem__(self, index: Any, value: Any) -> None:
        self._own("item assignment")[index] = value

    def __delitem__(self, index: Any) -> None:
        del self._own("item deletion")[index]

    def insert(self, index: Any, value: Any) -> None:
        self._own("insert").insert(index, value)

    def append(self, value: Any) -> None:
        self._own("append").append(value)

    def extend(self, values: Iterable[Any]) -> None:
        items = self._own("extend")
        items.extend(items if values is self else values)

    def pop(self, index: Any = -1) -> Any:
        return self._own("pop").pop(index)

    def remove(self, value: Any) -> None:
        self._own("remove").remove(value)

    def clear(self) -> None:
        self._own("clear").clear()

    def reverse(self) -> None:
        self._own("reverse").reverse()

    def sort(self, *, key: Callable[[Any], Any] | None = None, reverse: bool = False) -> None:
        self._own("sort").sort(key=key, reverse=reverse)

    def __iadd__(self, values: Any) -> Any:
        if self._type is not list:  # a tuple's ``+=`` makes a new tuple (__add__)
            return NotImplemented
        self.extend(values)
        return self

    def __imul__(self, times: Any) -> Any:
        if self._type is not list:
            return NotImplemented
        items = self._own("repetition")
        items *= times  # (in place)
        return self

    # --- what makes a new list (tuple), as a list's operators do -----------------------

    def copy(self) -> list[Any]:
        return list(self)

    def _plain(self) -> Any:
        """A list (tuple) of the elements: this process's own list, once written."""
        items = self._items
        return items if items is not None else self._type(self)

    def __add__(self, other: Any) -> Any:
        if isinstance(other, PackedSequence):
            other = other._plain()
        if not isinstance(other, self._type):
            return NotImplemented
        return self._plain() + other

    def __radd__(self, other: Any) -> Any:
        if not isinstance(other, self._type):
            return NotImplemented
        return other + self._plain()

    def __mul__(self, times: Any) -> Any:
        if not hasattr(type(times), "__index__"):
            return NotImplemented
        return self._plain() * times

    __rmul__ = __mul__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (PackedSequence, self._type)):
            return NotImplemented
        if isinstance(other, PackedSequence) and other._type is not self._type:
            return False
        values: Any = other
        return len(values) == len(self) and all(map(operator.eq, self, values))

    def _ordered(self, compare: Callable[[Any, Any], bool], other: Any) -> Any:
        if isinstance(other, PackedSequence):
            other = other._plain()
        if not isinstance(other, self._type):
            return NotImplemented
        return compare(self._plain(), other)

    def __lt__(self, other: Any) -> Any:
        return self._ordered(operator.lt, other)

    def __le__(self, other: Any) -> Any:
        return self._ordered(operator.le, other)

    def __gt__(self, other: Any) -> Any:
        return self._ordered(operator.gt, other)

    def __ge__(self, other: Any) -> Any:
        return self._ordered(operator.ge, other)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (self._type, (list(self),))

    def __repr__(self) -> str:
        if self._items is not None:
            return (f"<PackedSequence: a list of {len(self._items)} elements, written in "
                    "this process: its own list now>")
        return (f"<PackedSequence: a {self._type.__name__} of {self._count} elements in "
                f"{self.nbytes / 2**20:.1f} MiB of shared memory>")


Writer = Callable[[Any, Callable[[int], mmap.mmap], int],
               "tuple[mmap.mmap, np.ndarray, int, bool] | None"]
"""The compiled core's :func:`marshal_into` (a caller above it picks it)."""


def pack(values: Any, allocate: Callable[[int], mmap.mmap] | None = None,
         writer: Writer | None = None) -> PackedSequence | None:
    """``values`` packed (in memory from ``allocate(size)``: anonymous shared memory by
    default), or None when it is not a list or tuple of at least ``PACK_MIN_ITEMS``
    elements that :func:`packable` accepts. ``writer``: the compiled core's
    :func:`marshal_into`, which sizes and writes the elements into the memory in C (1 M
    (path, label) pairs in a forked packer: 150-200 ms, against 245-335 ms marshalled whole,
    walked and copied; about 60 ms of it is the kernel making the memory's pages), or None
    (the checks by type size them). Where it refuses an element (bytes, and all that
    :func:`packable` refuses), the checks by type decide."""
    allocate = allocate or _shared
    kind = type(values)
    if (kind is not list and kind is not tuple) or len(values) < PACK_MIN_ITEMS:
        return None
    # (each element's type read only where needed: in a forked packer, the references
    # taken write every element's page, a third of packing a list of tuples)
    first = type(values[0])
    kinds = set(map(type, values)) if first is int or first is float else None
    if kinds == {int} or kinds == {float}:
        array = _numbers(values, np.float64 if kinds == {float} else np.int64)
        if array is not None:
            memory = allocate(array.nbytes)
            np.frombuffer(memory, array.dtype, len(array))[:] = array
            return PackedSequence(memory, len(values), array.dtype.char, kind)
    written = writer(values, allocate, PACK_MAX_DEPTH) if writer is not None else None
    if written is not None:
        memory, _, deepest, dicts = written
        view = PackedSequence(memory, len(values), "marshal", kind)
        view.flat = deepest <= 1 and not dicts
        return view
    if kinds is None:
        kinds = set(map(type, values))
    sizes = _sizes(values, kinds)  # (its checks take every element for plain data)
    if sizes is not None:
        # what the fingerprint marshals whole (flat_chunks): atoms, or tuples of atoms
        return _marshalled(values, kind, sizes, allocate, flat=type(values[0]) is not dict)
    seen: set[type] = set()
    levels = _levels(values, kinds, 0, seen)
    if levels is None:
        return None
    return _marshalled(values, kind, None, allocate, flat=levels <= 1 and dict not in seen)


def packable(values: Any) -> bool:
    """Whether every element of ``values`` is an atom, a tuple of such elements or a dict
    of str keys to them."""
    return _levels(values, set(map(type, values)), 0, set()) is not None


def _levels(items: Any, kinds: set[type], depth: int, seen: set[type]) -> int | None:
    """How many levels of tuples and dicts ``items`` (whose types are ``kinds``) hold
    atoms in (0: atoms only), or None when they hold anything else; ``seen`` gains the
    container types met."""
    if kinds <= _ATOMS:
        return depth
    if depth == PACK_MAX_DEPTH or not kinds <= _PACKABLE:
        return None
    seen |= kinds - _ATOMS
    inner: list[Any] = []
    if tuple in kinds:
        inner.extend(itertools.chain.from_iterable(x for x in items if type(x) is tuple))
    if dict in kinds:
        dicts = [x for x in items if type(x) is dict]
        if not set(map(type, itertools.chain.from_iterable(dicts))) <= {str}:
            return None
        inner.extend(itertools.chain.from_iterable(map(dict.values, dicts)))
    return _levels(inner, set(map(type, inner)), depth + 1, seen)


def _numbers(values: Any, dtype: Any) -> np.ndarray | None:
    try:
        return np.array(values, dtype)
    except OverflowError:  # an int beyond int64: marshal carries it
        return None


def _shared(size: int) -> mmap.mmap:
    """Anonymous shared memory of ``size`` bytes: a forked child maps the same pages, and
    reading them never copies one."""
    return mmap.mmap(-1, max(1, size), flags=mmap.MAP_SHARED | _POPULATE)


def _marshalled(values: Any, kind: type, sizes: np.ndarray | None,
                allocate: Callable[[int], mmap.mmap], flat: bool) -> PackedSequence | None:
    """``values`` marshalled one element after another, after their offset table: the
    whole list marshalled at once when ``sizes`` (:func:`_sizes`) gives each element's
    size (most datasets, in C), else element by element. None when marshal refuses an
    element: the checks before should have left it alone, and a list packing cannot take
    is read as it is, never an error."""
    try:
        return _marshalled_into_memory(values, kind, sizes, allocate, flat)
    except ValueError as exc:  # (marshal's "unmarshallable object")
        log.debug("left a %s of %d elements as it is: %s", kind.__name__, len(values), exc)
        return None


def _marshalled_into_memory(values: Any, kind: type, sizes: np.ndarray | None,
                            allocate: Callable[[int], mmap.mmap], flat: bool
                            ) -> PackedSequence:
    count = len(values)
    offsets = np.zeros(count + 1, np.int64)
    whole = marshal.dumps(values, _MARSHAL_VERSION) if sizes is not None else b""
    if sizes is not None and len(whole) - len(_header(values)) != int(sizes.sum()):
        sizes = _sizes(values, {type(values[0])}, ascii_only=False)  # a str not ASCII
    if sizes is not None and len(whole) - len(_header(values)) == int(sizes.sum()):
        np.cumsum(sizes, out=offsets[1:])
        blobs: list[Any] = [memoryview(whole)[len(_header(values)):]]
    else:
        blobs = []
        for start in range(0, count, PACK_CHUNK_ITEMS):  # (bounded temporaries)
            parts = list(map(marshal.dumps, values[start:start + PACK_CHUNK_ITEMS],
                             itertools.repeat(_MARSHAL_VERSION)))
            offsets[start + 1:start + 1 + len(parts)] = np.fromiter(
                map(len, parts), np.int64, len(parts))
            blobs.append(b"".join(parts))
        np.cumsum(offsets, out=offsets)
    view = PackedSequence(_into_memory(offsets, blobs, allocate), count, "marshal", kind)
    view.flat = flat
    return view


def _into_memory(offsets: np.ndarray, blobs: list[Any],
                 allocate: Callable[[int], mmap.mmap]) -> mmap.mmap:
    """Memory from ``allocate`` holding the table of ``offsets`` (int64s in this host's
    order, as :class:`PackedSequence` reads them: one more than the elements, the last
    their end), then the marshalled bytes ``blobs`` hold one after another."""
    table = offsets.nbytes
    memory = allocate(table + int(offsets[-1]))
    memory[:table] = offsets.tobytes()
    at = table
    for blob in blobs:
        memory[at:at + len(blob)] = blob
        at += len(blob)
    return memory


def marshal_into(values: list[Any] | tuple[Any, ...], allocate: Callable[[int], mmap.mmap],
                 limit: int) -> tuple[mmap.mmap, np.ndarray, int, bool] | None:
    """``values`` packed in marshal format 2 into memory from ``allocate(size)``: the table
    of the elements' offsets (see :func:`_into_memory`; from the end of the table), then
    the elements; the memory, those offsets, how many levels of tuples and dicts they
    nest (0: atoms only) and whether a dict is among them.
    None when one is not an exact atom other than bytes, a tuple or a dict of str keys of
    such, nested at most ``limit`` levels (what :func:`packable` takes, bytes aside:
    marshal writes any buffer as bytes). The compiled core's twin sizes the elements, then
    writes them into the memory, in C (and gives None as well when ``values`` changed in
    between); this one marshals the list whole and walks its bytes
    (:func:`marshal_offsets`), slower than the checks by type: it is not used for
    packing."""
    try:
        whole = marshal.dumps(values, _MARSHAL_VERSION)
    except ValueError:
        return None
    start = len(_header(values))
    found = marshal_offsets(whole, start, len(values), limit)
    if found is None:
        return None
    offsets, deepest, dicts = found
    return _into_memory(offsets, [memoryview(whole)[start:]], allocate), offsets, deepest, dicts


def marshal_offsets(whole: Any, start: int, count: int, limit: int
                    ) -> tuple[np.ndarray, int, bool] | None:
    """Where each of the ``count`` objects that marshal format 2 wrote one after another
    from ``start`` in ``whole`` starts, from ``start`` (``count + 1`` offsets, the last
    their end, which must be ``whole``'s), how many levels of tuples and dicts they nest
    (0: atoms only) and whether a dict is among them; None when one is not an exact atom
    other than bytes (marshal writes any buffer as bytes), a tuple or a dict of str keys
    of such, nested at most ``limit`` levels (what :func:`packable` takes, bytes aside).
    :func:`marshal_into`'s walk."""
    raw = memoryview(whole).cast("B")
    found = [0, False]  # (the deepest level, whether a dict was met)
    offsets = np.empty(count + 1, np.int64)
    at = start
    for k in range(count):
        offsets[k] = at - start
        at = _walk(raw, at, 0, limit, found)
        if at < 0:
            return None
    if at != len(raw):
        return None
    offsets[count] = at - start
    return offsets, int(found[0]), bool(found[1])


# The bytes after the type code of marshal format 2's fixed-size atoms, by code.
_FIXED_CODES = {ord("N"): 0, ord("T"): 0, ord("F"): 0, ord("i"): 4, ord("g"): 8, ord("y"): 16}


def _walk(raw: memoryview, at: int, depth: int, limit: int, found: list[Any]) -> int:
    """Where the object at ``at`` ends, or -1 (see :func:`marshal_offsets`)."""
    end = len(raw)
    if at >= end:
        return -1
    code, at = raw[at], at + 1
    fixed = _FIXED_CODES.get(code)
    if fixed is not None:
        return at + fixed if at + fixed <= end else -1
    if code == ord("{"):  # (its size is not written: a null code ends it)
        if depth >= limit:
            return -1
        found[0], found[1] = max(found[0], depth + 1), True
        while at < end and raw[at] != ord("0"):
            if raw[at] != ord("u"):
                return -1
            at = _walk(raw, at, depth + 1, limit, found)
            at = _walk(raw, at, depth + 1, limit, found) if at >= 0 else -1
            if at < 0:
                return -1
        return at + 1 if at < end else -1
    if at + 4 > end:
        return -1
    size, at = int.from_bytes(raw[at:at + 4], "little", signed=True), at + 4
    if code == ord("l"):  # (15-bit digits, the sign on their count)
        return at + 2 * abs(size) if at + 2 * abs(size) <= end else -1
    if code == ord("u"):
        return at + size if size >= 0 and at + size <= end else -1
    if code != ord("(") or depth >= limit or size < 0:
        return -1
    found[0] = max(found[0], depth + 1)
    for _ in range(size):
        at = _walk(raw, at, depth + 1, limit, found)
        if at < 0:
            return -1
    return at


def _header(values: list[Any] | tuple[Any, ...]) -> bytes:
    """What marshal writes before a list's (tuple's) elements: its type code and length."""
    return _HEADER[type(values)] + len(values).to_bytes(4, "little", signed=True)


# The bytes marshal format 2 writes for an atom of each fixed-size type (type code included).
_FIXED = {type(None): 1, bool: 1, float: 9, complex: 17}
_INT32 = (-(2**31), 2**31 - 1)  # ints in this range take 5 bytes, others more


def _sizes(values: Any, kinds: set[type], ascii_only: bool = True) -> np.ndarray | None:
    """Each element's size in marshal format 2, computed by column in C when every element
    has the shape of the first (an atom of one type, a tuple of atoms of fixed types, or a
    dict of the same str keys to atoms of fixed types); None otherwise (then each element
    is marshalled alone). ``kinds``: the elements' types. ``ascii_only``: a str's size is
    its length, as it is when every str is ASCII (the caller checks the total against
    marshal's)."""
    first = values[0]
    if type(first) is tuple:
        width = len(first)
        if kinds != {tuple} or set(map(len, values)) != {width}:
            return None
        columns = [list(map(operator.itemgetter(at), values)) for at in range(width)]
        parts = [_column_sizes(column, ascii_only) for column in columns]
        head = 5  # type code and length
    elif type(first) is dict:
        keys = tuple(first)
        # Every element's keys exact str, not only the first's: a StrEnum member equal to
        # one of them would pass the look-ups below, then fail to marshal.
        if kinds != {dict} or set(map(len, values)) != {len(keys)} \
                or not set(map(type, itertools.chain.from_iterable(values))) <= {str}:
            return None
        try:  # (as many keys as the first's, and each of them: the same keys)
            columns = [list(map(operator.itemgetter(k), values)) for k in keys]
        except KeyError:
            return None
        parts = [_column_sizes(column, ascii_only) for column in columns]
        # the type code, the closing null, and the keys (str, the same in every element)
        head = 2 + sum(5 + len(k.encode("utf-8", "surrogatepass")) for k in keys)
    elif len(kinds) == 1:
        return _column_sizes(values, ascii_only)
    else:
        return None
    total = np.full(len(values), head, np.int64)
    for part in parts:
        if part is None:
            return None
        total += part
    return total


def _column_sizes(column: Any, ascii_only: bool) -> np.ndarray | None:
    """The marshal sizes of ``column``'s atoms, all of one type; None otherwise."""
    kinds = set(map(type, column))
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    count = len(column)
    if kind in _FIXED:
        return np.full(count, _FIXED[kind], np.int64)
    if kind is int:
        numbers = _numbers(column, np.int64)
        if numbers is None or (count and (numbers.min() < _INT32[0]
                                          or numbers.max() > _INT32[1])):
            return None
        return np.full(count, 5, np.int64)
    if kind is bytes:
        return np.fromiter(map(len, column), np.int64, count) + 5
    if kind is str:
        if ascii_only:
            return np.fromiter(map(len, column), np.int64, count) + 5
        encode = operator.methodcaller("encode", "utf-8", "surrogatepass")
        return np.fromiter(map(len, map(encode, column)), np.int64, count) + 5
    return None


# --- which lists a Loader packs, and the swap in each forked worker -----------------------

@dataclass(eq=False, repr=False)
class Swap(ByFields):
    """In a forked worker, ``owner.__dict__[name]`` (``old`` in the trainer) becomes
    ``view``."""

    owner: Any = field(repr=False)
    name: str
    old: Any = field(repr=False)
    view: PackedSequence
    where: str


@dataclass(eq=False, repr=False)
class Found(ByFields):
    """A list (or tuple) a forked worker would read packed: ``owner.__dict__[name]``."""

    owner: Any = field(repr=False)
    name: str
    values: Any = field(repr=False)
    where: str


def copied_bytes(lists: list[Found]) -> int:
    """About how many bytes of objects a forked worker reading every element of ``lists``
    copies (reading an object writes its reference count: its page is copied), from
    ``PACK_SAMPLE`` elements of each, evenly spaced."""
    total = 0
    for each in lists:
        values = each.values
        if not len(values):
            continue
        step = max(1, len(values) // PACK_SAMPLE)
        sample = [values[at] for at in range(0, len(values), step)][:PACK_SAMPLE]
        total += len(values) * sum(map(_object_bytes, sample)) // len(sample)
    return total


def _object_bytes(value: Any, depth: int = 0) -> int:
    """The bytes of ``value`` and of the tuples, dicts and atoms it holds (a few levels)."""
    size = sys.getsizeof(value)
    if depth < PACK_MAX_DEPTH and type(value) is tuple:
        size += sum(_object_bytes(v, depth + 1) for v in value)
    elif depth < PACK_MAX_DEPTH and type(value) is dict:
        size += sum(_object_bytes(k, depth + 1) + _object_bytes(v, depth + 1)
                    for k, v in value.items())
    return size


def found(source: Any) -> list[Found]:
    """The large lists of ``source`` (a pipeline's source) that forked workers would read
    packed: its own list fields, and the attributes of the map-style dataset it reads (see
    the module docstring), not yet packed or checked (:func:`pack` may leave one)."""
    lists: list[Found] = []
    seen: set[int] = set()
    for reader in source.readers():  # (a mix's inputs: each of them)
        _visit(reader, type(reader).__name__, lists, seen, 0)
    return lists


def plan(source: Any, writer: Writer | None = None) -> list[Swap]:
    """The swaps that keep a forked worker off the large lists of ``source``
    (:func:`found`), packed now (``writer``: see :func:`pack`). Logs at debug level what was
    packed and what was left."""
    swaps: list[Swap] = []
    packed: dict[int, PackedSequence | None] = {}
    for each in found(source):
        view = _packed_once(each.values, packed, each.where, writer)
        if view is not None:
            swaps.append(Swap(each.owner, each.name, each.values, view, each.where))
    return swaps


def prepare(pipeline: Any, writer: Writer | None = None) -> list[Swap]:
    """The swaps for ``pipeline``'s forked workers (:func:`plan`), its fingerprint taken
    meanwhile from the packed bytes: the lists are marshalled once."""
    swaps = plan(pipeline.source, writer)
    with offered(swaps):
        pipeline.fingerprint  # noqa: B018 (computed now, and kept by the pipeline)
    return swaps


def _visit(owner: Any, where: str, lists: list[Found], seen: set[int], depth: int) -> None:
    if id(owner) in seen:
        return
    seen.add(id(owner))
    state = getattr(owner, "__dict__", None)
    if type(state) is not dict:
        return
    for name, value in list(state.items()):
        kind = type(value)
        if kind is list or kind is tuple:
            if len(value) >= PACK_MIN_ITEMS:
                lists.append(Found(owner, name, value, f"{where}.{name}"))
                continue
            if depth < PACK_DATASET_DEPTH:  # ConcatDataset.datasets
                for index, item in enumerate(value):
                    if _is_dataset(item):
                        _visit(item, f"{where}.{name}[{index}]", lists, seen, depth + 1)
        elif depth < PACK_DATASET_DEPTH and _is_dataset(value):
            _visit(value, f"{where}.{name}", lists, seen, depth + 1)


def _packed_once(value: Any, packed: dict[int, PackedSequence | None],
                 where: str, writer: Writer | None) -> PackedSequence | None:
    """``value`` packed, once however many attributes hold it (``imgs`` is ``samples``)."""
    if id(value) not in packed:
        packed[id(value)] = pack(value, writer=writer)
        log_packed(packed[id(value)], value, where)
    return packed[id(value)]


def log_packed(view: PackedSequence | None, value: Any, where: str) -> None:
    """Log at debug level that ``value`` (at ``where``) was packed into ``view``, or left."""
    if view is None:
        log.debug("left %s as it is (%d elements): not only atoms, tuples and dicts of "
                  "atoms", where, len(value))
    else:
        log.debug("packed %s: %d elements in %.1f MiB of shared memory", where,
                  len(value), view.nbytes / 2**20)


def _is_dataset(value: Any) -> bool:
    """Whether ``value`` is a torch ``Dataset`` (by its classes' modules: torch is not
    imported here), whose attributes are looked into; other objects held by a dataset
    (a library's, say) are left as they are."""
    return not isinstance(value, type) and any(
        cls.__module__.startswith("torch.utils.data") for cls in type(value).__mro__[1:])


_KEPT: list[Any] = []
"""In a forked worker: the lists a swap replaced. Kept referenced, so that freeing them
does not write to (and so copy) every page they hold."""


def install(swaps: list[Swap]) -> None:
    """In a forked worker: put each swap's view in place of its list."""
    for swap in swaps:
        _KEPT.append(swap.old)
        swap.owner.__dict__[swap.name] = swap.view


# --- the fingerprint hashes the packed bytes instead of marshalling the list again --------

_OFFERED: dict[int, tuple[Any, PackedSequence]] = {}


@contextlib.contextmanager
def offered(swaps: list[Swap]) -> Iterator[None]:
    """Within: :func:`flat_chunks` answers for the lists ``swaps`` packed."""
    for swap in swaps:
        if swap.view.flat:
            _OFFERED[id(swap.old)] = (swap.old, swap.view)
    try:
        yield
    finally:
        _OFFERED.clear()


def flat_chunks(values: list[Any] | tuple[Any, ...]) -> list[Any] | None:
    """``marshal.dumps(values, 2)`` as chunks, from the packed form of ``values`` while it
    is offered (see :func:`offered`), or None."""
    entry = _OFFERED.get(id(values))
    if entry is None or entry[0] is not values:
        return None
    view = entry[1]
    return [_header(values), view._blob[:view._offsets[view._count]]]

