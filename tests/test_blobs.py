"""The host's cache of fetched pipelines (zloader/blobs.py): one fetch for the processes of
a host, a file another process changed is fetched again and never used, a blob that does
not match its digest is refused."""

from __future__ import annotations

import os

import pytest

from zloader.blobs import BlobCache, BlobError, digest_of

BLOB = b"a pickled pipeline" * 1000
DIGEST = digest_of(BLOB)


def test_processes_sharing_a_host_directory_fetch_once(tmp_path):
    fetched = []

    def fetch() -> bytes:
        fetched.append(1)
        return BLOB

    first, second = BlobCache(str(tmp_path)), BlobCache(str(tmp_path))
    assert first.get(DIGEST, len(BLOB), fetch) == BLOB
    assert second.get(DIGEST, len(BLOB), fetch) == BLOB  # another process of the host
    assert first.get(DIGEST, len(BLOB), fetch) == BLOB  # the next epoch's task
    assert len(fetched) == 1
    assert os.stat(tmp_path / DIGEST).st_mode & 0o777 == 0o600


def test_a_blob_file_changed_on_disk_is_fetched_again_not_used(tmp_path):
    BlobCache(str(tmp_path)).get(DIGEST, len(BLOB), lambda: BLOB)
    (tmp_path / DIGEST).write_bytes(b"import os; os.system('evil')".ljust(len(BLOB)))
    fetched = []
    blob = BlobCache(str(tmp_path)).get(DIGEST, len(BLOB),
                                        lambda: fetched.append(1) or BLOB)
    assert blob == BLOB and fetched == [1]
    assert (tmp_path / DIGEST).read_bytes() == BLOB  # repaired


@pytest.mark.parametrize("directory", [None, "tmp"])
def test_a_fetched_blob_that_does_not_match_its_digest_is_refused(tmp_path, directory):
    cache = BlobCache(str(tmp_path) if directory else None)
    with pytest.raises(BlobError, match="does not match"):
        cache.get(DIGEST, len(BLOB), lambda: BLOB[:-1] + b"!")
    with pytest.raises(BlobError, match="SHA-256"):
        cache.get("../../etc/passwd", 1, lambda: b"x")
    assert not [n for n in os.listdir(tmp_path) if not n.endswith(".lock")]
