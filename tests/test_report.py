"""bench.report: the README it writes from the benchmark JSON files, and its fallbacks."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest

from bench import report

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "bench" / "results"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(folder: pathlib.Path) -> str:
    assert report.main(["--results", str(folder), "--out", str(folder)]) == 0
    readme = folder / "README.md"
    assert readme.is_file()
    return readme.read_text()


def headings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ")]


def check_images(text: str, folder: pathlib.Path) -> list[str]:
    """Every image the README links is a PNG next to it, non-empty, with PNG magic bytes."""
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    for link in links:
        assert link.endswith(".png") and "/" not in link, link
        path = folder / link
        assert path.is_file(), link
        assert path.stat().st_size > 0, link
        assert path.read_bytes()[:8] == PNG_MAGIC, link
    return links


@pytest.mark.slow
def test_report_of_the_real_results(tmp_path: pathlib.Path) -> None:
    sources = sorted(RESULTS.glob("*.json"))
    if not sources:
        pytest.skip("no results in bench/results")
    for source in sources:
        shutil.copy(source, tmp_path)
    text = run(tmp_path)
    assert text.startswith("# ")
    assert "python -m bench.report" in text.splitlines()[2]
    found = headings(text)
    for source in sources:
        assert any(f"`{source.name}`" in heading for heading in found), source.name
    assert "## Scaling with workers" in found
    links = check_images(text, tmp_path)
    stems = {s.stem for s in sources}
    expected = {f"{stem}.png" for stem in ("transport", "torch_loader", "sharing") if stem in stems}
    assert expected <= set(links)
    assert "renderer failed" not in text and "No renderer" not in text


def test_unknown_garbled_and_changed_files_fall_back(tmp_path: pathlib.Path) -> None:
    (tmp_path / "garbled.json").write_text('{"benchmark": "half a file", ')
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00junk")
    (tmp_path / "gpu_train.json").write_text(json.dumps({
        "benchmark": "gpu_train", "date": "2026-12-01T00:00:00+00:00", "gpu": "H200",
        "samples_per_s": 1234.5, "steps": 100, "runs": [{"a": 1}], "config": {"b": 2}}))
    (tmp_path / "a_list.json").write_text("[1, 2, 3]")
    (tmp_path / "codec.json").write_text(json.dumps({"rows": "a format codec.py never wrote"}))
    text = run(tmp_path)
    found = headings(text)
    for name in ("garbled.json", "binary.json", "gpu_train.json", "a_list.json", "codec.json"):
        assert any(f"`{name}`" in heading for heading in found), name
    assert text.count("Could not read this file") == 2
    assert "No renderer for this file" in text
    assert "| samples_per_s | 1234.5 |" in text and "| gpu | H200 |" in text
    assert "Nested fields not shown: `runs`, `config`." in text
    assert "a list of 3 items" in text
    assert "The codec renderer failed on this file (TypeError" in text
    assert "No results yet for:" in text and "`transport`" in text
    assert "No result has throughput at several worker counts" in text
    assert check_images(text, tmp_path) == []


def test_missing_results_folder_and_a_worker_series(tmp_path: pathlib.Path) -> None:
    assert "No results yet for:" in run(tmp_path / "nothing here")
    rows = [{"system": "zloader", "num_workers": n, "samples_per_s": 100.0 * n ** 0.9}
            for n in (1, 2, 4, 8)]
    (tmp_path / "scaling_case.json").write_text(json.dumps({"rows": rows}))
    text = run(tmp_path)
    assert "Series found: scaling_case: zloader (samples_per_s)" in text
    assert check_images(text, tmp_path) == ["scaling.png"]


def test_the_benchmarks_are_one_list() -> None:
    """bench/catalog.py is the one list: bench/README.md is generated from it, every
    benchmark module has an entry (and every entry a module), the report's renderers and
    titles follow it, and ``make bench`` runs it."""
    from bench import catalog

    bench_dir = RESULTS.parent
    assert (bench_dir / "README.md").read_text() == catalog.readme(), \
        "bench/README.md is stale: python -m bench.catalog --write"
    modules = {path.stem for path in bench_dir.glob("*.py") if not path.stem.startswith("_")}
    tools = {"report", "catalog", "autoscale_trace"}  # (not benchmarks)
    listed = [bench.module for bench in catalog.BENCHMARKS]
    assert sorted(listed) == sorted(modules - tools) and len(set(listed)) == len(listed)
    stems = {stem for bench in catalog.BENCHMARKS for stem in bench.stems}
    assert set(report.RENDER) == stems and list(report.RENDERERS) == [
        stem for bench in catalog.BENCHMARKS for stem in bench.stems]
    makefile = (bench_dir.parent / "Makefile").read_text()
    recipe = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert "-m bench " in recipe + " " and "bench." not in recipe.replace("bench/", "")
