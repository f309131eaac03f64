"""A real S3 protocol endpoint on loopback for tests: moto's ThreadedMotoServer + s3fs.

Use it by importing the fixture into a test module (`from fixtures_s3 import moto_s3`).
Credentials and the endpoint reach s3fs only through the environment (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ...), exactly as in production, so worker processes started during the
test (Beam's multi-process FnApiRunner, Dask workers) inherit them. Note: do not pass
`region_name` in s3fs `client_kwargs`, it breaks bucket creation against moto.
"""
from __future__ import annotations

import logging
import uuid

import pytest

__all__ = ["moto_s3", "S3Endpoint"]


class S3Endpoint:
    """The running server: `url(path)` gives an s3:// URL inside the test bucket."""

    def __init__(self, endpoint: str, bucket: str):
        self.endpoint = endpoint
        self.bucket = bucket

    def url(self, path: str = "") -> str:
        return f"s3://{self.bucket}/{path}".rstrip("/")

    def filesystem(self):
        import fsspec

        return fsspec.filesystem("s3", skip_instance_cache=True)


@pytest.fixture(scope="module")
def moto_s3():
    """Start a moto S3 server on 127.0.0.1 (a free port), create a bucket, point the
    environment at it for the module; stop it and restore the environment afterwards."""
    pytest.importorskip("moto.server", reason="moto[server] is a dev dependency: pip install -e '.[dev]'")
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            patch.setenv(name, value)
        patch.delenv("AWS_PROFILE", raising=False)
        S3FileSystem.clear_instance_cache()  # cached clients would keep another endpoint
        endpoint_info = S3Endpoint(endpoint, f"strag-test-{uuid.uuid4().hex[:8]}")
        endpoint_info.filesystem().mkdir(endpoint_info.bucket)
        try:
            yield endpoint_info
        finally:
            S3FileSystem.clear_instance_cache()
            server.stop()
