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

The first line names the journal's schema version, ``{"e": "journal", "version": 2}``
(:data:`VERSION`; a journal from before versions has none and is of version 1). A
broker refuses a journal of a version it does not know (:class:`JournalVersionError`, naming
the work dir) rather than misread it. Version 2: a job's ``options`` are its whole
``JobOptions`` (zloader/options.py; a shared job's window in ``options.share``, no
``share`` event).

Replay trusts nothing it reads: a torn line, one that is not UTF-8 JSON, or an event whose
fields are missing or of the wrong type (zloader/broker/events.py: one record per kind,
each field checked) is skipped, and its line number kept in :attr:`Journal.skipped` for
one warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pathlib
import stat
from collections.abc import Iterator
from typing import IO, Any

from zloader.errors import ZloaderError
from zloader.transport.keys import unsafe_directory

__all__ = ["VERSION", "Journal", "JournalVersionError", "WorkDirError", "work_dir"]

log = logging.getLogger("zloader.broker")

VERSION = 2
"""The schema of the events (zloader/broker/events.py); bump it when an event changes
shape or meaning."""

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
        JournalVersionError: the journal is of another schema version than :data:`VERSION`.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.root = work_dir(directory)
        self.path = self.root / "journal.jsonl"
        self.lines = 0
        self.skipped: list[int] = []  # numbers of the lines the last replay skipped
        self.failure: str | None = None  # why writing stopped, once it has
        self._fd = self._open()
        try:
            self._check_version()
        except JournalVersionError:
            self.close()
            raise

    def _check_version(self) -> None:
        """Start a new journal with its version line; refuse one of another version."""
        info = os.fstat(self._fd)
        if not stat.S_ISREG(info.st_mode):
            return  # a device or a pipe: nothing to read back
        if info.st_size == 0:
            self.record(_HEADER)
            return
        version = self._version()
        if version is not None and version != VERSION:
            raise JournalVersionError(
                f"the journal in work dir {self.root} is of version {version}; "
                f"this zloader reads version {VERSION}: run the zloader that wrote it, or "
                "give zloader-broker another --work-dir (or move that journal away to "
                "start its jobs over)")

    def _version(self) -> int | None:
        """The version its first version line names (a torn or corrupt line may come
        before it); 1 for a journal of events without one (from before versions); None
        for one with no event it can read."""
        events = False
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except Exception:  # a torn or corrupt line: replay skips it
                    continue
                if _version_line(event):
                    return int(event["version"])
                events = events or _is_event(event)
        return 1 if events else None

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

    def replay(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """The events recorded so far (JSON objects naming their kind), in order, with
        their line numbers; the reader checks each one's fields and adds the number of one
        it cannot apply to :attr:`skipped`.

        Every other line (torn, not UTF-8, not JSON, not an object with a kind ``e``, a
        version line of another version) is skipped; its number goes to :attr:`skipped`.
        A journal that is not a regular file (a device, a pipe) holds nothing to replay.
        """
        self.skipped = []
        if not self.path.is_file():
            return
        with open(self.path, "rb") as f:
            for number, line in enumerate(f, 1):
                try:
                    event = json.loads(line)
                except Exception:  # not UTF-8, not JSON, nested too deep: skipped
                    event = None
                if not _is_event(event):
                    self.skipped.append(number)
                    continue
                if event["e"] == "journal":  # the version line, checked when opened
                    if not _version_line(event) or event["version"] != VERSION:
                        self.skipped.append(number)  # one elsewhere: corrupt
                    continue
                self.lines += 1
                yield number, event

    def record(self, event: dict[str, Any]) -> bool:
        """Append ``event`` as one line; False if it was not written (see :attr:`failure`)."""
        if self.failure is not None:
            return False
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
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

    def forget_pipeline(self, job: str) -> None:
        (self.root / "pipelines" / f"{job}.pickle").unlink(missing_ok=True)

    def compact(self, events: list[dict[str, Any]]) -> None:
        """Replace the journal with ``events`` (the state as it is now); a stopped journal
        stays as it is."""
        if self.failure is not None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            with _private(tmp, "w") as f:
                for event in [_HEADER, *events]:
                    f.write(json.dumps(event, separators=(",", ":")) + "\n")
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._fail(exc)
            return
        os.close(self._fd)
        os.replace(tmp, self.path)
        self._fd = self._open()
        self.lines = len(events) + 1

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
