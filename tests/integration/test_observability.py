"""What an operator sees of a fleet: one trace from the rollout client to the worker (for a
completion and for a policy refresh, with the SDK's in-memory exporter), json log lines
that name the request and its trace, the refresh and gate metrics, and the status page in
a real headless browser. A mocker fleet in the test's own process (tests/inprocess.py):
the point is the telemetry plumbing, not the engine (the real worker's vllm:* series are
checked in test_serving.py). The status page shows the journal's refreshes whatever its
store (SQLite, etcd)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from rlfleet import cli
from rlfleet.frontend.status import render_text
from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.sample import SamplingSpec
from rlfleet.runtime import tracing
from tests.inprocess import InProcessFleet

MODEL = "mock-obs"
# a synchronous refresh of workers that serve commit_policy: one call per worker moves it
# (close, pause, apply, reset the cache, verify, resume, and the post-update probe, which
# the worker runs on its own request plane: its span joins the commit's), then the reopen
PHASES_PER_WORKER = {"commit": ("POST /engine/commit_policy", "worker generate"),
                     "reopen": ("POST /engine/set_admission",)}


@pytest.fixture
def exporter():
    exp = InMemorySpanExporter()
    tracing.setup("rlfleet-test", exporter=exp)
    yield exp
    tracing.shutdown()


def _hex(span_id: int) -> str:
    return f"{span_id:016x}"


def _children(spans, parent) -> list:
    return [s for s in spans if s.parent is not None
            and s.parent.span_id == parent.context.span_id]


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_one_trace_and_json_logs_for_a_completion_and_a_refresh(tmp_path, exporter,
                                                                       capsys):
    ckpt = write_mock_checkpoint(tmp_path / "weights" / "B", 2)
    refreshes0 = _metric("rlfleet_refresh_total", outcome="reopened")
    applies0 = _metric("rlfleet_refresh_seconds_count", phase="apply")
    async with InProcessFleet(tmp_path, MODEL, 2, worker_args=(
            "--log-format", "json", "--log-level", "debug")) as fleet:
        capsys.readouterr()
        # ------------------------------------------------ a completion
        async with RolloutClient(fleet.url, MODEL) as client:
            sample = await client.generate("sample-obs-1", [11, 12, 13],
                                           SamplingSpec(max_tokens=4, seed=1))
        assert sample.completions[0].token_ids
        spans = exporter.get_finished_spans()
        attempt = next(s for s in spans if s.name == "rollout attempt")
        trace = attempt.context.trace_id
        in_trace = [s for s in spans if s.context.trace_id == trace]
        front = next(s for s in _children(in_trace, attempt) if s.name == "POST /v1/completions")
        worker = next(s for s in _children(in_trace, front) if s.name == "worker generate")
        assert attempt.attributes["rlfleet.sample_id"] == "sample-obs-1"
        rid = attempt.attributes["rlfleet.request_id"]
        assert worker.attributes["rlfleet.request_id"] == rid
        assert worker.attributes["rlfleet.outcome"] == "ok"
        assert front.attributes["http.status_code"] == 200

        # json lines: every one parses; every line about the request names it and the trace
        lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.strip()]
        about = [x for x in lines if x["target"].startswith("rlfleet")
                 and (x.get("request_id") == rid or rid in x["message"])]
        targets = {x["target"] for x in about}
        assert {"rlfleet.rl.rollout", "rlfleet.frontend.requests",
                "rlfleet.request_plane"} <= targets, about
        for x in about:
            assert x.get("request_id") == rid and x.get("trace_id") == f"{trace:032x}", x
            assert x["level"] == "DEBUG", x  # per-request lines stay out of INFO

        # ------------------------------------------------ a policy refresh
        exporter.clear()
        refresh = PolicyRefresh(fleet.rl_url, model=MODEL, timeout=10,
                                journal=tmp_path / "journal.sqlite")
        result = await refresh.refresh(ckpt, "B", digest="mock:2")
        assert result.decision == "reopened", result.reason
        spans = exporter.get_finished_spans()
        root = next(s for s in spans if s.name == "policy refresh")
        assert root.parent is None
        in_trace = [s for s in spans if s.context.trace_id == root.context.trace_id]
        assert len(in_trace) == len(spans)  # nothing of the refresh left its trace
        phases = {s.name.removeprefix("refresh "): s for s in _children(in_trace, root)}
        assert set(PHASES_PER_WORKER) | {"resolve"} <= set(phases), sorted(phases)
        workers = {w["instance_id"] for w in result.workers}
        assert len(workers) == 2
        for name, per_worker in PHASES_PER_WORKER.items():  # each phase: its calls per worker
            calls = Counter(c.name for c in _children(in_trace, phases[name]))
            assert calls == {c: 2 for c in per_worker}, (name, calls)
        # the refresh metrics moved
        assert _metric("rlfleet_refresh_total", outcome="reopened") == refreshes0 + 1
        assert _metric("rlfleet_refresh_seconds_count", phase="apply") == applies0 + 1
        # and the workers export the policy they now serve
        async with httpx.AsyncClient(timeout=5) as c:
            for w in result.workers:
                text = (await c.get(f"{w['system_url']}/metrics")).text
                assert re.search(rf'^rlfleet_worker_policy_info{{digest="mock:2",'
                                 rf'model="{MODEL}",version="B"}} 1\.0$', text, re.M), text


async def test_fleet_gated_metric_follows_the_workers_gates(tmp_path):
    async with InProcessFleet(tmp_path, MODEL, 2) as fleet, \
            httpx.AsyncClient(timeout=5) as c:
        listed = (await c.get(f"{fleet.rl_url}/v1/rl/workers")).json()["workers"]

        async def gated() -> tuple[float, float]:
            text = (await c.get(f"{fleet.url}/metrics")).text
            one = re.search(rf'^rlfleet_frontend_gated_workers{{model="{MODEL}"}} (\S+)$',
                            text, re.M)
            fleet_ = re.search(rf'^rlfleet_fleet_gated{{model="{MODEL}"}} (\S+)$', text, re.M)
            return float(one.group(1)), float(fleet_.group(1))

        assert await gated() == (0.0, 0.0)
        # the frontend's request series carry the model the request was served for
        r = await c.post(f"{fleet.url}/v1/completions",
                         json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 200, r.text
        text = (await c.get(f"{fleet.url}/metrics")).text
        assert re.search(rf'^rlfleet_frontend_requests_total{{model="{MODEL}",'
                         r'route="/v1/completions",status="200"} [1-9]', text, re.M), text
        assert re.search(rf'^rlfleet_frontend_request_seconds_bucket{{le="14400.0",'
                         rf'model="{MODEL}",route="/v1/completions"}} [1-9]', text, re.M)
        assert "rlfleet_worker_" not in text
        for url in (fleet.url, listed[0]["system_url"]):  # each family exported once
            types = re.findall(r"^# TYPE (\S+)", (await c.get(f"{url}/metrics")).text, re.M)
            assert len(types) == len(set(types)), sorted(types)
        for n, w in enumerate(listed, 1):
            r = await c.post(f"{w['system_url']}/engine/set_admission",
                             json={"open": False, "reason": "test gate"})
            assert r.json()["status"] == "ok", r.text
            want = (float(n), 1.0 if n == len(listed) else 0.0)
            for _ in range(100):  # discovery reaches the frontend within its poll interval
                if await gated() == want:
                    break
                await asyncio.sleep(0.05)
            assert await gated() == want


# ---------------------------------------------------------------------------- browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HEADLESS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync")


async def chromium(tmp_path: Path, *args: str, timeout: float = 90) -> str:
    """Run headless chromium with a new profile; its stdout."""
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.glob('chromium-profile-*')))}"
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, *HEADLESS, f"--user-data-dir={profile}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


def worker_rows(dom: str) -> dict[str, str]:
    """instance ID -> the admission shown in its row of the rendered page."""
    return dict(re.findall(r'<tr data-instance="(\d+)">.*?<td class="admission (\w+)"', dom,
                           re.S))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/setup.sh)")
async def test_status_page_in_a_headless_browser(tmp_path, capsys):
    journal = tmp_path / "journal.sqlite"
    ckpt = write_mock_checkpoint(tmp_path / "weights" / "B", 2)
    async with InProcessFleet(tmp_path, MODEL, 2, journal=str(journal)) as fleet, \
            httpx.AsyncClient(timeout=5) as c:
        result = await PolicyRefresh(fleet.rl_url, model=MODEL, timeout=10,
                                     journal=journal).refresh(ckpt, "B", digest="mock:2")
        assert result.decision == "reopened", result.reason
        snap = (await c.get(f"{fleet.rl_url}/fleet.json")).json()
        ids = {str(w["instance_id"]) for w in snap["workers"]}
        assert len(ids) == 2 and snap["models"][0]["gate"] == "open"
        assert {w["weight_version"] for w in snap["workers"]} == {"B"}
        assert snap["refreshes"][0]["decision"] == "reopened"
        assert {p["name"] for p in snap["refreshes"][0]["steps"]} >= {"apply", "verify"}

        page = f"{fleet.rl_url}/fleet"
        dom = await chromium(tmp_path, "--dump-dom", page)
        assert worker_rows(dom) == dict.fromkeys(ids, "open")
        assert dom.count(">B</td>") >= 2  # each worker's policy version
        assert "reopened" in dom and re.search(r"apply \d+\.\d\d", dom)  # phase timings

        # a worker is gated: the page shows it (and the model partly gated)
        gated = snap["workers"][0]
        r = await c.post(f"{gated['system_url']}/engine/set_admission",
                         json={"open": False, "reason": "held for a test"})
        assert r.json()["status"] == "ok"
        dom = await chromium(tmp_path, "--dump-dom", page)
        rows = worker_rows(dom)
        assert rows[str(gated["instance_id"])] == "gated"
        assert list(rows.values()).count("open") == 1
        assert "partly gated" in dom and "held for a test" in dom

        # the same snapshot in a terminal
        capsys.readouterr()
        assert await asyncio.to_thread(cli.main, ["status", "--rl-url", fleet.rl_url]) == 0
        text = capsys.readouterr().out
        assert f"model {MODEL}: 2 worker(s), partly gated: held for a test" in text
        assert "#1 -> B: reopened" in text


async def test_the_status_page_shows_an_etcd_journal(tmp_path, etcd_url):
    """A frontend started with an etcd journal shows the refreshes a coordinator recorded in
    it (the page reads the journal through its one interface, whatever the store)."""
    journal = f"{etcd_url}/status-{uuid.uuid4().hex[:8]}"
    ckpt = write_mock_checkpoint(tmp_path / "weights" / "B", 2)
    async with InProcessFleet(tmp_path, MODEL, 2, journal=journal) as fleet, \
            httpx.AsyncClient(timeout=15) as c:
        snap = (await c.get(f"{fleet.rl_url}/fleet.json")).json()
        assert (snap["journal"], snap["refreshes"], snap["error"]) == (journal, [], None)
        coordinator = PolicyRefresh(fleet.rl_url, model=MODEL, timeout=10, journal=journal)
        try:
            result = await coordinator.refresh(ckpt, "B", digest="mock:2")
        finally:
            coordinator.close()
        assert result.decision == "reopened", result.reason
        snap = (await c.get(f"{fleet.rl_url}/fleet.json")).json()
        assert snap["error"] is None
        [shown] = snap["refreshes"]
        assert (shown["id"], shown["target_version"], shown["target_digest"],
                shown["decision"], shown["model"]) == (result.refresh_id, "B", "mock:2",
                                                       "reopened", MODEL)
        assert {p["name"] for p in shown["steps"]} >= {"apply", "verify"}
        page = (await c.get(f"{fleet.rl_url}/fleet")).text
        assert '"target_version": "B"' in page  # the first paint carries the snapshot
        assert f"#{result.refresh_id} -> B: reopened" in render_text(snap)
