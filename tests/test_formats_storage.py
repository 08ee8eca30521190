"""Object storage through fsspec: a real S3-compatible server (moto's server mode) on
127.0.0.1, read by format sources in workers; globbing, retries, permanent failures; and
the retry layer on its own, over real files that fail on purpose."""

from __future__ import annotations

import io
import json
import threading

import pytest

from tests.service import free_port
from zloader import Loader, Pipeline, PipelineError
from zloader.storage import RetryingFile, StorageError, list_files, retrying

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

BUCKET = "zloader-test"


class S3Server:
    """moto's S3 server in a thread of this process (its data outlives a restart)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port,
                                                     verbose=False)

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port,
                                                     verbose=False)
        self.server.start()

    @property
    def options(self) -> dict:
        return {"key": "testing", "secret": "testing",
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    server.start()
    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    for f in range(4):
        body = "".join(json.dumps({"file": f, "row": r}) + "\n" for r in range(5 + f))
        client.put_object(Bucket=BUCKET, Key=f"rows/part-{f}.jsonl", Body=body.encode())
    client.put_object(Bucket=BUCKET, Key="rows/readme.txt", Body=b"not data")
    yield server
    server.stop()


def expected_rows() -> list[dict]:
    return [{"file": f, "row": r} for f in range(4) for r in range(5 + f)]


def key(row: dict) -> tuple:
    return row["file"], row["row"]


def test_glob_on_s3_lists_matching_objects_with_size_and_etag(s3):
    files = list_files(f"s3://{BUCKET}/rows/*.jsonl", s3.options)
    assert [f[0] for f in files] == [f"s3://{BUCKET}/rows/part-{f}.jsonl" for f in range(4)]
    assert all(size > 0 and tag for _, size, tag in files)
    with pytest.raises(ValueError, match="matched no files"):
        list_files(f"s3://{BUCKET}/rows/*.parquet", s3.options)
    with pytest.raises(ValueError, match=f"s3://{BUCKET}/rows/missing.jsonl"):
        list_files([f"s3://{BUCKET}/rows/missing.jsonl"], s3.options)


def test_s3_read_by_workers_with_parallel_reads(s3):
    pattern = f"s3://{BUCKET}/rows/part-*.jsonl"
    pipeline = Pipeline.from_jsonl(pattern, storage_options=s3.options)
    assert sorted(pipeline, key=key) == expected_rows()
    parallel = Pipeline.from_jsonl(pattern, storage_options=s3.options, parallel_reads=2)
    with Loader(parallel, num_workers=2, timeout=30) as loader:
        assert sorted(loader, key=key) == expected_rows()


def test_s3_outage_is_retried_then_read(s3):
    pipeline = Pipeline.from_jsonl(f"s3://{BUCKET}/rows/part-*.jsonl",
                                   storage_options=s3.options)
    s3.stop()
    restart = threading.Timer(0.5, s3.restart)
    restart.start()
    try:
        assert sorted(pipeline, key=key) == expected_rows()
    finally:
        restart.join()


def test_s3_object_gone_fails_naming_the_url(s3):
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key="gone/a.jsonl", Body=b'{"a": 1}\n')
    pipeline = Pipeline.from_jsonl(f"s3://{BUCKET}/gone/a.jsonl", storage_options=s3.options)
    client.delete_object(Bucket=BUCKET, Key="gone/a.jsonl")
    with pytest.raises(PipelineError, match=f"s3://{BUCKET}/gone/a.jsonl"):
        list(pipeline)


# --- the retry layer over real files that fail on purpose -----------------------------

class FlakyFile(io.RawIOBase):
    """A real file whose reads fail (ConnectionError) at ``fail_at`` bytes, ``times`` times
    in all (counted across reopenings)."""

    def __init__(self, path, failures: list[int], fail_at: int) -> None:
        self.file = open(path, "rb")  # noqa: SIM115 - closed by close()
        self.failures = failures
        self.fail_at = fail_at

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def readinto(self, buffer) -> int:
        if self.failures and self.file.tell() >= self.fail_at:
            self.failures.pop()
            raise ConnectionError("connection reset by peer")
        return self.file.readinto(buffer)

    def close(self) -> None:
        self.file.close()
        super().close()


def test_retrying_file_reopens_at_its_offset(tmp_path):
    path = tmp_path / "data"
    data = bytes(range(256)) * 40
    path.write_bytes(data)
    failures = [1, 1]
    opened = []

    def opener():
        opened.append(1)
        return FlakyFile(path, failures, fail_at=3000)

    with io.BufferedReader(RetryingFile(opener, "mem://data"), 1024) as stream:
        assert stream.read() == data
    assert failures == [] and len(opened) == 3  # reopened once per failure


def test_retrying_gives_up_naming_the_url(tmp_path):
    calls = []

    def transient():
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("slow")
        return "ok"

    assert retrying(transient, "s3://b/k", "open") == "ok"
    assert len(calls) == 3

    def always():
        raise ConnectionError("refused")

    with pytest.raises(StorageError, match=r"cannot open s3://b/k after \d+ attempts"):
        retrying(always, "s3://b/k", "open")

    def missing():
        calls.append(1)
        raise FileNotFoundError("no such key")

    calls.clear()
    with pytest.raises(StorageError, match="cannot open s3://b/k: FileNotFoundError"):
        retrying(missing, "s3://b/k", "open")
    assert len(calls) == 1  # permanent: not retried


def test_webdataset_and_parquet_shards_from_s3_match_local_reads(s3, tmp_path):
    from test_formats import write_parquet, write_shards

    client = s3.client()
    local = write_shards(tmp_path) + write_parquet(tmp_path)
    for path in local:
        name = path.rpartition("/")[2]
        client.upload_file(path, BUCKET, f"shards/{name}")
    shards = Pipeline.from_webdataset(f"s3://{BUCKET}/shards/shard-*", storage_options=s3.options)
    remote = [{k: v for k, v in s.items() if k != "__url__"} for s in shards]
    assert remote == [{k: v for k, v in s.items() if k != "__url__"}
                      for s in Pipeline.from_webdataset([p for p in local if "/shard-" in p])]
    table = Pipeline.from_parquet(f"s3://{BUCKET}/shards/*.parquet", storage_options=s3.options,
                                  parallel_reads=3)
    with Loader(table, num_workers=2, timeout=30) as loader:
        rows = sorted(loader, key=lambda r: r["id"])
    assert rows == sorted(Pipeline.from_parquet([p for p in local if p.endswith(".parquet")]),
                          key=lambda r: r["id"])


def test_from_files_accepts_urls(s3):
    from zloader.storage import open_file

    options = s3.options

    def lines(url):
        with open_file(url, options) as stream:
            return [json.loads(line) for line in stream]

    pipeline = Pipeline.from_files(f"s3://{BUCKET}/rows/part-*.jsonl", lines,
                                   storage_options=options)
    assert pipeline.source.num_splits == 4
    assert list(pipeline) == expected_rows()


def test_image_folder_on_s3_matches_the_local_folder(s3, tmp_path):
    from test_formats import write_image

    client = s3.client()
    root = tmp_path / "images"
    for relative, value in [("dog/b.png", 1), ("dog/a.png", 2), ("dog/in/c.png", 3),
                            ("cat.v2/x.png", 4)]:
        write_image(root / relative, value)
        client.upload_file(str(root / relative), BUCKET, f"images/{relative}")
    remote = Pipeline.from_image_folder(f"s3://{BUCKET}/images", storage_options=s3.options)
    local = Pipeline.from_image_folder(root)
    assert remote.source.classes == local.source.classes == ("cat.v2", "dog")
    assert [(e["image"], e["label"]) for e in remote] == \
        [(e["image"], e["label"]) for e in local]
