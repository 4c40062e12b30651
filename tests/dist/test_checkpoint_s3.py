"""Checkpoints in an object store (``checkpoint.dir: s3://bucket/run``), against a real S3-compatible
server (moto's, started here): written, pruned, verified and resumed through fsspec; an object store
has no rename, so a checkpoint without its manifest (the last PUT) is skipped."""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist._ckpt_worker import fake_worker, params
from tests.dist._spawn import free_port, run_on_ranks
from tests.dist.test_checkpoint_storage import _scenario

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1800)]

s3fs = pytest.importorskip("s3fs", reason="needs s3fs (fsspec's S3 filesystem)")
moto_server = pytest.importorskip("moto.server", reason="needs moto[server]")

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def bucket(monkeypatch):
    """A fresh bucket on a moto S3 server; the workers reach it through AWS_ENDPOINT_URL."""
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(key, value)
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing")
    fs.mkdir("ckpts")
    try:
        yield fs
    finally:
        server.stop()


def _drop_newest_manifest(root: str) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(root)
    fs.rm(f"{path}/step_00000003/manifest.json")


def test_s3_checkpoints_are_pruned_verified_and_resumed(bucket):
    root = "s3://ckpts/run"
    results = run_on_ranks(_scenario, 2, root, [1, 2, 3], 2, f"{__name__}:_drop_newest_manifest", timeout_s=600)
    names = sorted(p.rsplit("/", 1)[-1] for p in bucket.ls("ckpts/run"))
    assert names == ["step_00000002", "step_00000003"]  # keepLast 2 pruned step 1
    assert "manifest.json" in [p.rsplit("/", 1)[-1] for p in bucket.ls("ckpts/run/step_00000002")]
    expected = params(fake_worker(seed=2))
    for errors, (step, loaded, loader_state, _) in results:
        assert errors == [] and step == 2 and loader_state == {"epoch": 0, "offset": 8}
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), key
    assert results[0][1][3].startswith(f"distflow: skipping checkpoint {root}/step_00000003: no manifest")
