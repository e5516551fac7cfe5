"""Real object-storage servers on loopback for tests: moto's S3 server, a GCS emulator, a TCP proxy.

Each server is a separate process on 127.0.0.1 with a free port, started by the test itself and
stopped by it (the session mark lets conftest.py kill leftovers). ``env()`` gives the variables a
client (s3fs, gcsfs, a torchrun rank) needs to reach it; no other address is ever contacted:
``AWS_EC2_METADATA_DISABLED`` and ``NO_GCE_CHECK`` keep the credential chains off the network.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from helpers import procutil

KEY_ID, SECRET = "toolkittestkey", "toolkit-test-secret-0123456789"


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server {proc.args} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).close()  # noqa: S310 - loopback only
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class S3Server:
    """moto's S3 server (``python -m moto.server``), what s3fs's own tests use.

    ``auth=True`` makes moto check access keys (``INITIAL_NO_AUTH_ACTION_COUNT``): the server
    creates an IAM user whose key pair is ``self.key_id`` / ``self.secret``.
    """

    def __init__(self, *, auth: bool = False) -> None:
        self.port = procutil.free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = procutil.child_env()
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"   # the three IAM calls below, then every call is checked
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        _wait_http(f"{self.endpoint}/moto-api/", self.proc)
        self.key_id, self.secret = KEY_ID, SECRET
        if auth:
            import boto3

            iam = boto3.client("iam", endpoint_url=self.endpoint, region_name="us-east-1",
                               aws_access_key_id="x", aws_secret_access_key="x")
            iam.create_user(UserName="toolkit")
            iam.put_user_policy(UserName="toolkit", PolicyName="s3", PolicyDocument=json.dumps({
                "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
            made = iam.create_access_key(UserName="toolkit")["AccessKey"]
            self.key_id, self.secret = made["AccessKeyId"], made["SecretAccessKey"]

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": endpoint or self.endpoint, "AWS_ACCESS_KEY_ID": self.key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.key_id, aws_secret_access_key=self.secret)

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))

    def read(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def stop(self) -> None:
        _stop(self.proc)


class GcsEmulator:
    """gcp-storage-emulator (PyPI), in memory; gcsfs reaches it through ``STORAGE_EMULATOR_HOST``."""

    def __init__(self) -> None:
        self.port = procutil.free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                                      "--port", str(self.port), "--in-memory"], env=procutil.child_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _wait_http(f"{self.endpoint}/storage/v1/b", self.proc)

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "NO_GCE_CHECK": "true",
                "GOOGLE_CLOUD_PROJECT": "toolkit-test"}

    def make_bucket(self, name: str) -> None:
        body = f'{{"name": "{name}"}}'.encode()
        request = urllib.request.Request(f"{self.endpoint}/storage/v1/b?project=toolkit-test", data=body,
                                         headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(request, timeout=10).close()  # noqa: S310 - loopback only

    def stop(self) -> None:
        _stop(self.proc)


class TcpProxy:
    """A loopback TCP proxy to ``target_port``: ``stop()`` is a storage server going away for its
    clients (connections reset, new ones refused) while the data stays; ``start()`` brings it back
    on the same port. ``hold_when(predicate)``: the first request bytes for which ``predicate``
    is true, and all traffic after them, wait (``held`` is set) until ``release()`` or ``stop()``:
    an upload caught in the middle."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.port = procutil.free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._flow = threading.Event()
        self._flow.set()
        self._predicate = None
        self.held = threading.Event()
        self.start()

    def hold_when(self, predicate) -> None:
        self.held.clear()
        self._predicate = predicate

    def release(self) -> None:
        self._predicate = None
        self._flow.set()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for src, dst, watch in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(src, dst, watch), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, watch: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                predicate = self._predicate
                if watch and predicate is not None and predicate(data):
                    self._flow.clear()
                    self.held.set()
                self._flow.wait()
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()  # linger 0: a reset, as from a server that died
        self.release()  # held pipes now write to closed sockets and end


def bucket_fixture(server_class, bucket: str, **kwargs):
    """A module-scoped pytest fixture: a ``server_class`` server holding ``bucket``, stopped after."""
    import pytest

    @pytest.fixture(scope="module")
    def serve():
        server = server_class(**kwargs)
        server.make_bucket(bucket)
        yield server
        server.stop()

    return serve


def wait_for(predicate, timeout: float, what: str, poll: float = 0.02):
    """Poll until ``predicate()`` is truthy; its value, or AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def tree(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*")) if path.exists() else []


__all__ = ["S3Server", "GcsEmulator", "TcpProxy", "wait_for", "tree", "KEY_ID", "SECRET"]
