"""Fingerprints: stable hashes of pipeline definitions, for sharing work between trainers.

Two pipelines with equal fingerprints must produce the same elements, because the service
feeds one pipeline's output to every trainer that asks with that fingerprint. The rules:

What is hashed (recursively, with cycles handled by back-references):

* Plain values: ``None``, ``bool``, ``int``, ``float`` (exact bits), ``complex``, ``str``,
  ``bytes``; ``tuple``/``list``/``dict`` in order; ``set``/``frozenset`` order-free; numpy
  arrays by dtype, shape and bytes; numpy scalars by dtype and bytes.
* User functions (and lambdas): their bytecode, constants (nested code included), names,
  argument counts and flags; default and keyword-default values; closure values; every
  referenced global (looked up in the function's globals by the names its code loads,
  stores or deletes as globals, nested code included: attribute names such as
  ``s.upper()``'s are no global lookups); function attributes (``__wrapped__`` and the
  like).
* ``functools.partial``: the function, positional arguments and keyword arguments (keyword
  order does not matter). Bound methods: the function and the instance.
* User classes: their bases and the contents of the class body (methods as functions).
  Instances and callable objects: their class and their state as reported by
  ``__reduce_ex__`` (for ordinary objects, the attribute dict, order-free).
* Library code, meaning a module that lives in the standard library or in an installed,
  non-editable distribution under site-packages: functions, classes and modules by their
  qualified name plus the Python version or the distribution's version. Library objects
  (instances) are hashed by state, like any object.
* User modules (not library code) referenced from a function: the module's name and those
  of its attributes that the function's code names.
* ``torch.Tensor``: dtype, shape and bytes.

What is *not* hashed: memory addresses and object identity, file names, module names of
user code and line numbers (moving a function to another line or file does not change its
fingerprint), keyword-argument order, a stage's ``name=``. Function and class names *are*
hashed (code may look them up), so renaming one changes the fingerprint.

What makes a pipeline unshareable (with a :class:`~zloader.errors.FingerprintWarning`
naming the culprit, and a random fingerprint that matches nothing): any value whose state
cannot be captured soundly, such as locks, open files, sockets, generators, C-extension
functions outside an installed distribution, or objects whose ``__reduce_ex__`` fails;
nesting deeper than ``MAX_DEPTH``.

Limits, by design: state outside the process is not seen (a function that reads a file or an
environment variable hashes the same after the file or variable changes; ``from_files``
hashes its files' sizes and modification times for this reason); the fingerprint is taken
once, when first asked for, so values mutated afterwards are not seen; a library's code is
trusted to match its version number. A stage or source given ``version=`` is hashed by that
version instead of its functions and bulk data: use it to pin an identity the rules above
cannot see, or to skip hashing large in-memory data.
"""

from __future__ import annotations

import builtins
import dis
import functools
import itertools
import json
import marshal
import os
import struct
import sys
import sysconfig
import types
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from zloader import packed
from zloader._defaults import FINGERPRINT_MAX_DEPTH as MAX_DEPTH
from zloader._hash import sha256
from zloader._version import __version__
from zloader.errors import FingerprintWarning

__all__ = ["MAX_DEPTH", "Unhashable", "fingerprint", "global_names", "prefix_fingerprints"]

SCHEME = 2
"""Bumped whenever the hashing rules change, so old and new fingerprints never match."""
FLAT_MIN_ITEMS = 64
"""Lists and tuples this long, of atoms or of tuples of atoms, are hashed in one C pass."""
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})

_CLASS_DICT_SKIP = frozenset({
    "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__firstlineno__",
    "__static_attributes__", "__annotations__", "__slotnames__", "_abc_impl",
    "__abstractmethods__", "__parameters__", "__orig_bases__", "__protocol_attrs__",
    "__non_callable_proto_members__", "__callable_proto_members_only__",
})


class Unhashable(Exception):
    """A value cannot be fingerprinted soundly; ``culprit`` says which and why."""

    def __init__(self, culprit: str) -> None:
        super().__init__(culprit)
        self.culprit = culprit


def fingerprint(parts: Iterable[tuple[str, tuple[Any, ...]]]) -> str:
    """Hash a pipeline's parts to a hex string.

    Args:
        parts: ``(name, identity)`` for the source and each stage, in order; the name only
            labels error messages and is not hashed.

    Raises:
        Unhashable: part of an identity cannot be hashed soundly.
    """
    digests = list(prefix_fingerprints(parts))
    return digests[-1] if digests else _started().hexdigest()


def prefix_fingerprints(parts: Iterable[tuple[str, tuple[Any, ...]]]) -> Iterator[str]:
    """The fingerprint of each prefix of a pipeline's ``parts``, in turn: the first part
    alone, then with the second, and so on; the last is :func:`fingerprint`'s. Pipelines
    that begin with equal parts have equal prefix fingerprints that far (what trainers
    have in common).

    Raises:
        Unhashable: a part cannot be hashed soundly (after the prefixes before it).
    """
    hasher = _started()
    for name, identity in parts:
        hasher._path.append(name)
        hasher._emit(b"p", str(len(identity)).encode())
        for item in identity:
            hasher.feed(item)
        hasher._path.pop()
        yield hasher.snapshot()


def _started() -> _Hasher:
    """A hasher fed the scheme's header (every fingerprint begins with it)."""
    hasher = _Hasher()
    hasher.feed(("zloader-fingerprint", SCHEME, __version__, sys.version_info[:2]))
    return hasher


def warn_unshareable(culprit: str) -> None:
    """Emit the warning that says a pipeline will not be shared, and why."""
    warnings.warn(
        f"pipeline will not be shared: {culprit}. Give that stage or source version= to pin "
        "its identity, or move the value out of the pipeline's functions.",
        FingerprintWarning, stacklevel=4)


# --- library detection -------------------------------------------------------------------

@functools.cache
def _site_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths["purelib"], paths["platlib"]}
    try:
        import site
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except (AttributeError, ImportError):  # pragma: no cover - embedded interpreters
        pass
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


@functools.cache
def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib")})


@functools.cache
def _distributions() -> dict[str, list[str]]:
    import importlib.metadata  # (imported when a fingerprint first asks: 7 ms)

    return dict(importlib.metadata.packages_distributions())


@functools.cache
def _dist_version(dist_name: str) -> str | None:
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    direct = dist.read_text("direct_url.json")
    if direct:
        try:
            if json.loads(direct).get("dir_info", {}).get("editable"):
                return None  # code being edited: its version number says nothing
        except ValueError:
            return None
    return f"{dist.metadata['Name']}=={dist.version}"


@functools.cache
def library_version(module_name: str | None) -> str | None:
    """``"python-3.11"`` or ``"numpy==2.1.0"`` when ``module_name`` is library code, else None.

    A module is library code when it is built into the interpreter, lives under the
    standard library, or lives under site-packages in a distribution that is not an
    editable install. Everything else is user code and is hashed by content.
    """
    if not module_name:
        return None
    module = sys.modules.get(module_name)
    top = module_name.partition(".")[0]
    python = f"python-{sys.version_info[0]}.{sys.version_info[1]}"
    if top in sys.builtin_module_names or module_name == "builtins":
        return python
    path = getattr(module, "__file__", None)
    if not path:
        return None
    path = os.path.realpath(path)
    if path.startswith(_site_dirs()):
        versions = sorted(filter(None, (_dist_version(d) for d in _distributions().get(top, []))))
        return ";".join(versions) if versions else None
    if path.startswith(_stdlib_dirs()) and top in sys.stdlib_module_names:
        return python
    return None


@functools.lru_cache(maxsize=1 << 14)
def is_installed(path: str) -> bool:
    """Whether ``path`` lies in the standard library or a site-packages directory
    (remembered: a Loader asks it of every module loaded, a thousand and more with torch,
    and resolving each path's links takes lstat calls)."""
    path = os.path.realpath(path)
    return path.startswith(_site_dirs()) or path.startswith(_stdlib_dirs())


def _resolve(module_name: str, qualname: str) -> Any:
    if "<" in qualname:
        return None
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


# --- the hasher --------------------------------------------------------------------------

class _Hasher:
    """Feeds a canonical, typed byte stream of a value graph into SHA-256.

    Containers and objects are hashed Merkle-style: each gets its own digest, which its
    parent absorbs. An object met again (aliasing) contributes its digest again, so sharing
    one object or holding two equal copies hashes the same; only a true cycle (an object
    met inside itself) becomes a back-reference, to its depth on the current path.
    """

    def __init__(self) -> None:
        self._sha = sha256()
        self._done: dict[int, bytes] = {}
        self._active: dict[int, int] = {}
        self._alive: list[Any] = []  # keeps hashed objects alive so their ids stay unique
        self._path: list[str] = []

    def hexdigest(self) -> str:
        return self._sha.hexdigest()

    def snapshot(self) -> str:
        """The digest of what was fed so far; feeding may go on."""
        return self._sha.copy().hexdigest()

    def _emit(self, tag: bytes, payload: bytes | memoryview = b"") -> None:
        self._sha.update(tag + struct.pack("<Q", len(payload)))
        self._sha.update(payload)

    def _emit_chunks(self, tag: bytes, chunks: list[Any]) -> None:
        """As :meth:`_emit` of the chunks joined."""
        self._sha.update(tag + struct.pack("<Q", sum(len(c) for c in chunks)))
        for chunk in chunks:
            self._sha.update(chunk)

    def _fail(self, what: str) -> Unhashable:
        where = " > ".join(self._path) or "the pipeline"
        return Unhashable(f"{where} holds {what}")

    def feed(self, value: Any, label: str | None = None, names: Iterable[str] = ()) -> None:
        """Hash ``value``; ``label`` names it in error paths; ``names`` are the attribute
        names the referring code uses (for user modules)."""
        if label is not None:
            self._path.append(label)
        if len(self._path) > MAX_DEPTH:
            raise self._fail(f"values nested deeper than {MAX_DEPTH} levels")
        try:
            self._feed(value, names)
        finally:
            if label is not None:
                self._path.pop()

    def _feed(self, value: Any, names: Iterable[str]) -> None:
        kind = type(value)
        if value is None or kind is bool:
            self._emit(b"K", repr(value).encode())
        elif kind is int:
            self._emit(b"i", str(value).encode())
        elif kind is float:
            self._emit(b"f", value.hex().encode())
        elif kind is complex:
            self._emit(b"c", f"{value.real.hex()},{value.imag.hex()}".encode())
        elif kind is str:
            self._emit(b"s", value.encode("utf-8", "surrogatepass"))
        elif kind is bytes:
            self._emit(b"b", value)
        else:
            key = id(value)
            digest = self._done.get(key)
            if digest is None:
                depth = self._active.get(key)
                if depth is not None:
                    self._emit(b"R", str(len(self._active) - depth).encode())
                    return
                digest = self._digest(value, kind, names)
            self._emit(b"H", digest)

    def _digest(self, value: Any, kind: type, names: Iterable[str]) -> bytes:
        key = id(value)
        self._active[key] = len(self._active)
        outer, self._sha = self._sha, sha256()
        try:
            self._feed_object(value, kind, names)
            digest = self._sha.digest()
        finally:
            self._sha = outer
            del self._active[key]
        self._done[key] = digest
        self._alive.append(value)
        return digest

    def _digest_of_item(self, value: Any) -> bytes:
        outer, self._sha = self._sha, sha256()
        try:
            self.feed(value, "item")
            return self._sha.digest()
        finally:
            self._sha = outer

    def _feed_object(self, value: Any, kind: type, names: Iterable[str]) -> None:
        flat = _flat(value) if kind is tuple or kind is list else None
        if flat is not None:
            self._emit_chunks(b"F" if kind is tuple else b"G", flat)
        elif kind is tuple or kind is list:
            self._emit(b"T" if kind is tuple else b"L", str(len(value)).encode())
            for index, item in enumerate(value):
                self.feed(item, f"[{index}]")
        elif kind is dict:
            self._emit(b"D", str(len(value)).encode())
            for key, item in value.items():
                self.feed(key, "key")
                self.feed(item, f"[{key!r}]")
        elif kind is set or kind is frozenset:
            self._emit(b"S", str(len(value)).encode())
            digests = sorted(self._digest_of_item(item) for item in value)
            self._emit(b"s", b"".join(digests))
        elif isinstance(value, np.ndarray):
            self._feed_array(value)
        elif isinstance(value, np.generic):
            self._emit(b"n", value.dtype.str.encode())
            self._emit(b"d", value.tobytes())
        elif kind is types.FunctionType:
            self._feed_function(value)
        elif kind is types.CodeType:
            self._feed_code(value)
        elif kind is types.MethodType:
            self._emit(b"M")
            self.feed(value.__func__, "method")
            self.feed(value.__self__, "self")
        elif kind is functools.partial:
            self._emit(b"P")
            self.feed(value.func, "partial.func")
            self.feed(value.args, "partial.args")
            self.feed(sorted(value.keywords.items()), "partial.keywords")
        elif kind is types.ModuleType:
            self._feed_module(value, names)
        elif isinstance(value, type):
            self._feed_class(value)
        elif kind in (staticmethod, classmethod):
            self._emit(b"W", kind.__name__.encode())
            self.feed(value.__func__, kind.__name__)
        elif kind is property:
            self._emit(b"Y")
            self.feed((value.fget, value.fset, value.fdel), "property")
        elif kind in (types.BuiltinFunctionType, types.MethodWrapperType):
            self._feed_builtin(value)
        elif kind in (types.MethodDescriptorType, types.WrapperDescriptorType,
                      types.ClassMethodDescriptorType, types.GetSetDescriptorType,
                      types.MemberDescriptorType):
            self._emit(b"X", value.__name__.encode())
            self.feed(value.__objclass__, "descriptor class")
        elif kind.__module__.partition(".")[0] == "torch" and kind.__name__ in (
                "Tensor", "Parameter"):
            self._feed_tensor(value)
        else:
            self._feed_reduced(value, kind)

    def _feed_array(self, arr: np.ndarray) -> None:
        self._emit(b"A", f"{arr.dtype.str}|{arr.dtype}|{arr.shape}".encode())
        if arr.dtype.hasobject:
            self.feed(arr.tolist(), "array items")
            return
        self._emit(b"d", np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)

    def _feed_tensor(self, tensor: Any) -> None:
        torch = sys.modules["torch"]
        try:
            flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError) as exc:
            raise self._fail(f"a tensor that cannot be read ({exc})") from None
        self._emit(b"t", f"{tensor.dtype}|{tuple(tensor.shape)}|{tensor.requires_grad}".encode())
        self._emit(b"d", flat.data)

    def _feed_library(self, tag: bytes, module: str, qualname: str, version: str) -> None:
        self._emit(tag, f"{module}:{qualname}@{version}".encode())

    def _feed_function(self, fn: types.FunctionType) -> None:
        version = library_version(fn.__module__)
        if version is not None and _resolve(fn.__module__, fn.__qualname__) is fn:
            self._feed_library(b"l", fn.__module__, fn.__qualname__, version)
            return
        self._emit(b"F", fn.__qualname__.encode())  # code may look its own name up
        self.feed(fn.__code__, "code")
        self.feed(fn.__defaults__, "defaults")
        self.feed(fn.__kwdefaults__, "keyword defaults")
        cells = fn.__closure__ or ()
        for name, cell in zip(fn.__code__.co_freevars, cells, strict=True):
            try:
                contents = cell.cell_contents
            except ValueError:
                self._emit(b"e", name.encode())
                continue
            self._emit(b"v", name.encode())
            self.feed(contents, f"closure variable {name!r}")
        # Module attributes are looked up by every name the code uses (``m.scale``);
        # globals only by the names it looks up as globals (not ``s.upper()``'s).
        names = sorted(_code_names(fn.__code__))
        fn_globals = fn.__globals__
        for name in sorted(global_names(fn.__code__)):
            if name in fn_globals:
                self._emit(b"g", name.encode())
                self.feed(fn_globals[name], f"global {name!r}", names=names)
            elif hasattr(builtins, name):
                self._emit(b"B", name.encode())
        attributes = {k: v for k, v in vars(fn).items() if k != "__module__"}
        if attributes:
            self.feed(sorted(attributes.items()), "function attributes")

    def _feed_code(self, code: types.CodeType) -> None:
        self._emit(b"C", struct.pack("<5q", code.co_argcount, code.co_posonlyargcount,
                                     code.co_kwonlyargcount, code.co_flags, code.co_nlocals)
                   + code.co_name.encode())
        self._emit(b"d", code.co_code)
        self._emit(b"d", getattr(code, "co_exceptiontable", b""))
        self.feed((code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars),
                  "names")
        self.feed(code.co_consts, "constants")

    def _feed_module(self, module: types.ModuleType, names: Iterable[str]) -> None:
        version = library_version(module.__name__)
        if version is not None:
            self._feed_library(b"m", module.__name__, "", version)
            return
        self._emit(b"u")  # a user module's name is not part of its identity; its code is
        names = list(names)
        for name in names:
            if hasattr(module, name):
                self._emit(b"a", name.encode())
                self.feed(getattr(module, name), f"{module.__name__}.{name}", names=names)

    def _feed_class(self, cls: type) -> None:
        version = library_version(cls.__module__)
        if version is not None and _resolve(cls.__module__, cls.__qualname__) is cls:
            self._feed_library(b"k", cls.__module__, cls.__qualname__, version)
            return
        self._emit(b"Q", f"{cls.__qualname__}|{len(cls.__bases__)}".encode())
        for base in cls.__bases__:
            self.feed(base, f"base {base.__qualname__}")
        for name in sorted(vars(cls)):
            if name not in _CLASS_DICT_SKIP:
                self._emit(b"a", name.encode())
                self.feed(vars(cls)[name], f"{cls.__qualname__}.{name}")

    def _feed_builtin(self, fn: Any) -> None:
        owner = getattr(fn, "__self__", None)
        name = getattr(fn, "__qualname__", fn.__name__)
        if owner is None or isinstance(owner, types.ModuleType):
            module = getattr(fn, "__module__", None) or getattr(owner, "__name__", None)
            version = library_version(module)
            if version is None:
                raise self._fail(f"the compiled function {name} from {module}, outside any "
                                 "installed distribution")
            self._feed_library(b"c", module or "", name, version)
            return
        self._emit(b"o", fn.__name__.encode())
        self.feed(owner, f"{fn.__name__}.__self__")

    def _feed_reduced(self, value: Any, kind: type) -> None:
        module = getattr(value, "__module__", None)
        name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
        if isinstance(module, str) and isinstance(name, str):
            version = library_version(module)
            if version is not None and _resolve(module, name) is value:
                self._feed_library(b"G", module, name, version)  # e.g. a numpy ufunc
                return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                reduced = value.__reduce_ex__(4)
        except Exception as exc:
            raise self._fail(f"a {kind.__module__}.{kind.__qualname__} whose state cannot be "
                             f"captured ({type(exc).__name__}: {exc})") from None
        if isinstance(reduced, str):
            module = getattr(value, "__module__", None) or kind.__module__
            version = library_version(module)
            if version is None:
                raise self._fail(f"the object {module}.{reduced}, outside any installed "
                                 "distribution")
            self._feed_library(b"G", module, reduced, version)
            return
        if not isinstance(reduced, tuple) or len(reduced) < 2:
            raise self._fail(f"a {kind.__qualname__} with an unusual __reduce_ex__ result")
        self._emit(b"O", str(len(reduced)).encode())
        self.feed(kind, "type")
        self.feed(reduced[0], "constructor")
        self.feed(reduced[1], "arguments")
        if len(reduced) > 2:
            state = reduced[2]
            if type(state) is dict and all(type(k) is str for k in state):
                state = sorted(state.items())
            self.feed(state, "state")
        for position, label in ((3, "list items"), (4, "dict items")):
            if len(reduced) > position and reduced[position] is not None:
                self.feed(list(reduced[position]), label)


def _flat(seq: list[Any] | tuple[Any, ...]) -> list[Any] | None:
    """A canonical encoding of a long sequence of atoms, or of tuples of atoms (a dataset's
    ``samples``: a million ``(path, label)`` pairs), made in C, as chunks; None for any
    other sequence.

    Which sequences qualify depends on their content alone, so a value is always hashed the
    same way. ``marshal`` format 2 has no back-references (aliasing and string interning
    do not change its bytes) and no sets (whose order varies between processes). A list a
    Loader just packed for its workers is not marshalled again (zloader/packed.py).
    """
    if len(seq) < FLAT_MIN_ITEMS:
        return None
    chunks = packed.flat_chunks(seq)
    if chunks is not None:
        return chunks
    kinds = set(map(type, seq))
    if not kinds <= _ATOMS:
        if not kinds <= _ATOMS | {tuple}:
            return None
        inner = itertools.chain.from_iterable(x for x in seq if type(x) is tuple)
        if not set(map(type, inner)) <= _ATOMS:
            return None
    return [marshal.dumps(seq, 2)]


def _code_names(code: types.CodeType) -> set[str]:
    """Every name in ``code``'s and its nested code's ``co_names``: globals, attributes
    and imported modules alike."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


_GLOBAL_OPS = frozenset({
    "LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL",
    # class bodies and module-level code: the namespace first, then the globals
    "LOAD_NAME", "STORE_NAME", "DELETE_NAME", "LOAD_FROM_DICT_OR_GLOBALS",
    # ``import m`` inside a function: kept as a dependency when ``m`` is also a global
    "IMPORT_NAME",
})


def global_names(code: types.CodeType) -> set[str]:
    """The names ``code`` (nested code included: functions, comprehensions, class bodies)
    looks up in its globals. ``co_names`` also holds attribute names (``s.upper()``,
    ``d.items``) that are no global lookups; the instructions tell them apart, on every
    Python version (3.12's LOAD_ATTR doubles as LOAD_METHOD; 3.11's LOAD_GLOBAL carries a
    flag in its argument, which ``dis`` resolves to the name)."""
    names = {str(op.argval).partition(".")[0] for op in dis.get_instructions(code)
             if op.opname in _GLOBAL_OPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names
