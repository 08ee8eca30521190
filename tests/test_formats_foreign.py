"""Files other tools write, as users hand them over: names holding glob characters, a
Parquet column misspelled, compressed streams cut short, a byte order mark, a broken link
in an image folder, values the codec does not carry. Each was read wrong, short or with
an unclear error before (a probe of the format sources with foreign files)."""

from __future__ import annotations

import bz2
import datetime
import gzip
import json
import lzma
import os
import zlib

import pytest

from tests.test_formats import examples, write_tfrecord
from zloader import Loader, Pipeline
from zloader.errors import PipelineError


def lines(path) -> list[str]:
    with open(path) as file:
        return [line.strip() for line in file]


def test_a_path_whose_name_holds_glob_characters_is_that_file(tmp_path):
    (tmp_path / "x[1].txt").write_text("right\n")
    (tmp_path / "x1.txt").write_text("wrong\n")  # (what the pattern x[1].txt matches)
    assert list(Pipeline.from_files(str(tmp_path / "x[1].txt"), lines)) == ["right"]
    (tmp_path / "d[1].jsonl").write_text('{"v": 1}\n')
    (tmp_path / "d1.jsonl").write_text('{"v": 2}\n')
    assert list(Pipeline.from_jsonl(str(tmp_path / "d[1].jsonl"))) == [{"v": 1}]
    (tmp_path / "only[2].txt").write_text("alone\n")  # (the pattern matches nothing)
    assert list(Pipeline.from_files(str(tmp_path / "only[2].txt"), lines)) == ["alone"]
    # A pattern still is one where no file has that name.
    assert sorted(Pipeline.from_files(str(tmp_path / "x[1-9].txt"), lines)) == ["wrong"]


def test_a_glob_passes_over_the_folders_it_matches(tmp_path):
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("b\n")
    assert list(Pipeline.from_files(str(tmp_path / "*"), lines)) == ["a"]
    assert list(Pipeline.from_files(str(tmp_path / "**"), lines)) == ["a", "b"]
    with pytest.raises(ValueError, match=r"matched no files .folders it matches are passed"):
        Pipeline.from_files(str(tmp_path / "s*"), lines)


def test_a_parquet_column_the_files_lack_is_refused_when_the_pipeline_is_built(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": [0, 1], "s": [{"x": 1, "y": 2}, {"x": 3, "y": 4}]}), path)
    for columns in (["nope"], ["id", "nope"]):  # (pyarrow read them as no column)
        with pytest.raises(ValueError, match=r"has no column \['nope'\] .its columns: "
                                             r"\['id', 's'\].; check columns="):
            Pipeline.from_parquet(str(path), columns=columns)
    assert list(Pipeline.from_parquet(str(path), columns=["id"])) == [{"id": 0}, {"id": 1}]
    assert list(Pipeline.from_parquet(str(path), columns=["s.x"])) == \
        [{"s": {"x": 1}}, {"s": {"x": 3}}]  # (a nested field's path)


def test_a_zstd_jsonl_file_cut_short_is_an_error_and_whole_frames_read_whole(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    data = b"".join(b'{"v": %d}\n' % i for i in range(3000))
    whole = zstandard.ZstdCompressor().compress(data)
    skippable = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"meta"
    (tmp_path / "frames.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(data[:100]) + skippable
        + zstandard.ZstdCompressor().compress(data[100:]))
    (tmp_path / "empty.jsonl.zst").write_bytes(b"")
    assert [v["v"] for v in Pipeline.from_jsonl(str(tmp_path / "frames.jsonl.zst"))] == \
        list(range(3000))
    assert list(Pipeline.from_jsonl(str(tmp_path / "empty.jsonl.zst"))) == []
    (tmp_path / "cut.jsonl.zst").write_bytes(whole[:len(whole) // 2])  # (gave [] quietly)
    with pytest.raises(PipelineError, match=r"cut.jsonl.zst.*zstd frame ends before its end"):
        list(Pipeline.from_jsonl(str(tmp_path / "cut.jsonl.zst")))
    pipeline = Pipeline.from_jsonl(str(tmp_path / "cut.jsonl.zst"))
    with Loader(pipeline, num_workers=1, on_error="skip") as loader:
        list(loader)
        assert loader.stats()["skipped"] == 1  # (counted, not silent)


def test_a_zlib_tfrecord_cut_short_is_an_error(tmp_path):
    path = tmp_path / "z.tfrecord"
    records = write_tfrecord(path, examples(50), "ZLIB")
    assert list(Pipeline.from_tfrecord(str(path), "ZLIB")) == records
    data = path.read_bytes()
    assert zlib.decompressobj().decompress(data)  # (a zlib stream, as TensorFlow wrote it)
    (tmp_path / "cut.tfrecord").write_bytes(data[:len(data) // 2])  # (gave 19 of 50 quietly)
    with pytest.raises(PipelineError, match=r"cut.tfrecord.*zlib stream ends before its end"):
        list(Pipeline.from_tfrecord(str(tmp_path / "cut.tfrecord"), "ZLIB"))


def test_a_jsonl_file_with_a_byte_order_mark_reads_its_first_line(tmp_path):
    path = tmp_path / "notepad.jsonl"
    path.write_bytes('\ufeff{"a": 1}\r\n{"a": 2}\r\n'.encode())  # (as Windows tools write)
    assert list(Pipeline.from_jsonl(str(path))) == [{"a": 1}, {"a": 2}]
    path.write_bytes(b'{"a": 1}\n\xef\xbb\xbf{"a": 2}\n')  # (one amid the lines is an error)
    with pytest.raises(PipelineError, match="line 2 is not JSON"):
        list(Pipeline.from_jsonl(str(path)))


def test_an_image_folder_passes_over_a_broken_link_that_is_no_image(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "1.png").write_bytes(b"\x89PNG")
    os.symlink("/nonexistent/README", tmp_path / "b" / "README")  # (raised at build before)
    pipeline = Pipeline.from_image_folder(str(tmp_path))
    assert [sample["label"] for sample in pipeline] == [0, 1]
    os.symlink("/nonexistent/2.png", tmp_path / "b" / "2.png")
    with pytest.raises(ValueError, match=r"from_image_folder: cannot read .*b/2.png"):
        Pipeline.from_image_folder(str(tmp_path))


def test_a_value_the_codec_does_not_carry_says_how_to_carry_it(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"t": "2020-01-01"}) + "\n")
    pipeline = Pipeline.from_jsonl(str(path)).map(
        lambda row: {"t": datetime.date.fromisoformat(row["t"])})
    with pytest.raises(PipelineError, match=r"datetime.date is not supported.*a datetime to a "
                                         r"number or str.*Loader\(objects=True\)"):
        with Loader(pipeline, num_workers=1) as loader:
            list(loader)
    with Loader(pipeline, num_workers=1, objects=True) as loader:
        assert list(loader) == [{"t": datetime.date(2020, 1, 1)}]


def test_a_compressed_file_read_as_it_is_not_says_which_setting_reads_it(tmp_path):
    data = b"".join(b'{"v": %d}\n' % i for i in range(100))
    for name, blob in (("a.jsonl.bz2", bz2.compress(data)), ("a.jsonl.xz", lzma.compress(data)),
                       ("gzip-named-plain.jsonl", gzip.compress(data))):
        (tmp_path / name).write_bytes(blob)  # (read as text before: "not JSON")
        assert [v["v"] for v in Pipeline.from_jsonl(str(tmp_path / name))] == \
            list(range(100)), name
    (tmp_path / "cut.jsonl.xz").write_bytes(lzma.compress(data)[:100])
    with pytest.raises(PipelineError, match=r"cut.jsonl.xz.*ended before the end-of-stream"):
        list(Pipeline.from_jsonl(str(tmp_path / "cut.jsonl.xz")))
    path = tmp_path / "g.tfrecord"
    records = write_tfrecord(path, examples(5), "GZIP")
    with pytest.raises(PipelineError, match=r'gzip-compressed, read it with compression="GZIP"'):
        list(Pipeline.from_tfrecord(str(path)))
    assert list(Pipeline.from_tfrecord(str(path), "GZIP")) == records
    with pytest.raises(ValueError, match=r"braces are not expanded: give the list of paths"):
        Pipeline.from_webdataset(str(tmp_path / "shard-{000..009}.tar"))


def test_a_tar_shard_cut_inside_a_member_yields_the_samples_read_whole_first(tmp_path):
    """A partial download: cut inside s3.bin, s0-s2 are whole (s2 was lost, as the
    webdataset package loses it; the same cut in a .tar.gz gave it)."""
    import io
    import tarfile

    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(4):
            for extension, payload in (("bin", bytes(700)), ("cls", b"%d" % i)):
                info = tarfile.TarInfo(f"s{i}.{extension}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    whole = data.getvalue()
    cut = whole[:whole.index(b"s3.bin") + 512 + 100]  # (the header of s3.bin, and some)
    (tmp_path / "cut.tar").write_bytes(cut)
    got = []
    with pytest.raises(PipelineError, match=r"cut.tar.*s3.bin.*the shard is cut short"):
        for sample in Pipeline.from_webdataset(str(tmp_path / "cut.tar")):
            got.append(sample["cls"])
    assert got == [b"0", b"1", b"2"]
