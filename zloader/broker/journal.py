"""The broker's journal: its state changes, appended to a file before they are acknowledged.

``zloader-broker --work-dir DIR`` keeps ``DIR/journal.jsonl`` (one JSON object per line) and
each job's pipeline in ``DIR/pipelines/<job>.pickle``. A broker started again on the same
work dir (after a crash or a SIGKILL) replays the journal into its state: its jobs, which
worker runs which task, the splits handed out and finished, the epochs started. Workers and
consumers reconnect by themselves and carry on with the job and task they had.

Each line is written and flushed before the messages that follow from it are sent, so a
killed process loses nothing it acknowledged; an operating-system crash may lose the last
lines (they are not fsync'ed). When a job is collected the journal is rewritten without
it, so it does not grow without bound.

The first line names the journal's schema version, ``{"e": "journal", "version": 3}``
(:data:`VERSION`; a journal from before versions has none and is of version 1). A
broker refuses a journal of a version it does not read (:class:`JournalVersionError`,
naming the work dir) rather than misread it. Version 2: a job's ``options`` are its whole
``JobOptions`` (zloader/options.py; a shared job's window in ``options.share``, no
``share`` event). Version 3: each line ends with its sequence number ``n`` (one more than
the line before it, across compactions: a compacted journal's first line has a number
above every line it replaces) and ``c``, the CRC-32 of the line up to and with ``n``
(:func:`line_of`). Version 4: a job's options hold ``shards`` (a deterministic job's
fixed shards; a job of a version 3 journal reads as 0, as it ran). Version 5: a shared
job's prefixes and branches, and its last worker's splits kept (``orphan``, ``adopted``).
Version 6: ``bye``, what a consumer that left an exactly-once job had yielded of an epoch. A
version 2 journal is still read (in file order, without those checks), versions 3 to 5 as
they are, and any of them is rewritten as the current version once restored.

Replay trusts nothing it reads: a torn line, one that is not UTF-8 JSON, one whose
checksum does not hold or that has none, one older than the compacted snapshot it
follows (a number below the first line's), a second line with the same number, or an
event whose fields are missing or of the wrong type (zloader/broker/events.py: one
record per kind, each field checked) is skipped, and its line number kept in
:attr:`Journal.skipped` (its kind counted in :attr:`Journal.skipped_kinds`) for one
warning. Lines out of order are replayed in the order of their numbers (counted in
:attr:`Journal.reordered`). A journal whose last line was torn (no newline: a broker
killed while writing it) is cut back to its last whole line when opened, so the next
line does not run on from the torn one (:attr:`Journal.torn`, logged).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pathlib
import re
import stat
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import IO, Any

from zloader.errors import ZloaderError
from zloader.transport.keys import unsafe_directory

__all__ = ["READS", "VERSION", "Journal", "JournalVersionError", "WorkDirError",
           "branch_file", "line_of", "work_dir"]

log = logging.getLogger("zloader.broker")

VERSION = 7
"""The schema of the events (zloader/broker/events.py) and of the lines that hold them;
bump it when an event or a line changes shape or meaning."""

READS = (2, 3, 4, 5, 6, VERSION)
"""The versions a broker restores (an older one is rewritten as :data:`VERSION`)."""

_STAMP = re.compile(rb',"n":(0|[1-9][0-9]{0,18}),"c":"([0-9a-f]{8})"\}')
"""A version 3 line's end: its sequence number and the CRC-32 of the line up to it."""


def line_of(event: dict[str, Any], number: int) -> bytes:
    """The journal line (version 3) that holds ``event`` as line number ``number``:
    ``{...event, "n": number, "c": "<CRC-32 of the line up to and with n>"}``."""
    body = json.dumps({**event, "n": number}, separators=(",", ":")).encode()
    return body[:-1] + b',"c":"%08x"}\n' % zlib.crc32(body)


def _stamp(line: bytes) -> int | None:
    """A version 3 line's sequence number, if its checksum holds."""
    body = line[:-1] if line.endswith(b"\n") else line
    at = body.rfind(b',"n":')
    match = _STAMP.fullmatch(body, at) if at > 0 else None
    if match is None or zlib.crc32(body[:match.start(2) - 6] + b"}") != int(match[2], 16):
        return None
    return int(match[1])


def _unstamped(line: bytes) -> str:
    """Why a line has no sequence number that holds: the kind of line it is."""
    if _STAMP.search(line):
        return "a wrong checksum"
    try:
        event = json.loads(line)
    except Exception:  # not UTF-8, not JSON, nested too deep
        event = None
    return "no sequence number and checksum" if _is_event(event) else _NOT_AN_EVENT


_NOT_AN_EVENT = "not a UTF-8 JSON event (torn or corrupt)"


def _is_event(line: Any) -> bool:
    """Whether a parsed line is shaped as an event: an object naming its kind (``e``);
    what each kind holds is the broker's to check (zloader/broker/events.py)."""
    return isinstance(line, dict) and isinstance(line.get("e"), str)


def _version_line(line: Any) -> bool:
    """Whether a parsed line is the version line, ``{"e": "journal", "version": N}``."""
    version = line.get("version") if isinstance(line, dict) else None
    return (_is_event(line) and line["e"] == "journal" and isinstance(version, int)
            and not isinstance(version, bool) and version >= 0)


class WorkDirError(ZloaderError, PermissionError):
    """The work dir is one another local user could write to: refused."""



def branch_file(job: str, branch: int) -> str:
    """The name a shared job's branch's pipeline is kept by (:meth:`Journal.save_pipeline`)."""
    return f"{job}.branch{branch}"

class JournalVersionError(ZloaderError, ValueError):
    """The work dir's journal has a schema version this broker does not know: refused."""


def work_dir(path: str | os.PathLike[str]) -> pathlib.Path:
    """The broker's work directory ``path``, created (mode 0700) if missing, and checked.

    The pipelines kept there are code the broker's workers run after a restart, so a
    directory (or its ``pipelines/``) that another user owns or may write to is refused.

    Raises:
        WorkDirError: it belongs to another user, or group or others may write to it.
    """
    root = pathlib.Path(path).expanduser()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    root = root.resolve()
    pipelines = root / "pipelines"
    for directory in (root, pipelines):
        what = "work dir" if directory == root else "work dir's pipelines directory"
        problem = unsafe_directory(directory, what) if directory.exists() else None
        if problem is not None:
            raise WorkDirError(f"{problem} (zloader-broker --work-dir)")
    pipelines.mkdir(mode=0o700, exist_ok=True)
    return root


class Journal:
    """Append-only event log in a work directory (see :func:`work_dir` for its checks).

    A write that fails (a full disk: ``ENOSPC``) is undone (the file is cut back to its
    last whole line) and stops the journal: :attr:`failure` says why, naming the work dir,
    and no later event is written, so the file stays a consistent prefix of the broker's
    history. :meth:`record` and :meth:`save_pipeline` then return False; the broker tells
    the consumers of the jobs concerned (``zloader.broker.history.journal_errors``).

    Raises:
        WorkDirError: the directory, or a journal file in it, is another user's.
        JournalVersionError: the journal is of a schema version not in :data:`READS`.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.root = work_dir(directory)
        self.path = self.root / "journal.jsonl"
        self.lines = 0
        self.skipped: list[int] = []  # numbers of the lines the last replay skipped
        self.skipped_kinds: Counter[str] = Counter()  # why, counted by kind
        self.reordered = 0  # lines the last replay took out of their place in the file
        self.missing = 0  # sequence numbers the last replay did not find (lines lost)
        self.torn = 0  # bytes of a torn last line cut when it was opened
        self.failure: str | None = None  # why writing stopped, once it has
        self.version = VERSION  # that of the journal as found (READS), until rewritten
        self._next = 1  # the sequence number of the next line
        self._fd = self._open()
        try:
            self._check_version()
        except JournalVersionError:
            self.close()
            raise

    def _check_version(self) -> None:
        """Start a new journal with its version line; refuse one of a version it does not
        read; cut a torn last line."""
        info = os.fstat(self._fd)
        if not stat.S_ISREG(info.st_mode):
            return  # a device or a pipe: nothing to read back
        if info.st_size > 0:
            version, top = self._scan()
            if version is not None and version not in READS:
                raise JournalVersionError(
                    f"the journal in work dir {self.root} is of version {version}; "
                    f"this zloader reads versions {', '.join(map(str, READS))}: run the zloader "
                    "that wrote it, or give zloader-broker another --work-dir (or move that "
                    "journal away to start its jobs over)")
            self.version = version or VERSION
            if self._trim(info.st_size):
                top = self._scan()[1]  # the torn line may have been whole but its newline
            self._next = top + 1
        if os.fstat(self._fd).st_size == 0:
            self.version = VERSION
            self.record(_HEADER)

    def _scan(self) -> tuple[int | None, int]:
        """The version its first version line names (a torn or corrupt line may come
        before it; 1 for a journal of events without one, from before versions; None for
        one with no event it can read), and the highest sequence number of a line whose
        checksum holds (0: none)."""
        version: int | None = None
        events = False
        top = 0
        with open(self.path, "rb") as f:
            for line in f:
                top = max(top, _stamp(line) or 0)
                if version is not None:
                    continue
                try:
                    event = json.loads(line)
                except Exception:  # a torn or corrupt line: replay skips it
                    continue
                if _version_line(event):
                    version = int(event["version"])
                events = events or _is_event(event)
        return (version if version is not None else 1 if events else None), top

    def _trim(self, size: int) -> bool:
        """Cut a torn last line (no newline: a broker killed while writing it) back to the
        last whole line, before anything is appended: the next line must not run on from
        it (the two would be one corrupt line, skipped by the next replay). Whether it
        cut one."""
        with open(self.path, "rb") as f:
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return False
            keep, end = 0, size
            while end > 0 and not keep:
                start = max(0, end - 65536)
                f.seek(start)
                at = f.read(end - start).rfind(b"\n")
                keep = start + at + 1 if at >= 0 else 0
                end = start
        os.ftruncate(self._fd, keep)
        self.torn = size - keep
        log.warning("journal %s: its last line was torn (%d bytes with no newline at the "
                    "end: the broker was killed while writing it); cut back to its last "
                    "whole line, which is where the broker resumes", self.path, self.torn)
        return True

    def _open(self) -> int:
        """The journal opened to append, mode 0600 (made so if it was not)."""
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        info = os.fstat(descriptor)
        if stat.S_ISREG(info.st_mode):
            if info.st_uid != os.geteuid():
                os.close(descriptor)
                raise WorkDirError(f"journal {self.path} belongs to uid {info.st_uid}, not "
                                   f"to uid {os.geteuid()} who runs this broker: remove it "
                                   "or give the broker a work dir of its own")
            if stat.S_IMODE(info.st_mode) != 0o600:
                os.fchmod(descriptor, 0o600)
        return descriptor

    def skip(self, number: int, why: str) -> None:
        """Note that replay skipped line ``number``, and why (a kind, counted)."""
        self.skipped.append(number)
        self.skipped_kinds[why] += 1

    def replay(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """The events recorded so far (JSON objects naming their kind), in the order of
        their sequence numbers, with their line numbers; the reader checks each one and
        notes one it cannot apply with :meth:`skip`.

        Every other line (torn, not UTF-8, not JSON, not an object with a kind ``e``, a
        version line of another version; in a version 3 journal also one whose checksum
        does not hold or that has none, one older than the first line (the snapshot a
        compaction wrote), a second one with a number already read) is skipped with
        :meth:`skip`. Lines out of their place in the file are counted in
        :attr:`reordered`, numbers not found in :attr:`missing`. A version 2 journal is
        read in file order. A journal that is not a regular file (a device, a pipe) holds
        nothing to replay.
        """
        self.skipped = []
        self.skipped_kinds = Counter()
        self.reordered = self.missing = 0
        if not self.path.is_file():
            return
        lines = self._in_order() if self.version >= 3 else self._in_file_order()
        for number, line in lines:
            try:
                event = json.loads(line)
            except Exception:  # not UTF-8, not JSON, nested too deep: skipped
                event = None
            if isinstance(event, dict) and self.version >= 3:
                event.pop("n", None)
                event.pop("c", None)
            if not _is_event(event):
                self.skip(number, _NOT_AN_EVENT)
                continue
            if event["e"] == "journal":  # the version line, checked when opened
                if not _version_line(event) or event["version"] != self.version:
                    self.skip(number, "a version line of another version")
                continue
            self.lines += 1
            yield number, event

    def _in_file_order(self) -> Iterator[tuple[int, bytes]]:
        """Each line with its number, as the file holds them (version 2: no stamps)."""
        with open(self.path, "rb") as f:
            yield from enumerate(f, 1)

    def _in_order(self) -> Iterator[tuple[int, bytes]]:
        """Each line whose stamp holds, with its line number, in the order of the sequence
        numbers from the first line's (the snapshot's) on; the others skipped."""
        stamped: list[tuple[int, int, bytes]] = []  # (sequence number, line number, line)
        first: int | None = None  # the version line's number: where the snapshot starts
        with open(self.path, "rb") as f:
            for number, line in enumerate(f, 1):
                sequence = _stamp(line)
                if sequence is None:
                    self.skip(number, _unstamped(line))
                    continue
                if first is None and line.startswith(b'{"e":"journal",') \
                        and _version_line(json.loads(line)):
                    first = sequence
                stamped.append((sequence, number, line))
        stamped.sort()  # by number, then place (of two lines with one number: the first)
        last: int | None = None
        furthest = 0  # the furthest line replayed yet
        for sequence, number, line in stamped:
            if first is not None and sequence < first:
                self.skip(number, "older than the snapshot it follows")
                continue
            if sequence == last:
                self.skip(number, "a sequence number read already")
                continue
            if last is not None:
                self.missing += sequence - last - 1
            last = sequence
            if number < furthest:
                self.reordered += 1
            furthest = max(furthest, number)
            yield number, line

    def record(self, event: dict[str, Any]) -> bool:
        """Append ``event`` as one line; False if it was not written (see :attr:`failure`)."""
        if self.failure is not None:
            return False
        line = line_of(event, self._next)
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            with contextlib.suppress(OSError):  # a device or a pipe cannot be cut back
                os.ftruncate(self._fd, end)
            self._fail(exc)
            return False
        self._next += 1
        self.lines += 1
        return True

    def _fail(self, exc: OSError) -> None:
        """Stop writing: ``exc`` made a write fail."""
        code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        self.failure = (f"the broker cannot write to its work dir {self.root} "
                        f"({exc.strerror or exc}, {code}): its journal is incomplete, so a "
                        "restarted broker could not resume its jobs; free space there (or "
                        "give zloader-broker another --work-dir) and restart the broker")
        log.error("%s", self.failure)

    def save_pipeline(self, job: str, blob: bytes) -> bool:
        """Keep a job's pickled pipeline (mode 0600); False if it was not written."""
        if self.failure is not None:
            return False
        path = self.root / "pipelines" / f"{job}.pickle"
        tmp = path.with_suffix(".tmp")
        try:
            with _private(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._fail(exc)
            return False
        return True

    def load_pipeline(self, job: str) -> bytes | None:
        try:
            return (self.root / "pipelines" / f"{job}.pickle").read_bytes()
        except OSError:
            return None

    def forget_pipeline(self, job: str, branches: int = 0) -> None:
        """Remove a job's pipeline file, and those of its ``branches``."""
        for name in (job, *(branch_file(job, k) for k in range(1, branches + 1))):
            (self.root / "pipelines" / f"{name}.pickle").unlink(missing_ok=True)

    def compact(self, events: list[dict[str, Any]]) -> None:
        """Replace the journal with ``events`` (the state as it is now), numbered on from
        the lines they replace (any such line found after them is older, skipped); a
        stopped journal stays as it is."""
        if self.failure is not None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            with _private(tmp, "wb") as f:
                for number, event in enumerate([_HEADER, *events], self._next):
                    f.write(line_of(event, number))
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._fail(exc)
            return
        os.close(self._fd)
        os.replace(tmp, self.path)
        self._fd = self._open()
        self._next += len(events) + 1
        self.lines = len(events) + 1
        self.version = VERSION

    def close(self) -> None:
        """Close the file (safe to call twice)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_HEADER = {"e": "journal", "version": VERSION}
"""A journal's first line."""


def _private(path: pathlib.Path, mode: str) -> IO[Any]:
    """A new file at ``path`` (any old one replaced) that only this user can read: 0600."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    return open(descriptor, mode, encoding=None if "b" in mode else "utf-8")
