"""A fleet across hosts, for real: each "host" is a Linux network namespace with its own
address on a private bridge (src/rlfleet/testing/netns.py). etcd and the frontend on one host, a real
vLLM worker on each of two others, a mocker (slow tokens, for the mid-stream partition) on a
fourth, and the trainer/coordinator on a fifth. Traffic stays inside the namespaces the
test made; they are deleted at the end, also when a test fails."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from rlfleet.models import make_model
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.testing.etcd import run_etcd
from rlfleet.testing.fleet import LocalFleet
from rlfleet.testing.netns import Host, Lab, unavailable
from tests.fleets import VLLM_FLAGS

MODEL = "Qwen/Qwen3-0.6B"  # a local directory of that name: served under that name
SLOW = "slow-mock"
REQUEST_TIMEOUT = 4.0  # the frontend's deadline for a worker's next event
REFRESH_TIMEOUT = 8.0  # the coordinator's deadline for one admin call

_why = unavailable()
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(_why is not None, reason=f"no network namespaces here: {_why}")]


@dataclass
class Net:
    lab: Lab
    fleet: LocalFleet
    ctl: Host
    w1: Host
    w2: Host
    w3: Host
    trn: Host
    ckpt: dict[str, Path]

    def complete(self, model: str = MODEL, **kw) -> httpx.Response:
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4,
                "nvext": {"extra_fields": ["worker_id", "weight_versions"]}, **kw}
        return httpx.post(f"{self.fleet.url}/v1/completions", json=body, timeout=60)

    def health(self) -> list[dict]:
        return httpx.get(f"{self.fleet.url}/health", timeout=10).json()["workers"]

    def wait_usable(self, model: str, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if sum(w["usable"] for w in self.health() if w["model"] == model) == count:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} usable {model} workers not seen: {self.health()}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def net(tmp_path_factory) -> Iterator[Net]:
    root = tmp_path_factory.mktemp("netns")
    models = root / "models"  # a directory every namespace sees (one filesystem)
    make_model(models / MODEL, size="tiny", seed=1)
    ckpt = {"A": models / MODEL, "B": make_model(root / "B", size="tiny", seed=2)}
    with contextlib.ExitStack() as stack:
        lab = stack.enter_context(Lab())
        ctl, w1, w2, w3, trn = (lab.add_host(n) for n in ("ctl", "w1", "w2", "w3", "trn"))
        with ctl.entered():
            etcd = stack.enter_context(run_etcd(host=ctl.ip))
        fleet = stack.enter_context(LocalFleet(root / "fleet", discovery=etcd, lease_ttl=10))
        gloo = {"GLOO_SOCKET_IFNAME": "eth0"}  # gloo's own address: the host's interface
        with ctl.entered():
            fleet.start_frontend("--http-host", "0.0.0.0", "--request-timeout",
                                 str(REQUEST_TIMEOUT), enable_rl=True)
        common = ("--host", "0.0.0.0", "--enable-rl", "--system-port", "0", *VLLM_FLAGS)
        with w1.entered():  # advertised from $VLLM_HOST_IP
            a = fleet.start_worker("--model", MODEL, *common, cwd=models, wait=False,
                                   env={**gloo, "VLLM_HOST_IP": w1.ip})
        with w2.entered():  # advertised from the interface that routes to etcd
            b = fleet.start_worker("--model", MODEL, *common, "--enable-fault-injection",
                                   cwd=models, wait=False, env=gloo)
        with w3.entered():
            fleet.start_worker("--served-model-name", SLOW, "--token-delay", "0.05",
                               "--host", "0.0.0.0", "--lease-ttl", "2", kind="mocker")
        for p in (a, b):
            p.wait_ready(600)
        n = Net(lab, fleet, ctl, w1, w2, w3, trn, ckpt)
        with trn.entered():
            n.wait_usable(MODEL, 2)
            n.wait_usable(SLOW, 1)
        yield n
        fleet.stop()  # every process ends before its namespace goes


def test_each_worker_is_listed_at_its_hosts_address(net: Net) -> None:
    assert urlsplit(net.fleet.url).hostname == net.ctl.ip  # the frontend's advertised address
    with net.trn.entered():
        body = httpx.get(f"{net.fleet.rl_url}/v1/rl/workers", timeout=30).json()
    workers = body["workers"]
    assert {w["model"] for w in workers} == {MODEL}
    assert sorted(urlsplit(w["transport"]["http"]).hostname for w in workers) == \
        sorted([net.w1.ip, net.w2.ip])
    assert sorted(urlsplit(w["system_url"]).hostname for w in workers) == \
        sorted([net.w1.ip, net.w2.ip])
    assert all("update_weights_from_disk" in w["routes"] and "error" not in w for w in workers)


def test_rollouts_through_the_frontend_reach_both_hosts(net: Net) -> None:
    with net.trn.entered():
        seen = set()
        for _ in range(8):
            r = net.complete()
            assert r.status_code == 200, r.text
            seen.add(r.json()["nvext"]["worker_id"]["decode_worker_id"])
        assert len(seen) == 2
        with pytest.raises(httpx.ConnectError):  # loopback is the trainer host's own
            httpx.get(f"http://127.0.0.1:{urlsplit(net.fleet.url).port}/health", timeout=3)


def _refresh(coordinator: PolicyRefresh, ckpt: Path, version: str):
    return asyncio.run(coordinator.refresh(ckpt, version))


def test_refresh_over_the_network_disk_path(net: Net) -> None:
    with net.trn.entered():
        coordinator = PolicyRefresh(net.fleet.rl_url, model=MODEL, timeout=60)
        result = _refresh(coordinator, net.ckpt["B"], "net-disk-1")
        assert result.ok, (result.reason, result.workers)
        assert {w["status"] for w in result.workers} == {"verified"}
        r = net.complete()
        assert r.json()["nvext"]["weight_versions"][0]["version"] == "net-disk-1"


def test_refresh_over_the_network_distributed_path(net: Net,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer broadcasts over gloo from its own host to the workers' hosts."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    with net.trn.entered():
        coordinator = PolicyRefresh(net.fleet.rl_url, model=MODEL, path="vllm-distributed",
                                    master_address=net.trn.ip, transfer_backend="gloo",
                                    timeout=60)
        result = _refresh(coordinator, net.ckpt["A"], "net-dist-1")
        assert result.ok, (result.reason, result.workers)
        assert {w["status"] for w in result.workers} == {"verified"}


def test_gloo_broadcast_from_the_trainer_host_to_the_worker_hosts(
        net: Net, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight plane itself across hosts: the trainer (rank 0, its own address) broadcasts
    a checkpoint over gloo to both workers, which report its digest."""
    from rlfleet.weights.broadcast import push_weights
    from rlfleet.weights.digest import checkpoint_digest, iter_checkpoint_tensors

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    with net.trn.entered():
        ws = httpx.get(f"{net.fleet.rl_url}/v1/rl/workers", timeout=30).json()["workers"]
        urls = [w["system_url"] for w in ws]
        for u in urls:
            r = httpx.post(f"{u}/engine/pause_generation", json={"mode": "wait"}, timeout=30)
            assert r.json()["status"] == "ok", r.text
        try:
            tensors = list(iter_checkpoint_tensors(net.ckpt["B"]))
            out = asyncio.run(push_weights(urls, tensors, "net-gloo-1", host=net.trn.ip,
                                           backend="gloo", timeout=30))
        finally:
            for u in urls:
                httpx.post(f"{u}/engine/resume_generation", json={}, timeout=30)
        digest = checkpoint_digest(net.ckpt["B"])
        assert [o.body["status"] for o in out] == ["ok", "ok"], out
        for u in urls:
            v = httpx.post(f"{u}/engine/get_weight_version", json={}, timeout=30).json()
            assert v["weight_digest"] == digest, v


def test_partition_mid_stream_ends_the_stream_with_an_error_in_time(net: Net) -> None:
    """The slow worker's host drops off mid-stream: the client gets an error event within
    the frontend's request deadline; when the link returns the worker serves again."""
    with net.trn.entered():
        body = {"model": SLOW, "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        events, ended = [], None
        with httpx.stream("POST", f"{net.fleet.url}/v1/completions", json=body,
                          timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 3:
                        break
            net.lab.cut(net.w3)
            cut_at = time.monotonic()
            try:
                for line in lines:
                    if line.startswith("data: "):
                        events.append(line)
            except httpx.HTTPError:
                pass
            ended = time.monotonic() - cut_at
        try:
            last = events[-1].removeprefix("data: ")
            assert last != "[DONE]" and "error" in json.loads(last), events[-3:]
            assert ended < REQUEST_TIMEOUT + 5, f"the stream took {ended:.1f}s to fail"
        finally:
            net.lab.mend(net.w3)
        # the worker's lease (2 s) ran out during the cut; it re-registers and serves again
        deadline = time.monotonic() + 30
        while (r := net.complete(model=SLOW, max_tokens=2)).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.5)


def test_partition_mid_refresh_holds_the_fleet_gated_then_recovers(net: Net) -> None:
    """A vLLM worker's host drops off while the refresh applies (the worker closed and
    paused, its weights not yet loaded): the refresh (which needs the whole fleet,
    min_workers=2) ends within its deadlines, held; the fleet stays gated; once the link is
    back a refresh reopens it on both workers. The apply starts at its own phase where
    workers move step by step ("<refresh> apply ..."), inside each worker's commit where
    they move in one commit_policy call each ("<refresh> commit ...", the vLLM workers
    here): the worker's load is held back (a fault's delay) until the cut, made once the
    worker reports itself paused."""
    cut = threading.Event()
    w2_url = ""  # the paused worker's system URL (read below, in the trainer's host)
    cutter: list[threading.Thread] = []

    def cut_once_paused() -> None:
        deadline = time.monotonic() + 3 * REFRESH_TIMEOUT
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.post(f"{w2_url}/engine/control/is_paused", json={}, timeout=5)
                if r.json().get("is_paused") is True:
                    net.lab.cut(net.w2)
                    cut.set()
                    return
            time.sleep(0.05)

    def on_event(msg: str) -> None:  # in the coordinator's loop: the cut waits elsewhere
        if (" apply ..." in msg or " commit ..." in msg) and not cutter:
            cutter.append(threading.Thread(target=cut_once_paused, daemon=True))
            cutter[0].start()

    with net.trn.entered():
        ws = httpx.get(f"{net.fleet.rl_url}/v1/rl/workers", timeout=30).json()["workers"]
        w2_url = next(w["system_url"] for w in ws if urlsplit(w["system_url"]).hostname
                      == net.w2.ip)
        # the worker's load waits (a commit runs it in-process, after the close and pause)
        r = httpx.post(f"{w2_url}/engine/fault_injection", timeout=10,
                       json={"route": "update_weights_from_disk", "mode": "delay", "times": 1,
                             "hang_seconds": REFRESH_TIMEOUT})
        assert r.json()["status"] == "ok", r.text
        coordinator = PolicyRefresh(net.fleet.rl_url, model=MODEL, timeout=REFRESH_TIMEOUT,
                                    min_workers=2, on_event=on_event)
        try:
            t0 = time.monotonic()
            result = _refresh(coordinator, net.ckpt["A"], "net-cut-1")
            took = time.monotonic() - t0
            assert cutter, "the refresh announced no apply (nor commit) start"
            cutter[0].join(3 * REFRESH_TIMEOUT)
            assert cut.is_set()
            assert not result.ok and result.decision == "held", (result.decision, result.reason)
            by_ip = {urlsplit(w["system_url"]).hostname: w for w in result.workers}
            assert by_ip[net.w2.ip]["status"] != "verified", by_ip
            assert "unreachable" in by_ip[net.w2.ip]["reason"], by_ip
            assert took < 6 * REFRESH_TIMEOUT, f"the refresh took {took:.0f}s"
            # gated: the frontend routes nothing of this model while the link is down
            assert not any(w["usable"] for w in net.health() if w["model"] == MODEL)
        finally:
            net.lab.mend(net.w2)
            with contextlib.suppress(httpx.HTTPError):  # disarmed, had the load not run
                httpx.post(f"{w2_url}/engine/fault_injection", timeout=10,
                           json={"route": "update_weights_from_disk", "times": 0})
        deadline = time.monotonic() + 60
        while True:  # the worker answers again (its keep-alive and the listener's probe)
            ws = httpx.get(f"{net.fleet.rl_url}/v1/rl/workers", timeout=30).json()["workers"]
            if len(ws) == 2 and not any("error" in w for w in ws):
                break
            assert time.monotonic() < deadline, ws
            time.sleep(0.5)
        result = _refresh(coordinator, net.ckpt["A"], "net-cut-2")
        assert result.ok, (result.reason, result.workers)
        net.wait_usable(MODEL, 2)
        assert net.complete().status_code == 200


def test_nothing_outside_the_lab(net: Net) -> None:
    """The fleet's addresses are the lab's only: nothing listens where the suite lives."""
    for url in (net.fleet.url, net.fleet.rl_url):
        assert urlsplit(url).hostname.startswith(net.lab.subnet)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{net.fleet.url}/health", timeout=2)  # from the caller's own namespace
    assert os.path.exists(f"/var/run/netns/{net.trn.name}")
