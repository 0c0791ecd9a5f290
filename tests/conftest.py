"""Shared fixtures: a moto S3 server on the loopback address."""
from __future__ import annotations

import uuid

import pytest


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """An S3 endpoint served by moto on 127.0.0.1, with credentials set for this test session."""
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    patch = pytest.MonkeyPatch()
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }.items():
        patch.setenv(key, value)
    yield f"http://{host}:{port}"
    patch.undo()
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh, empty bucket; returns its s3:// URL."""
    import boto3

    name = f"orthosphere-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return f"s3://{name}"
