"""`rlfleet demo`, short: a real frontend and two real vLLM workers, two GRPO steps with small
groups, each followed by a policy refresh of the whole fleet."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.runtime.launch import engine_env

pytestmark = pytest.mark.engine


def process_groups() -> set[int]:
    """The process group of every process on the machine."""
    groups = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        groups.add(int(fields[2]))  # state, ppid, pgrp
    return groups


def test_short_demo_trains_refreshes_and_cleans_up(tmp_path):
    out = tmp_path / "demo"
    run = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "demo", "--out", str(out), "--steps", "2",
         "--prompts", "2", "--group-size", "4", "--warmup-steps", "15", "--no-learning-check"],
        env=engine_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "all checks passed" in run.stdout
    # one screen apart from the table: no library lines (httpx's per request, vLLM's)
    table = re.compile(r"^\s*(step\s+reward|\d+\s+\d\.\d{3}\s)")
    shown = [line for line in (run.stdout + run.stderr).splitlines()
             if line.strip() and not table.match(line)]
    assert len(shown) <= 24 and not any("HTTP Request" in line for line in shown), shown

    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["failures"] == []
    fleet = report["fleet"]
    workers = {w["instance_id"] for w in fleet["workers"]}
    assert len(workers) == 2 and all(w["system_url"] and w["model"] == fleet["model"]
                                     for w in fleet["workers"])
    versions = [v["version"] for v in fleet["versions"]]
    assert versions == ["step-0", "step-1", "step-2"]

    refreshes = [report["initial_refresh"], *(s["refresh"] for s in report["steps"])]
    for r, v in zip(refreshes, fleet["versions"], strict=True):
        assert r["decision"] == "reopened" and (r["version"], r["digest"]) == (v["version"], v["digest"])
        assert {w["instance_id"] for w in r["workers"] if w["status"] == "verified"} == workers

    assert [s["step"] for s in report["steps"]] == [1, 2]
    for s, used, new in zip(report["steps"], fleet["versions"][:-1], fleet["versions"][1:], strict=True):
        assert (s["policy_version"], s["weight_digest"]) == (used["version"], used["digest"])
        assert (s["refreshed_to"], s["refreshed_digest"]) == (new["version"], new["digest"])
        assert s["admitted"] == 2 * 4 and s["rejected"] == 0
        assert 0.0 <= s["mean_reward"] <= 1.0
        assert 0 < s["refresh_seconds"] < 60
        assert s["max_abs_logprob_diff"] < 1e-3
    assert report["max_abs_logprob_diff"] < 1e-3
    assert report["first_step_reward"] == report["steps"][0]["mean_reward"]
    assert report["last3_mean_reward"] is not None and report["total_seconds"] > 0

    # the checkpoints the fleet was moved to: the made model's tensor names, tied embeddings
    from rlfleet.weights.digest import checkpoint_digest, checkpoint_signature

    base = checkpoint_signature(out / "model")
    assert "lm_head.weight" not in base
    kept = fleet["versions"][-2:]  # older checkpoints are pruned: served + previous stay
    assert not any(Path(v["path"]).exists() for v in fleet["versions"][:-2])
    for v in kept:
        assert checkpoint_signature(Path(v["path"])) == base
        assert checkpoint_digest(Path(v["path"])) == v["digest"]

    png = out / "report.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # every process the demo started (each in its own process group) is gone
    assert len(fleet["pids"]) == 3
    assert not set(fleet["pids"]) & process_groups()


def test_short_async_demo_bounds_staleness_and_cleans_up(tmp_path):
    """`rlfleet demo --async`, short: the stream's batches, each token within one step of
    the trainer, rolling refreshes that reopen the fleet every step, the per-policy logprob
    check, the staleness and idle figures in the report and the plot."""
    out = tmp_path / "demo-async"
    run = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "demo", "--async", "--out", str(out), "--steps",
         "3", "--prompts", "2", "--group-size", "4", "--warmup-steps", "15",
         "--no-learning-check"], env=engine_env(), capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "all checks passed" in run.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["config"]["asynchronous"] and report["config"]["max_staleness"] == 1
    assert [s["step"] for s in report["steps"]] == [1, 2, 3]
    for s in report["steps"]:
        assert s["admitted"] == 2 * 4 and len(s["sample_staleness"]) == 2
        assert all(0 <= x <= 1 for x in s["sample_staleness"])
        assert set(s["tokens_by_staleness"]) <= {"0", "1"}
        assert sum(s["tokens_by_staleness"].values()) == 2 * 4 * 8
        assert s["tokens_checked"] == 2 * 4 * 8 and s["max_abs_logprob_diff"] < 1e-3
        assert s["refresh"]["decision"] == "reopened" and s["refresh"]["mode"] == "rolling"
    stream = report["stream"]
    assert stream["handed"] == 3 * 2 and stream["max_staleness_seen"] <= 1
    assert 0 <= stream["trainer_idle_fraction"] <= 1 and 0 <= stream["fleet_idle_fraction"] <= 1
    png = out / "report.png"
    assert png.stat().st_size > 10_000
    assert not set(report["fleet"]["pids"]) & process_groups()
