"""bench/gpu_train.py's smoke run (CPU, tiny model): every scenario runs and reports."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
REQUIRED = ("gpu-alone", "dataloader", "zloader", "search-dataloader", "search-zloader")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_gpu_train_smoke(tmp_path: pathlib.Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.gpu_train", "--smoke", "--out", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)  # its own process group: all of it can be stopped
    try:
        out, err = process.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"the smoke run took over 360 s:\n{out[-2000:]}\n{err[-4000:]}")
    assert process.returncode == 0, f"exit {process.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
    assert "elapsed:" in out
    report = json.loads((tmp_path / "gpu_train_smoke.json").read_text())
    assert (tmp_path / "gpu_train_smoke.md").is_file()
    assert not (tmp_path / "gpu_train.json").exists()  # never the GPU figures' file
    assert report["device"]["type"] == "cpu" and report["judged"] is False
    for name in REQUIRED:
        scenario = report["scenarios"][name]
        assert scenario["status"] == "ok", (name, scenario)
        assert scenario["images_per_s"] > 0, name
        assert 0.0 <= scenario["wait_fraction"] <= 1.0, name
        for rate, wait in zip(scenario["per_trainer_images_per_s"],
                              scenario["per_trainer_wait_fraction"], strict=True):
            assert rate > 0 and 0.0 <= wait <= 1.0, name
        assert len(scenario["results"]) == (4 if name.startswith("search") else 1), name
    for key in ("zloader_vs_dataloader", "search_zloader_vs_search_dataloader"):
        assert report["ratios"][key]["value"] > 0
    assert report["leftovers"] == {"child_processes": [], "shm_segments": []}
