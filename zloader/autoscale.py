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
- **Cooldown.** No decision until ``cooldown`` seconds of samples since the last change,
  and a change is judged on the mean of those samples.

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

__all__ = ["Autoscaler"]


@dataclass
class Autoscaler:
    """One job's worker count; see the module docstring for the policy."""

    up: float = 0.07
    down: float = 0.03
    cooldown: float = 30.0
    min_workers: int = 1
    max_workers: int = 64
    hold: int = 10  # cooldowns a limit set by an undone step first lasts (then doubles)
    desired: int = 0  # 0 until the first update
    _direction: int = 0  # +1 just added, -1 just removed, 0 holding
    _changed: float = 0.0
    _before: float = 0.0  # mean starvation before the last change
    _samples: list[float] = field(default_factory=list)
    _floor: tuple[int, float, int] = (0, 0.0, 0)  # (count, until, times set)
    _ceiling: tuple[int, float, int] = (0, 0.0, 0)

    def update(self, now: float, workers: int, starvation: float) -> int:
        """Take one sample (the job has ``workers``, its consumers waited ``starvation``
        of the last interval) and return the workers it should have."""
        if self.desired == 0:
            self.desired = max(self.min_workers, min(self.max_workers, workers))
            self._changed = now
        if workers != self.desired:  # the actuators have not caught up: wait for them
            self._samples.clear()
            self._changed = now
            return self.desired
        self._samples.append(min(1.0, max(0.0, starvation)))
        if now - self._changed < self.cooldown:
            return self.desired
        mean = sum(self._samples) / len(self._samples)
        step = self._step(now, mean)
        low = self._floor[0] if now < self._floor[1] else self.min_workers
        high = self._ceiling[0] if now < self._ceiling[1] else self.max_workers
        target = max(self.min_workers, low, min(self.max_workers, high, self.desired + step))
        self._direction = (target > self.desired) - (target < self.desired)
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
            return -1
        if self._direction < 0:  # we removed one: did it cost little enough to go on?
            if mean - self._before >= self.down:
                self._floor = self._limit(self._floor, self.desired + 1, now)
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
