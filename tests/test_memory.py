"""A worker process's C allocator (zloader/worker/memory.py): large blocks that a producer
thread makes for each record and another thread frees are reused by the next records, not
faulted in afresh. Each case runs in a fresh interpreter, so that this process's allocator
is left as it is."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
    reason="the settings are glibc's; the fault counts Linux's")

# A producer thread makes 9.6 MB arrays (a batch of 64 images of 224x224x3) three at a time
# and hands them to the main thread, which frees them all before the producer goes on: a
# worker's loop thread frees records once copied out, and the producer waits for credits
# now and then, so that at times none of its blocks is alive. Transparent huge pages are off
# for numpy's arrays, so that the fault count is one per 4 KiB page touched afresh. Prints
# the producer's minor faults per array over the last rounds, and the pages of an array.
SCRIPT = """
import json, queue, resource, sys, threading
import numpy as np
from zloader.worker.memory import keep_freed_memory

np._core.multiarray._set_madvise_hugepage(False)
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
rounds, warm, burst = 8, 4, 3
handed, freed = queue.Queue(), threading.Event()
faults = []

def produce():
    for i in range(rounds):
        if i == rounds - warm:
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
        for j in range(burst):
            handed.put(np.full((64, 224, 224, 3), (i * burst + j) % 251, np.uint8))
        handed.put("freeing")
        freed.wait(30)
        freed.clear()
    faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
    handed.put(None)

thread = threading.Thread(target=produce)
thread.start()
held = []
while (array := handed.get()) is not None:
    if isinstance(array, str):
        held.clear()
        freed.set()
    else:
        held.append(array)
thread.join()
print(json.dumps({"applied": applied, "faults": (faults[1] - faults[0]) / (warm * burst),
                  "pages": 64 * 224 * 224 * 3 // resource.getpagesize()}))
"""


def faults_per_array(mode: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for name in list(env):
        if name.startswith(("MALLOC_", "GLIBC_TUNABLES")):
            del env[name]  # the allocator's defaults, not the caller's
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result: dict[str, float] = json.loads(done.stdout)
    return result


def test_freed_large_blocks_are_reused_without_faulting_pages_in():
    kept = faults_per_array("keep")
    assert kept["applied"] is True
    assert kept["faults"] < kept["pages"] / 10, kept


def test_without_the_settings_each_block_is_faulted_in_afresh():
    """The premise of the settings, on this machine's glibc: left alone, most pages of
    every new block are faulted in."""
    default = faults_per_array("default")
    assert default["faults"] > default["pages"] / 2, default
