"""The broker's journal: its state changes, appended to a file before they are acknowledged.

``zloader-broker --work-dir DIR`` keeps ``DIR/journal.jsonl`` (one JSON object per line) and
each job's pipeline in ``DIR/pipelines/<job>.pickle``. A broker started again on the same
work dir (after a crash or a SIGKILL) replays the journal into its state: its jobs, which
worker runs which task, the splits handed out and finished, the epochs started. Workers and
consumers reconnect by themselves and carry on with the job and task they had.

Each line is written and flushed before the messages that follow from it are sent, so a
killed process loses nothing it acknowledged; an operating-system crash may lose the last
lines (they are not fsync'ed). A torn last line is ignored on replay. When a job is
collected the journal is rewritten without it, so it does not grow without bound.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import stat
from collections.abc import Iterator
from typing import IO, Any

from zloader.errors import ZloaderError
from zloader.transport.keys import unsafe_directory

__all__ = ["Journal", "WorkDirError", "work_dir"]

log = logging.getLogger("zloader.broker")

COMPACT_LINES = 100_000
"""Rewrite the journal without collected jobs once it has this many lines."""


class WorkDirError(ZloaderError, PermissionError):
    """The work dir is one another local user could write to: refused."""


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

    Raises:
        WorkDirError: the directory, or a journal file in it, is another user's.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.root = work_dir(directory)
        self.path = self.root / "journal.jsonl"
        self.lines = 0
        self._file = self._open()

    def _open(self) -> IO[str]:
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
        return open(descriptor, "a", encoding="utf-8")

    def replay(self) -> Iterator[dict[str, Any]]:
        """The events recorded so far, in order (a torn last line is skipped)."""
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    log.warning("journal %s: line %d is torn or corrupt; ignored", self.path,
                                number)
                    continue
                if isinstance(event, dict) and isinstance(event.get("e"), str):
                    self.lines += 1
                    yield event

    def record(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._file.flush()
        self.lines += 1

    def save_pipeline(self, job: str, blob: bytes) -> None:
        path = self.root / "pipelines" / f"{job}.pickle"
        with _private(path.with_suffix(".tmp"), "wb") as f:
            f.write(blob)
        os.replace(path.with_suffix(".tmp"), path)

    def load_pipeline(self, job: str) -> bytes | None:
        try:
            return (self.root / "pipelines" / f"{job}.pickle").read_bytes()
        except OSError:
            return None

    def forget_pipeline(self, job: str) -> None:
        (self.root / "pipelines" / f"{job}.pickle").unlink(missing_ok=True)

    def compact(self, events: list[dict[str, Any]]) -> None:
        """Replace the journal with ``events`` (the state as it is now)."""
        tmp = self.path.with_suffix(".tmp")
        with _private(tmp, "w") as f:
            for event in events:
                f.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._file.close()
        os.replace(tmp, self.path)
        self._file = self._open()
        self.lines = len(events)

    def close(self) -> None:
        self._file.close()


def _private(path: pathlib.Path, mode: str) -> IO[Any]:
    """A new file at ``path`` (any old one replaced) that only this user can read: 0600."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    return open(descriptor, mode, encoding=None if "b" in mode else "utf-8")
