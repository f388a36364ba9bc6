"""A real S3-protocol server for the storage tests: moto's server on 127.0.0.1, one per test session (per
xdist worker), with fake credentials in the environment as the AWS SDKs read them. Each test gets a bucket
of its own."""

from __future__ import annotations

import itertools
import logging
import os

import pytest

SECRET = "qbatch-test-secret-never-printed"
_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3_server():
    """The server's endpoint URL; AWS_* set for this process and the processes it starts."""
    pytest.importorskip("obstore")
    server_module = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line a request otherwise
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION", "AWS_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="qbatch-test-key", AWS_SECRET_ACCESS_KEY=SECRET,
                      AWS_DEFAULT_REGION="us-east-1", AWS_REGION="us-east-1")
    yield endpoint
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


@pytest.fixture
def bucket(s3_server):
    """A new, empty bucket's name."""
    import boto3

    name = f"qbatch-test-{os.getpid()}-{next(_buckets)}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3(s3_server):
    """A boto3 client on the server, to put and look at objects as another tool would."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_server)
