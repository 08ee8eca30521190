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
from collections.abc import Iterator
from typing import Any

__all__ = ["Journal"]

log = logging.getLogger("zloader.broker")

COMPACT_LINES = 100_000
"""Rewrite the journal without collected jobs once it has this many lines."""


class Journal:
    """Append-only event log in a work directory."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.root = pathlib.Path(directory)
        (self.root / "pipelines").mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = self.root / "journal.jsonl"
        self.lines = 0
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open

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
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)

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
        with open(tmp, "w", encoding="utf-8") as f:
            for event in events:
                f.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._file.close()
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        self.lines = len(events)

    def close(self) -> None:
        self._file.close()
