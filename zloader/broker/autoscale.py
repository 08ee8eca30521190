"""How many workers a job needs, from how long its consumers wait for data.

The broker keeps one :class:`Autoscaler` per job and feeds it, once per heartbeat, the
job's worker count and *starvation*: the share of time its consumers waited for data. The
decision (``desired_workers``) shows in ``zloader status`` and the metrics; actuators carry
it out. The policy steps in proportion to the job, with hysteresis:

- **Up.** While consumers wait more than ``up`` of their time, grow to the count that would
  end the waiting if the workers are what they wait for: with ``W`` workers and starvation
  ``s`` the consumers get ``1 - s`` of what they want, so ``W / (1 - s)`` workers serve them
  (at least one more, at most twice as many in one step: a job that needs 1,000 gets there
  from 1 in about ten steps). A step that cut the waiting by less than half of what it
  should have means the workers are not what the consumers wait for (the network, the
  broker, the consumer itself, cores shared by too many workers): it is undone, and the
  count it left becomes a ceiling for a while. (An earlier policy added one worker at a
  time and undid any that cut the waiting by 7 points or less; one of ``N`` cuts it by
  about ``1/N``, so no job grew past 14 workers.)
- **Down.** While consumers wait less than ``down`` (3%), remove an eighth of the workers
  (at least one). Keep removing while each removal raises their waiting by less than
  ``down``. A removal that cost more is undone, and that count becomes a floor for a
  while.
- **Backoff.** A floor or ceiling lasts ``hold`` cooldowns, twice as long each time the
  same one is set again, so a settled job is probed more and more rarely.
- **Cooldown.** No decision until ``cooldown`` seconds of samples since the last change
  was carried out, and a change is judged on the mean of the second half of them (the
  first half still shows the count before: reports lag, new workers fill up).
- **Actuators.** Until the job has the count asked for, no decision is made (samples
  only show whether the need went away). An addition not carried out within
  ``START_SECONDS`` or two cooldowns (no room, or no actuator) is given up: the count it
  has becomes ``desired`` and a ceiling, as above. A removal gets a cooldown and
  ``DRAIN_SECONDS`` (an actuator such as Kubernetes' HPA reacts on its own schedule, and
  a draining worker finishes its splits first), then its count becomes a floor. An
  addition whose need went away meanwhile (the consumers waited less than ``down`` over
  the last half cooldown) is dropped without a ceiling. A count that moved on its own
  (a worker died or joined) gets the same patience, counted from then, and sets nothing.

Why these thresholds: they are Cachew's published ones (7% up, 3% down), applied to the
consumers' time rather than throughput. Starvation is the quantity a trainer pays for
(accelerator idle time). The gap between the two is the hysteresis: a count at which the
consumers wait between 3% and 7% is kept, so the count does not flap around the
threshold. The unit tests run the policy on traces (needs of 1 to 1,000 workers from
various starts, needs that drop, over-provisioned jobs, consumer-bound jobs, noise around
a threshold) and check that it gets there in a bounded number of steps, settles and does
not oscillate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zloader._byfields import ByFields
from zloader._defaults import (
    AUTOSCALE_COOLDOWN,
    AUTOSCALE_DOWN,
    AUTOSCALE_HOLD,
    AUTOSCALE_MAX_WORKERS,
    AUTOSCALE_MIN_WORKERS,
    AUTOSCALE_UP,
    DRAIN_SECONDS,
    START_SECONDS,
)

__all__ = ["START_SECONDS", "Autoscaler"]


@dataclass(eq=False, repr=False)
class Autoscaler(ByFields):
    """One job's worker count; see the module docstring for the policy."""

    up: float = AUTOSCALE_UP
    down: float = AUTOSCALE_DOWN
    cooldown: float = AUTOSCALE_COOLDOWN
    min_workers: int = AUTOSCALE_MIN_WORKERS
    max_workers: int = AUTOSCALE_MAX_WORKERS
    hold: int = AUTOSCALE_HOLD  # cooldowns a limit set by an undone step first lasts (then doubles)
    desired: int = 0  # 0 until the first update
    _direction: int = 0  # +1 just added, -1 just removed, 0 holding (or just undone)
    _undo: bool = False  # the decision being made undoes the last step
    _waiting: bool = False  # for the actuators to reach ``desired``
    _requested: bool = False  # ``desired`` was changed by a decision, not carried out yet
    _changed: float = 0.0  # when the count last changed or the actuators caught up
    _asked: float = 0.0  # when ``desired`` last changed
    _before: float = 0.0  # mean starvation before the last change
    _before_error: float = 0.0  # its standard error
    _from: int = 0  # the count before the last change
    _samples: list[tuple[float, float]] = field(default_factory=list)  # (time, starvation)
    _floor: tuple[int, float, int] = (0, 0.0, 0)  # (count, until, times set)
    _ceiling: tuple[int, float, int] = (0, 0.0, 0)

    def update(self, now: float, workers: int, starvation: float) -> int:
        """Take one sample (the job has ``workers``, its consumers waited ``starvation``
        of the last interval) and return the workers it should have."""
        if self.desired == 0:
            self.desired = max(self.min_workers, min(self.max_workers, workers))
            self._changed = self._asked = now
        if workers != self.desired:
            return self._unmet(now, workers, starvation)
        if self._waiting:  # they caught up: the cooldown counts from now
            self._waiting = self._requested = False
            self._samples.clear()
            self._changed = now
        self._samples.append((now, min(1.0, max(0.0, starvation))))
        if now - self._changed < self.cooldown:
            return self.desired
        return self._decide(now)

    def _unmet(self, now: float, workers: int, starvation: float) -> int:
        """:meth:`update` while the job has ``workers`` rather than ``desired``: the
        workers it should have, which becomes ``workers`` once patience runs out."""
        # The actuators have not caught up (or the count moved on its own: a worker
        # died, one joined): wait for them, then take the count the job has. An
        # addition asked for and not carried out (no room, no actuator) sets a
        # ceiling, a removal a floor, as an undone step does.
        if not self._waiting:
            self._waiting = True
            self._samples.clear()
            if not self._requested:
                self._asked = now  # nobody asked for this count: patience from now
        patience = (max(2 * self.cooldown, START_SECONDS) if workers < self.desired
                    else self.cooldown + DRAIN_SECONDS)
        self._samples.append((now, min(1.0, max(0.0, starvation))))
        waited = [v for t, v in self._samples if t >= now - self.cooldown / 2]
        need_gone = (workers < self.desired and now - self._asked >= self.cooldown / 2
                     and sum(waited) / len(waited) < self.down)
        if now - self._asked < patience and not need_gone:
            return self.desired
        if self._requested and not need_gone:
            if workers < self.desired:
                self._ceiling = self._limit(self._ceiling, workers, now)
            else:
                self._floor = self._limit(self._floor, workers, now)
        self.desired = max(self.min_workers, min(self.max_workers, workers))
        self._direction = 0
        self._waiting = self._requested = False
        self._samples.clear()
        self._changed = self._asked = now
        return self.desired

    def _decide(self, now: float) -> int:
        """The decision after a cooldown of samples at ``desired`` workers: the count to
        ask for now (see the module docstring)."""
        # The second half of the window only: the first still shows the count before
        # (consumers report once a heartbeat, and a new worker fills its pipeline first).
        settled = [v for t, v in self._samples if t >= self._changed + self.cooldown / 2]
        mean = sum(settled) / len(settled)
        error = math.sqrt(sum((v - mean) ** 2 for v in settled) / max(1, len(settled) - 1)
                          / len(settled))
        self._undo = False
        wanted = self._next(now, mean, math.hypot(error, self._before_error))
        low = self._floor[0] if now < self._floor[1] else self.min_workers
        high = self._ceiling[0] if now < self._ceiling[1] else self.max_workers
        target = max(self.min_workers, low, min(self.max_workers, high, wanted))
        moved = (target > self.desired) - (target < self.desired)
        if moved:
            self._asked = now
            self._requested = True
        # An undone step is not a step of its own: the next decision starts afresh.
        self._direction = 0 if self._undo else moved
        self._from, self.desired = self.desired, target
        self._before, self._before_error = mean, error
        self._changed = now
        self._samples.clear()
        return self.desired

    def _next(self, now: float, mean: float, error: float) -> int:
        """The count to ask for after a cooldown whose settled starvation is ``mean``
        (``error``: the standard error of its difference from the one before)."""
        count = self.desired
        if self._direction > 0:  # we added some: did they help as much as they should?
            expected = _expected_gain(self._from, count, self._before) / 2
            gain = self._before - mean
            # (a gain smaller than the noise cannot be judged: a job starved almost all
            # the time by far too few workers gains little per step; it goes on)
            if gain >= expected or (expected < 2 * error and gain > -2 * error):
                return self._grown(count, mean) if mean > self.up else count
            # They did not: the workers are not what the consumers wait for. Undo, and do
            # not try that count again for a while (longer each time).
            self._ceiling = self._limit(self._ceiling, self._from, now)
            self._undo = True
            return self._from
        if self._direction < 0:  # we removed some: did it cost little enough to go on?
            if mean - self._before >= self.down:
                self._floor = self._limit(self._floor, self._from, now)
                self._undo = True
                return self._from
            return _shrunk(count) if mean < self.down else count
        if mean > self.up:
            return self._grown(count, mean)
        if mean < self.down:
            return _shrunk(count)
        return count

    def _grown(self, count: int, mean: float) -> int:
        """The count that would end a starvation of ``mean`` with ``count`` workers, if
        they are what the consumers wait for: ``count / (1 - mean)``, one more at least,
        twice as many at most."""
        serves = count / max(1.0 - mean, 1e-9)
        return max(count + 1, min(2 * count, math.ceil(serves - 1e-9)))

    def _limit(self, limit: tuple[int, float, int], count: int,
               now: float) -> tuple[int, float, int]:
        times = limit[2] + 1 if limit[0] == count else 1
        return count, now + self.hold * self.cooldown * 2 ** (times - 1), times


def _expected_gain(before: int, after: int, starvation: float) -> float:
    """How much growing from ``before`` to ``after`` workers should cut a starvation of
    ``starvation``, if the workers are what the consumers wait for (each serves ``(1 -
    starvation) / before`` of what they want)."""
    return starvation - max(0.0, 1.0 - after * (1.0 - starvation) / max(before, 1))


def _shrunk(count: int) -> int:
    """An eighth fewer workers, one at least."""
    return count - max(1, count // 8)
