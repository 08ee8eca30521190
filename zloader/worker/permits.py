"""Permits per part: what a producer may make of each part of a task whose records go by
part (zloader/plan.py: each input of a mix its consumers draw, each shard of a
deterministic job), one permit per record, granted by the consumers' credits for that
part (``CREDIT.part``).

One pool per part, so that the records of a part the consumer is not taking now (it has
enough of them) never take the room of the part it waits for: a worker making both goes
on making the one that is wanted.
"""

from __future__ import annotations

import threading

__all__ = ["PartPool", "Permits", "Pool"]


class Pool:
    """A producer's permits, one per record it may send (a consumer's credits): a counting
    semaphore that a producer being stopped can leave at once. ``acquire`` returns False
    without waiting when its ``stop`` event is set, and a waiting ``acquire`` returns False
    when :meth:`wake` is called (the stopper sets ``stop``, then wakes), not at its
    timeout."""

    def __init__(self, value: int = 0) -> None:
        self._value = value
        self._changed = threading.Condition(threading.Lock())
        self._wakes = 0

    def acquire(self, blocking: bool = True, timeout: float | None = None,
                stop: threading.Event | None = None) -> bool:
        with self._changed:
            if self._value <= 0 and blocking:
                wakes = self._wakes
                self._changed.wait_for(
                    lambda: self._value > 0 or self._wakes != wakes
                    or (stop is not None and stop.is_set()), timeout)
            if self._value <= 0:
                return False
            self._value -= 1
            return True

    def release(self, count: int = 1) -> None:
        with self._changed:
            self._value += count
            self._changed.notify(count)

    def wake(self) -> None:
        """Wake whoever waits in :meth:`acquire`, granting nothing."""
        with self._changed:
            self._wakes += 1
            self._changed.notify_all()


class Permits:
    """One count of permits per input, and a condition to wait for any of them."""

    def __init__(self, parts: int) -> None:
        self._counts = [0] * parts
        self._changed = threading.Condition(threading.Lock())

    @property
    def parts(self) -> int:
        return len(self._counts)

    def release(self, part: int, count: int = 1) -> None:
        """``count`` more permits for input ``part``."""
        with self._changed:
            self._counts[part] += count
            self._changed.notify_all()

    def take(self, part: int) -> bool:
        """Take a permit of input ``part`` if one is free."""
        with self._changed:
            if self._counts[part] <= 0:
                return False
            self._counts[part] -= 1
            return True

    def take_back(self, part: int, count: int) -> None:
        """Withdraw up to ``count`` free permits of input ``part`` (a consumer left)."""
        with self._changed:
            self._counts[part] -= min(count, max(0, self._counts[part]))

    def free(self) -> list[int]:
        """The inputs with a permit free now."""
        with self._changed:
            return [part for part, count in enumerate(self._counts) if count > 0]

    def wake(self) -> None:
        """Wake whoever waits for a permit (a producer being stopped), granting none."""
        with self._changed:
            self._changed.notify_all()

    def wait(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Wait up to ``timeout`` seconds for a permit to be released (or, ``stop`` set,
        for :meth:`wake`)."""
        with self._changed:
            if stop is None or not stop.is_set():
                self._changed.wait(timeout)


class PartPool:
    """The permits of one input, as the semaphore a producer takes permits from (``acquire``
    and ``release``), so that the path that sends a record needs no other."""

    def __init__(self, permits: Permits, part: int) -> None:
        self.permits, self.part = permits, part

    def acquire(self, blocking: bool = True, timeout: float | None = None,
                stop: threading.Event | None = None) -> bool:
        if self.permits.take(self.part):
            return True
        if not blocking:
            return False
        self.permits.wait(timeout if timeout is not None else 0.1, stop)
        return self.permits.take(self.part)

    def release(self, count: int = 1) -> None:
        self.permits.release(self.part, count)

    def wake(self) -> None:
        self.permits.wake()
