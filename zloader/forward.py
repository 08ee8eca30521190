"""What user code prints or logs on a worker, forwarded to the trainers' log.

On a standalone worker (``zloader-worker``, a Ray actor, a pod) a pipeline's ``print`` and
``logging`` output would only reach that host's terminal. :class:`Capture` tees
``sys.stdout``/``sys.stderr`` (the worker's own output is kept) and takes log records from
loggers outside ``zloader``; the worker sends the lines, tagged with its task, to the broker
(``LOG``), which passes them to the job's consumers, and each consumer logs them through
the ``zloader.remote`` logger (:func:`emit`). A token bucket limits each worker to
``RATE`` lines a second (bursts of ``BURST``); lines over it are counted and reported as
one line. A Loader's own workers write to the trainer's terminal already: they do not
capture.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import deque
from typing import Any, TextIO

from zloader._defaults import LOG_BURST as BURST
from zloader._defaults import LOG_MAX_LINE as MAX_LINE
from zloader._defaults import LOG_MAX_LINES as MAX_LINES
from zloader._defaults import LOG_RATE as RATE

__all__ = ["BURST", "MAX_LINE", "RATE", "Bucket", "Capture", "emit", "valid_lines"]

STDOUT, STDERR = logging.INFO, logging.WARNING
"""The levels printed lines are logged at on the trainer's side."""

remote = logging.getLogger("zloader.remote")


class Bucket:
    """A token bucket: ``rate`` tokens a second, at most ``burst`` held."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self._at: float | None = None

    def fill(self, now: float) -> float:
        """The tokens held at ``now``."""
        if self._at is not None:
            self.tokens = min(self.burst, self.tokens + max(0.0, now - self._at) * self.rate)
        self._at = now
        return self.tokens


class _Tee:
    """A text stream that writes through to ``stream`` and hands whole lines on."""

    def __init__(self, stream: TextIO, capture: Capture, level: int) -> None:
        self._stream = stream
        self._capture = capture
        self._level = level
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        with self._lock:  # a carriage return (a progress bar) ends a line too
            lines = (self._partial + text).replace("\r\n", "\n").replace("\r", "\n")
            parts = lines.split("\n")
            self._partial = parts.pop()
            if len(self._partial) > MAX_LINE:  # no end in sight: pass it on as it is
                parts.append(self._partial)
                self._partial = ""
        for line in parts:
            self._capture.add(self._level, line)
        return written

    def flush(self) -> None:
        self._stream.flush()

    def end(self) -> None:
        """Pass on a last line that has no newline."""
        with self._lock:
            partial, self._partial = self._partial, ""
        if partial:
            self._capture.add(self._level, partial)

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno, ...
        return getattr(self._stream, name)


class _Handler(logging.Handler):
    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self.capture = capture

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("zloader")  # the worker's own log stays local

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"{record.name}: {record.getMessage()}"
        except Exception:  # a bad format string in user code: say so, do not fail
            text = f"{record.name}: {record.msg!r} (unformattable arguments)"
        for line in text.split("\n"):
            self.capture.add(record.levelno, line)


class Capture:
    """Collects a worker's user output while installed (:meth:`install`/:meth:`remove`);
    :meth:`take` returns the lines the rate allows, oldest first."""

    def __init__(self, rate: float = RATE, burst: int = BURST) -> None:
        self.rate = rate
        self.burst = burst
        self._lines: deque[tuple[int, str]] = deque(maxlen=burst)
        self._lock = threading.Lock()
        self._bucket = Bucket(rate, float(burst))
        self.dropped = 0
        self._saved: tuple[TextIO, TextIO] | None = None
        self._handler = _Handler(self)
        self._fallback: logging.Handler | None = None

    def add(self, level: int, line: str) -> None:
        if len(line) > MAX_LINE:
            line = line[:MAX_LINE] + f" [... {len(line) - MAX_LINE} characters cut]"
        with self._lock:
            if len(self._lines) == self._lines.maxlen:
                self.dropped += 1
            self._lines.append((level, line))

    def take(self, now: float) -> list[list[Any]]:
        """``[[level, line], ...]`` to send now; dropped lines make one line of their own."""
        with self._lock:
            bucket = self._bucket
            bucket.fill(now)
            out: list[list[Any]] = []
            if self.dropped and bucket.tokens >= 1:  # said first: a flood never starves it
                out.append([logging.WARNING, f"[{self.dropped} lines dropped: over "
                                             f"{self.rate:.0f} lines/s]"])
                self.dropped = 0
                bucket.tokens -= 1
            count = min(int(bucket.tokens), len(self._lines), MAX_LINES - 1)
            out += [list(self._lines.popleft()) for _ in range(count)]
            bucket.tokens -= count
            if bucket.tokens < 1 and self._lines:  # over the rate: what waits is dropped
                self.dropped += len(self._lines)
                self._lines.clear()
        return out

    def discard(self) -> None:
        """Forget what waits (output while no task runs goes nowhere)."""
        with self._lock:
            self._lines.clear()
            self.dropped = 0

    def install(self) -> None:
        root = logging.getLogger()
        self._saved = (sys.stdout, sys.stderr)
        if not root.handlers:
            # Our handler would silence logging's last resort (warnings to stderr): keep
            # that behaviour for the process's own records.
            self._fallback = logging.StreamHandler(sys.stderr)
            self._fallback.setLevel(logging.WARNING)
            root.addHandler(self._fallback)
        sys.stdout = _Tee(sys.stdout, self, STDOUT)
        sys.stderr = _Tee(sys.stderr, self, STDERR)
        root.addHandler(self._handler)

    def end(self) -> None:
        """Pass on the last unfinished lines (before the final :meth:`take`)."""
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, _Tee):
                stream.end()

    def remove(self) -> None:
        root = logging.getLogger()
        root.removeHandler(self._handler)
        if self._fallback is not None:
            root.removeHandler(self._fallback)
            self._fallback = None
        if self._saved is not None:
            sys.stdout, sys.stderr = self._saved
            self._saved = None


def valid_lines(value: Any) -> list[list[Any]] | None:
    """``value`` as ``[[level, line], ...]`` if it is one (at most MAX_LINES, levels
    0-50, lines at most MAX_LINE plus the cut mark); None if it is not."""
    if not isinstance(value, list) or len(value) > MAX_LINES:
        return None
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                and not isinstance(item[0], bool) and 0 <= item[0] <= 50
                and isinstance(item[1], str) and len(item[1]) <= MAX_LINE + 64):
            return None
    return value


def emit(host: str, pid: int, lines: list[list[Any]]) -> None:
    """Log forwarded lines on the trainer's side, through the ``zloader.remote`` logger;
    while no logging is configured (no handler on its path), write them to stderr, as a
    local worker's output would appear."""
    if not remote.hasHandlers():
        sys.stderr.write("".join(f"[zloader worker {host}:{pid}] {line}\n"
                                 for _, line in lines))
        return
    for level, line in lines:
        remote.log(level, "[zloader worker %s:%d] %s", host, pid, line)
