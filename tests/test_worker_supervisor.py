"""``zloader-worker --processes N`` keeps N worker processes: a child that dies (an OOM
kill is a SIGKILL) is logged, naming its pid and how it died, replaced after a backoff,
counted, and makes the parent's exit status non-zero when it is later stopped."""

from __future__ import annotations

import os
import signal
import subprocess

import psutil
import pytest

from tests.service import BIN, start_broker, status, stop, wait_for
from zloader.actuator import Backoff


def worker_pids(address: str) -> set[int]:
    answer = status(address, 2.0)
    return {int(w["pid"]) for w in answer["workers"]} if answer else set()


@pytest.mark.slow  # (over 3 s: the fast suite keeps to 6 minutes on 2 cores)
def test_a_killed_worker_process_is_replaced_logged_and_fails_the_exit_status(tmp_path):
    broker, address = start_broker()
    log = tmp_path / "worker.log"
    with open(log, "w") as err:
        parent = subprocess.Popen([os.path.join(BIN, "zloader-worker"), "--broker", address,
                                   "--processes", "2", "--restart-delay", "0.1"], stderr=err)
    try:
        wait_for(lambda: len(worker_pids(address)) == 2, what="two worker processes")
        children = {c.pid for c in psutil.Process(parent.pid).children()}
        assert worker_pids(address) == children
        victim = min(children)
        os.kill(victim, signal.SIGKILL)  # as the kernel's OOM killer does

        wait_for(lambda: worker_pids(address) - children,
                 what="a replacement registered with the broker")
        now = {c.pid for c in psutil.Process(parent.pid).children()}
        assert victim not in now and len(now) == 2
        assert worker_pids(address) - children == now - children  # the replacement
        text = log.read_text()
        assert f"worker pid {victim} was killed by signal SIGKILL" in text, text
        assert "1 death so far" in text and "restarting it in" in text, text
        # The broker counts the death (STATUS, and zloader_broker_worker_deaths_total).
        wait_for(lambda: status(address)["summary"]["worker_deaths"] == 1,
                 what="the broker to count the dead worker")

        parent.send_signal(signal.SIGTERM)  # drains the two that run, then exits
        assert parent.wait(30) == 1
        assert "1 worker process died during this run" in log.read_text()
    finally:
        stop(parent)
        stop(broker)


def test_a_clean_run_stopped_by_sigterm_exits_zero(tmp_path):
    broker, address = start_broker()
    try:
        parent = subprocess.Popen([os.path.join(BIN, "zloader-worker"), "--broker", address,
                                   "--processes", "2"], stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: len(worker_pids(address)) == 2, what="two worker processes")
            parent.send_signal(signal.SIGTERM)
            assert parent.wait(30) == 0
        finally:
            stop(parent)
    finally:
        stop(broker)


def test_the_restart_backoff_doubles_to_its_cap_and_resets_after_a_long_life():
    backoff = Backoff(first=1.0, cap=8.0, reset_after=60.0)
    assert [backoff.death(lived=0.5) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert backoff.death(lived=61.0) == 1.0  # it had run well: a fresh start
    assert backoff.death(lived=2.0) == 2.0
    with pytest.raises(ValueError, match="first"):
        Backoff(first=0.0, cap=1.0, reset_after=1.0)
