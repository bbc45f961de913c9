"""Policy refresh of a fleet that serves in bfloat16 (two real vLLM workers, float32
checkpoints): the default refresh reopens (probe tolerance by the dtype the workers report,
workers checked against each other, no transformers copy in the coordinator); a trainer's
probe is checked within the bf16 tolerance, and a tolerance that is set wins; the
distributed path rendezvouses at the master address it is given."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import pytest
import torch

from rlfleet.journal import SqliteJournal
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.probe import probe_from_model
from rlfleet.weights.digest import checkpoint_digest

pytestmark = pytest.mark.engine

MODEL = "tiny-bf16"
BF16_FLAGS = ("--dtype", "bfloat16", "--max-model-len", "1024", "--enforce-eager")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory, start_module_fleet, tiny_model, tiny_model_b):
    root = tmp_path_factory.mktemp("bf16-weights")
    shutil.copytree(tiny_model, root / "A")
    shutil.copytree(tiny_model_b, root / "B")
    worker = ("--model", str(root / "A"), "--served-model-name", MODEL, "--enable-rl",
              "--system-port", "0", "--allowed-weights-root", str(root), *BF16_FLAGS)
    fleet = start_module_fleet([worker] * 2, name="bf16-fleet", kind="vllm", model=MODEL,
                               lease_ttl=3, enable_rl=True)
    return fleet, root


def test_default_refresh_of_a_bf16_fleet_reopens(bf16, tmp_path):
    """Issue 9 finding 7: `rlfleet refresh` with its defaults on a fleet serving in bf16."""
    fleet, root = bf16
    journal = tmp_path / "j.sqlite"
    run = subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "refresh", "--checkpoint", str(root / "B"),
         "--version", "B", "--rl-url", fleet.rl_url, "--model", MODEL, "--journal",
         str(journal)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "decision: reopened" in run.stdout, run.stdout + run.stderr
    entry = SqliteJournal(journal).recent(1)[0]
    assert {w["dtype"] for w in entry["workers"].values()} == {"bfloat16"}
    assert entry["served_digest"] == checkpoint_digest(root / "B")
    for w in entry["workers"].values():  # the workers' own prompt, checked against each other
        probe = next(c for c in w["calls"] if c["route"] == "generate")
        assert probe["http_status"] == 200 and probe["body"]["done"] is True


def test_trainer_probe_within_the_bf16_tolerance(bf16, tmp_path):
    """The trainer gives the expected probe from its model in memory (float32); the bf16
    workers reproduce it within the tolerance of their dtype. A tolerance that is set wins:
    1e-7 is tighter than bf16 can be, so that refresh holds and says which token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fleet, root = bf16
    trainer_model = AutoModelForCausalLM.from_pretrained(str(root / "A"),
                                                         dtype=torch.float32).eval()
    prompt = AutoTokenizer.from_pretrained(str(root / "A")).encode("Hello, policy")
    probe = probe_from_model(trainer_model, prompt, 6)

    coordinator = PolicyRefresh(fleet.rl_url, model=MODEL, journal=tmp_path / "j.sqlite")
    res = asyncio.run(coordinator.refresh(root / "A", "A", probe=probe))
    assert res.ok and res.fleet_moved, res.reason

    strict = PolicyRefresh(fleet.rl_url, model=MODEL, journal=tmp_path / "j2.sqlite",
                           probe_tolerance=1e-7)
    res = asyncio.run(strict.refresh(root / "A", "A-strict", probe=probe))
    assert res.decision == "held" and not res.fleet_moved
    for w in res.workers:
        assert "max logprob diff" in w["reason"] and "> 1e-07 (token" in w["reason"], w


def test_distributed_refresh_at_a_given_master_address(bf16, tmp_path):
    """The distributed path's process group at the master address and backend given (here
    another loopback address, 127.0.0.2, than the default route to the workers)."""
    fleet, root = bf16
    coordinator = PolicyRefresh(fleet.rl_url, model=MODEL, path="vllm-distributed",
                                transfer_backend="gloo", master_address="127.0.0.2",
                                journal=tmp_path / "j.sqlite", timeout=60)
    res = asyncio.run(coordinator.refresh(root / "B", "B-dist"))
    assert res.ok and res.fleet_moved, res.reason
    apply = next(s for s in res.steps if s["name"] == "apply")
    assert apply["transfer"]["backend"] == "gloo"
    assert apply["transfer"]["master_address"] == "127.0.0.2"
    for w in res.workers:
        call = next(c for c in w["calls"] if c["route"] == "update_weights_from_distributed")
        assert call["body"]["weight_digest"] == checkpoint_digest(root / "B")
