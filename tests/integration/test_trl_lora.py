"""examples/trl_grpo.py --lora, as a user runs it: 2 real TRL GRPOTrainer steps training a
LoRA adapter (peft, CPU, float32) through one real vLLM worker serving the base model with
--enable-lora. The callback publishes the adapter alone (not a merged model) and refreshes
only it, verified, at the start and after each step; every sequence TRL trained on was
admitted once, from the adapter version the trainer had; the engine's logprobs through the
adapter match the trainer's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.rl import SqliteJournal
from rlfleet.runtime.launch import engine_env

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def test_two_grpo_steps_train_a_lora_adapter_through_the_fleet(tmp_path):
    out = tmp_path / "trl"
    env = engine_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--steps", "2",
                          "--workers", "1", "--lora", "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["samples_admitted"] == 16
    assert summary["refreshes_verified"] == 3
    assert summary["max_abs_logprob_diff"] < 1e-4

    trained = [json.loads(line) for line in (out / "trained.jsonl").read_text().splitlines()]
    assert len({t["sample"] for t in trained}) == 16
    assert all(t["policy"] == f"step-{t['step']}" for t in trained)

    # what was published: adapters, not merged models
    for step in ("step-1", "step-2"):
        files = {f.name for f in (out / "checkpoints" / step).iterdir()}
        assert "adapter_model.safetensors" in files and "model.safetensors" not in files

    journal = SqliteJournal(out / "journal.sqlite")
    refreshes = list(reversed(journal.recent()))
    journal.close()
    assert [r["framework_step"] for r in refreshes] == [0, 1, 2]
    for r in refreshes:
        assert r["decision"] == "reopened", r["reason"]
        assert r["update_path"] == "vllm-adapter" and r["target_adapter"] == "tiny-lora"
    assert len({r["target_digest"] for r in refreshes}) == 3  # the adapter moved each step
