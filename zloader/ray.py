"""Workers as Ray actors: scale out on a Ray cluster (``pip install zloader[ray]``).

Ray places the actors, restarts those that crash and accounts their CPUs; zloader only
asks for them. Each actor runs one :class:`~zloader.worker.WorkerProcess` attached to a
broker, from its constructor, so an actor Ray restarts serves again::

    import ray, zloader.ray
    ray.init(address="auto")
    workers = zloader.ray.start_workers("tcp://broker-host:5555", num_workers=8,
                                        keys="/etc/zloader/keys")
    ...
    workers.stop()  # drains them: their splits are finished or handed back

The actors live until they are stopped (``workers.stop()``, or :func:`stop_all` for every
one this driver started) or the driver exits, whether or not the caller keeps the handle:
this module keeps a reference to each (Ray kills an actor once no reference to it is left,
so a ``start_workers(...)`` whose result was dropped would otherwise lose its actors at
once).

:class:`RayActuator` follows the broker's ``desired_workers`` with such actors, as
``zloader-worker --autoscale`` does with processes on one host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

from zloader._defaults import (
    ACTOR_READY_SECONDS,
    ACTUATOR_INTERVAL,
    DRAIN_SECONDS,
    RAY_START_TIMEOUT,
    REMOTE_DELAY,
)
from zloader._host import loopback
from zloader.actuator import Scaling, Shortfall, follow, plan
from zloader.transport.keys import Keys, resolve

__all__ = ["RayActuator", "RayWorkers", "start_workers", "stop_all"]

log = logging.getLogger("zloader.ray")


class _Worker:
    """The actor: a worker loop on a thread of its own, started by the constructor."""

    def __init__(self, broker: str, keys: str | None, advertise: str | None) -> None:
        import ray

        from zloader.worker import WorkerProcess

        host = advertise or ray.util.get_node_ip_address()
        self.worker = WorkerProcess(broker, f"tcp://{host}:*", advertise=host,
                                    keys=Keys.load(keys) if keys else None,
                                    forward_output=True)
        self.thread = threading.Thread(target=self.worker.run, name="zloader-worker",
                                       daemon=True)
        self.thread.start()

    def info(self) -> dict[str, Any]:
        """The worker's id and pid and the Ray node it runs on, once its loop runs; whether
        it drains or has left. (An actor Ray restarted runs a new worker, with a new id.)"""
        import os

        deadline = time.monotonic() + ACTOR_READY_SECONDS
        while not hasattr(self.worker, "endpoint") and time.monotonic() < deadline:
            time.sleep(0.01)
        import ray

        return {"worker": self.worker.id, "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id(),
                "endpoint": getattr(self.worker, "endpoint", None),
                "draining": self.worker.draining, "stopped": not self.thread.is_alive()}

    def drain(self) -> None:
        """Finish the splits taken, send what they make, leave (at most DRAIN_SECONDS)."""
        self.worker.drain()

    def stopped(self, timeout: float) -> bool:
        """Whether the worker loop has ended (waiting up to ``timeout`` seconds)."""
        self.thread.join(timeout)
        return not self.thread.is_alive()


class RayWorkers:
    """Handles of the worker actors :func:`start_workers` started. While it holds actors
    it is kept in this module's registry (so they live whether the caller keeps it or not)
    until :meth:`stop`, or :func:`stop_all`."""

    def __init__(self, actors: list[Any], info: list[dict[str, Any]]) -> None:
        self.actors = actors
        self.info = info
        if actors:
            _STARTED.add(self)

    def __len__(self) -> int:
        return len(self.actors)

    def drain(self, indices: list[int]) -> None:
        """Ask these actors to drain; :meth:`check` removes them once they have left."""
        for i in indices:
            self.actors[i].drain.remote()
            self.info[i]["draining"] = True

    def check(self, timeout: float = 10.0) -> int:
        """Update each actor's worker (a restarted actor has a new one, which is told to
        drain again if the old one was); kill the actors whose worker has left and drop
        those Ray has lost for good. An actor Ray is restarting is kept: dropping it would
        drop the last reference to it, and Ray would cancel the restart. Returns how many
        went."""
        import ray

        refs = [a.info.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        answered = set(ready)
        kept: list[tuple[Any, dict[str, Any]]] = []
        for actor, old, ref in zip(self.actors, self.info, refs, strict=True):
            if ref not in answered:  # busy or being restarted: as it was
                kept.append((actor, old))
                continue
            try:
                new = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:  # Ray is restarting it
                kept.append((actor, {**old, "failed": 0}))
                continue
            except ray.exceptions.RayActorError as exc:
                # It died: for good if it is still dead at the next check (one that died
                # with this call in flight and is restarted answers then, or is
                # unavailable while it restarts).
                failed = int(old.get("failed", 0)) + 1
                if failed < 2:
                    kept.append((actor, {**old, "failed": failed}))
                else:
                    log.warning("ray worker actor lost: %s", exc)
                continue
            if new["stopped"]:
                ray.kill(actor, no_restart=True)
                continue
            if old.get("draining") and not new["draining"]:
                actor.drain.remote()  # restarted while draining
                new["draining"] = True
            kept.append((actor, new))
        gone = len(self.actors) - len(kept)
        self.actors = [a for a, _ in kept]
        self.info = [i for _, i in kept]
        if not self.actors:
            _STARTED.discard(self)
        return gone

    def extend(self, other: RayWorkers) -> None:
        """Take over ``other``'s actors (``other`` is left empty)."""
        self.actors += other.actors
        self.info += other.info
        other.actors, other.info = [], []
        _STARTED.discard(other)
        if self.actors:
            _STARTED.add(self)

    def stop(self, timeout: float = DRAIN_SECONDS + 5.0) -> None:
        """Drain every worker, wait up to ``timeout`` seconds, then kill the actors."""
        import ray

        _STARTED.discard(self)
        if not self.actors:
            return
        for actor in self.actors:
            actor.drain.remote()
        ray.wait([a.stopped.remote(timeout) for a in self.actors],
                 num_returns=len(self.actors), timeout=timeout + 5.0)
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
        self.actors, self.info = [], []


# Every RayWorkers holding actors, until it is stopped: the reference that keeps its
# actors alive when the caller dropped the handle (they then go with the driver).
_STARTED: set[RayWorkers] = set()


def stop_all(timeout: float = DRAIN_SECONDS + 5.0) -> int:
    """Stop every worker actor this driver started and has not stopped (as
    :meth:`RayWorkers.stop`: drained, then killed), handles kept or not; returns how many.
    Actors a :class:`RayActuator` runs are stopped too (its next step starts others while
    it runs)."""
    count = 0
    for workers in list(_STARTED):
        count += len(workers)
        workers.stop(timeout)
    return count


def start_workers(broker: str, num_workers: int, num_cpus_per_worker: float = 1,
                  keys: str | None = None, advertise: str | None = None,
                  insecure: bool = False, max_restarts: int = -1,
                  start_timeout: float = RAY_START_TIMEOUT, **actor_options: Any) -> RayWorkers:
    """Start ``num_workers`` zloader workers as Ray actors of ``num_cpus_per_worker`` CPUs
    each, attached to ``broker``; returns once each runs. They serve until stopped
    (``.stop()`` on the result, or :func:`stop_all`) or until this driver exits, whether the
    result is kept or not.

    A broker on a loopback address (``tcp://127.0.0.1:PORT``) is reachable only from
    this host: the actors are then placed on this node, bind their data ports on loopback
    and need no keys.

    Args:
        keys: the broker's keys directory, as a path every Ray node can read (default
            ``$ZLOADER_KEYS`` on the driver; None there too: no authentication).
        advertise: the address consumers reach the workers at (default: each node's IP as
            Ray knows it; 127.0.0.1 for a loopback broker).
        insecure: allow a non-loopback ``advertise`` without ``keys`` (a trusted network
            only: whoever reaches a data port can read the data).
        max_restarts: passed to Ray (-1: restart crashed actors without limit).
        start_timeout: seconds to wait for every actor to run; past them none is kept.
        actor_options: more Ray actor options (``resources``, ``scheduling_strategy``...).

    Raises:
        ValueError: a bad count, or no keys where the data would be open to other hosts.
        RuntimeError: Ray did not start them all within ``start_timeout``.
    """
    import ray

    if num_workers < 0 or num_cpus_per_worker <= 0:
        raise ValueError(f"num_workers must be >= 0 and num_cpus_per_worker > 0, got "
                         f"{num_workers} and {num_cpus_per_worker}")
    if keys is None:
        found = resolve(None)
        keys = found.path if found is not None else None
    if loopback(broker):
        advertise, actor_options = _on_this_host(broker, advertise, num_cpus_per_worker,
                                                 actor_options)
    if keys is None and not insecure and not (advertise and loopback(f"tcp://{advertise}:0")):
        raise ValueError("workers on Ray nodes open data ports to other hosts: pass keys= "
                         "(the broker's keys directory, `zloader keygen DIR`), or "
                         "insecure=True on a trusted network, or advertise='127.0.0.1' "
                         "for a one-host cluster")
    remote = ray.remote(_Worker).options(num_cpus=num_cpus_per_worker,
                                         max_restarts=max_restarts,
                                         max_concurrency=4, **actor_options)
    actors: list[Any] = [remote.remote(broker, keys, advertise) for _ in range(num_workers)]
    return _running(actors, num_cpus_per_worker, start_timeout)


def _running(actors: list[Any], num_cpus: float, start_timeout: float) -> RayWorkers:
    """``actors`` once each runs, as :class:`RayWorkers`; if some do not within
    ``start_timeout`` seconds, all are killed.

    Raises:
        RuntimeError: Ray did not start them all within ``start_timeout``.
    """
    import ray

    refs = [a.info.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=start_timeout)
    if len(ready) < len(refs):
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise RuntimeError(f"Ray placed {len(ready)} of {len(actors)} worker actors of "
                           f"{num_cpus} CPUs within {start_timeout:.0f} s (not "
                           "enough free CPUs? see `ray status`); none were kept")
    return RayWorkers(actors, ray.get(refs))


def _on_this_host(broker: str, advertise: str | None, num_cpus: float,
                  actor_options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """For a broker only this host reaches (and so only consumers on this host): the
    workers' data address (loopback unless given) and actor options that place them on
    this node (unless a scheduling strategy is given).

    Raises:
        ValueError: this node lacks a resource the actors ask for (Ray would never place
            them: zloader's pin to this node, not the cluster, is what stops them).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    advertise = advertise or "127.0.0.1"
    if "scheduling_strategy" not in actor_options:
        node = ray.get_runtime_context().get_node_id()
        has: dict[str, float] = next(
            (n.get("Resources", {}) for n in ray.nodes() if n.get("NodeID") == node), {})
        wanted = {"CPU": num_cpus, "GPU": actor_options.get("num_gpus") or 0,
                  **(actor_options.get("resources") or {})}
        missing = sorted(name for name, amount in wanted.items()
                         if amount and has.get(name, 0) < amount)
        if missing:
            raise ValueError(
                f"the broker {broker} is on loopback, which only this host reaches, so "
                f"zloader places its worker actors on this Ray node ({node[:12]}), which "
                f"has not {', '.join(f'{n}={wanted[n]}' for n in missing)}; give "
                "zloader-broker an address the other nodes reach (--bind "
                "tcp://0.0.0.0:PORT, its host's address, and keys), or ask for resources "
                "this node has")
        log.info("the broker %s is on loopback: worker actors go on this Ray node (%s)",
                 broker, node[:12])
        actor_options = {**actor_options, "scheduling_strategy":
                         NodeAffinitySchedulingStrategy(node_id=node, soft=False)}
    return advertise, actor_options


class RayActuator:
    """Follows the broker's ``desired_workers`` with Ray actors (see
    :mod:`zloader.actuator` for the decision; Ray actors count as remote workers, so a
    trainer host's own ``zloader-worker --autoscale`` fills its idle cores first).

    Start it with :meth:`start` (it follows the broker on a thread of its own) and stop it
    with :meth:`stop` (its actors are drained), or use it as a context manager; or call
    :meth:`run`, which blocks until :meth:`stop` is called from another thread::

        with zloader.ray.RayActuator("tcp://broker-host:5555", max_workers=32,
                                     keys="/etc/zloader/keys"):
            train()

    Args:
        broker: the broker's address.
        max_workers: at most this many actors (the broker is told: no job asks for more
            workers than the fleet can run).
        interval: seconds between two looks at the broker's status.
        remote_delay: seconds a shortfall lasts before actors are added.
        worker_options: :func:`start_workers` arguments (``keys``, ``advertise``,
            ``num_cpus_per_worker``...).
    """

    def __init__(self, broker: str, max_workers: int, interval: float = ACTUATOR_INTERVAL,
                 remote_delay: float = REMOTE_DELAY, **worker_options: Any) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self.broker = broker
        self.max_workers = max_workers
        self.interval = interval
        self.remote_delay = remote_delay
        self.options = worker_options
        keys = worker_options.get("keys")
        self.keys = Keys.load(keys) if keys else resolve(None)
        self.workers = RayWorkers([], [])
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._shortfall = Shortfall()

    def start(self) -> RayActuator:
        """Follow the broker on a thread of its own (returns at once)."""
        if self._thread is not None:
            raise RuntimeError("this RayActuator was started already")
        self._thread = threading.Thread(target=self.run, name="zloader-ray-actuator",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = DRAIN_SECONDS + 15.0) -> None:
        """Stop following the broker and drain every actor (waiting up to ``timeout``
        seconds for a :meth:`start`'s thread to finish)."""
        self.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> RayActuator:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def run(self) -> None:
        """Follow the broker until :meth:`stop`; then drain every actor."""
        try:
            follow(self.broker, self.keys, self.interval, self.stopping, self.step,
                   lambda: {"id": f"ray-{id(self):x}-{os.getpid()}",
                            "cap": self.max_workers,
                            "workers": [i["worker"] for i in self.workers.info]})
        finally:
            self.workers.stop()

    def step(self, status: dict[str, Any], now: float) -> Scaling:
        """Act once on a broker status."""
        self.workers.check()
        ids = [i["worker"] for i in self.workers.info]
        short_for = self._shortfall.seconds(now, status)
        listed = {w["worker"] for w in status.get("workers", [])}
        decision = plan(status, set(ids), starting=sum(1 for i in ids if i not in listed),
                        room=self.max_workers - len(self.workers), local_host="",
                        idle_cores=0.0, short_for=short_for, remote_delay=self.remote_delay)
        drain = [k for k, i in enumerate(ids)
                 if i in decision.drain and not self.workers.info[k].get("draining")]
        if drain:
            self.workers.drain(drain)
            log.info("ray autoscale: draining %d workers", len(drain))
        if decision.start:
            try:
                self.workers.extend(start_workers(self.broker, decision.start,
                                                  start_timeout=self.interval + 30.0,
                                                  **self.options))
            except RuntimeError as exc:
                log.warning("ray autoscale: %s", exc)
            else:
                log.info("ray autoscale: started %d workers (%d)", decision.start,
                         len(self.workers))
        return decision
