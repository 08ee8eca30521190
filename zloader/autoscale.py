"""How many workers a job needs, from how long its consumers wait for data.

The broker keeps one :class:`Autoscaler` per job and feeds it, once per heartbeat, the
job's worker count and *starvation*: the share of time its consumers waited for data. The
decision (``desired_workers``) shows in ``zloader status`` and the metrics; actuators carry
it out. The policy is a hill climb with hysteresis:

- **Up.** While consumers wait more than ``up`` of their time, add a worker. Then keep adding
  while each worker added cut their waiting by more than ``up`` (7 points of their time). An
  addition that helped less means the workers are not what they wait for (the network, the
  broker, the consumer itself): it is undone, and that count becomes a ceiling for a while.
- **Down.** While consumers wait less than ``down`` (3%), remove a worker. Keep removing
  while each removal raises their waiting by less than ``down``. A removal that cost more
  is undone, and that count becomes a floor for a while.
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
(accelerator idle time). The gap between the two is the hysteresis: a worker whose
addition bought between 3 and 7 points is kept, but not followed by another, so the count
does not flap around the threshold. The unit tests run the policy on traces (needs of 4
workers from 1, over-provisioned jobs, consumer-bound jobs, noise around a threshold) and
check that it settles and that it does not oscillate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class Autoscaler:
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
        if self._waiting:  # they caught up: the cooldown counts from now
            self._waiting = self._requested = False
            self._samples.clear()
            self._changed = now
        self._samples.append((now, min(1.0, max(0.0, starvation))))
        if now - self._changed < self.cooldown:
            return self.desired
        # The second half of the window only: the first still shows the count before
        # (consumers report once a heartbeat, and a new worker fills its pipeline first).
        settled = [v for t, v in self._samples if t >= self._changed + self.cooldown / 2]
        mean = sum(settled) / len(settled)
        self._undo = False
        step = self._step(now, mean)
        low = self._floor[0] if now < self._floor[1] else self.min_workers
        high = self._ceiling[0] if now < self._ceiling[1] else self.max_workers
        target = max(self.min_workers, low, min(self.max_workers, high, self.desired + step))
        moved = (target > self.desired) - (target < self.desired)
        if moved:
            self._asked = now
            self._requested = True
        # An undone step is not a step of its own: the next decision starts afresh.
        self._direction = 0 if self._undo else moved
        self.desired = target
        self._before = mean
        self._changed = now
        self._samples.clear()
        return self.desired

    def _step(self, now: float, mean: float) -> int:
        if self._direction > 0:  # we added one: did it help enough to add another?
            if self._before - mean > self.up:
                return 1 if mean > self.up else 0
            # It did not: the workers are not what the consumers wait for. Undo, and do
            # not try that count again for a while (longer each time).
            self._ceiling = self._limit(self._ceiling, self.desired - 1, now)
            self._undo = True
            return -1
        if self._direction < 0:  # we removed one: did it cost little enough to go on?
            if mean - self._before >= self.down:
                self._floor = self._limit(self._floor, self.desired + 1, now)
                self._undo = True
                return 1
            return -1 if mean < self.down else 0
        if mean > self.up:
            return 1
        if mean < self.down:
            return -1
        return 0

    def _limit(self, limit: tuple[int, float, int], count: int,
               now: float) -> tuple[int, float, int]:
        times = limit[2] + 1 if limit[0] == count else 1
        return count, now + self.hold * self.cooldown * 2 ** (times - 1), times
