"""Stage first, pause only for the swap, on two real vLLM workers (tiny model, float32): the
default refresh of `Fleet.refresh` stages the checkpoint while the fleet serves and commits it
in keep mode with streams in flight on both workers. Worker 0 swaps in the version its engine
prepared; worker 1 was started with --staged-apply reload, so it cannot stage: it installs
from disk, and the journal says so. Each stream finishes whole, its per-token spans name both
policies, every token's logprob is the one of the policy its span names (a transformers
forward pass of that checkpoint over the whole prefix: the KV of the frozen requests was
recomputed under the new weights), and the rollout client's rules decide on the mixed sample.
A staging failure (a wrong digest) leaves the fleet serving the old policy, open, nothing
paused."""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest
import torch

from rlfleet.protocol.nvext import PolicyBound
from rlfleet.rl import Fleet
from rlfleet.rollout.checks import MixedPolicy, SampleRules, single_policy, weight_spans
from rlfleet.weights.digest import checkpoint_digest
from tests.fleets import routed, vllm_worker_args, weight_versions

pytestmark = pytest.mark.engine

MODEL = "tiny-staged-keep"
PROMPT = [151644, 872, 198, 15, 16, 17]
TOKENS = 240  # long enough that the refresh lands mid-stream


@pytest.fixture(scope="module")
def setup(tmp_path_factory, start_module_fleet, tiny_model, tiny_model_b):
    root = tmp_path_factory.mktemp("staged-keep")
    for name, model in (("A", tiny_model), ("B", tiny_model_b)):
        shutil.copytree(model, root / name)
    args = vllm_worker_args(root / "A", MODEL, "--allowed-weights-root", str(root))
    fleet = start_module_fleet([args, (*args, "--staged-apply", "reload")],
                               name="staged-keep", kind="vllm", model=MODEL, lease_ttl=3,
                               enable_rl=True)
    trainer = Fleet(fleet.url, MODEL, rl_url=fleet.rl_url, pause_mode="keep",
                    journal=tmp_path_factory.mktemp("staged-journal") / "j.sqlite",
                    probe_tolerance=1e-4, timeout=120)
    yield fleet, root, trainer
    trainer.close()


class Stream:
    """A sampled generation streamed from one worker's request plane, read in a thread."""

    def __init__(self, url: str, rid: str) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.spans: list[dict] = []
        self.finish: str | None = None
        body = {"request_id": rid, "prompt_token_ids": PROMPT, "stream": True,
                "sampling": {"temperature": 1.0, "seed": 7, "max_tokens": TOKENS,
                             "ignore_eos": True, "logprobs": 0}}
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=300) as r:
            for line in r.iter_lines():
                for c in json.loads(line).get("choices", []) if line else []:
                    self.ids += c.get("token_ids") or []
                    self.logprobs += [lp["logprob"] for lp in c.get("logprobs") or []]
                    self.spans = c.get("weight_versions") or self.spans
                    self.finish = c.get("finish_reason") or self.finish

    def wait_tokens(self, n: int) -> None:
        deadline = time.monotonic() + 120
        while len(self.ids) < n:
            assert time.monotonic() < deadline and self.thread.is_alive(), self.ids
            time.sleep(0.01)


def reference_logprobs(checkpoint, ids: list[int]) -> list[float]:
    """Each generated token's logprob under `checkpoint`, given the prompt and every token
    before it (transformers, float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    seq = torch.tensor([PROMPT + ids])
    with torch.no_grad():
        logits = model(seq).logits[0, len(PROMPT) - 1:-1].float()
    lps = torch.log_softmax(logits, -1)
    return lps[torch.arange(len(ids)), torch.tensor(ids)].tolist()


def stages(result) -> dict[str, dict]:
    """Each worker's stage record in the refresh's journal entry, by system URL."""
    return {w["system_url"]: next(c for c in w["calls"] if c["step"] == "stage")
            for w in result.workers}


def test_keep_mode_refresh_with_streams_in_flight(setup):
    fleet, root, trainer = setup
    first = trainer.refresh(root / "A", "A")  # label the weights the workers start from
    assert first.ok and first.fleet_moved, first.reason
    streams = [Stream(w.ready["url"], f"keep-{i}-{j}") for i, w in enumerate(fleet.workers)
               for j in range(2)]
    for s in streams:
        s.wait_tokens(8)
    result = trainer.refresh(root / "B", "B")  # the default path: stage first, keep mode
    assert result.ok and result.fleet_moved, result.reason
    assert "stage" in result.step_seconds()
    digest = {n: checkpoint_digest(root / n) for n in ("A", "B")}
    assert result.policy.digest == digest["B"]  # the digest the workers computed as they staged
    assert weight_versions(fleet) == [("B", digest["B"])] * 2

    # worker 0 swapped in what its engine prepared; worker 1 cannot stage: from disk, journaled
    swapped, reloaded = (w.ready["system_url"] for w in fleet.workers)
    how = stages(result)
    assert how[swapped]["route"] == "staged" and how[swapped]["body"]["prepared"] == "swap"
    assert how[reloaded]["route"] == "fallback"
    assert how[reloaded]["body"]["install"] == "update_weights_from_disk"
    assert "--staged-apply reload" in how[reloaded]["body"]["why"]
    entry = trainer.coordinator.journal.get(result.refresh_id)
    journaled = {w["system_url"]: [c["route"] for c in w["calls"]]
                 for w in entry["workers"].values()}
    assert "fallback" in journaled[reloaded] and "update_weights_from_disk" in journaled[reloaded]
    assert "apply_staged_weights" in journaled[swapped]

    for s in streams:
        s.thread.join(300)
        assert s.finish == "length" and len(s.ids) == len(s.logprobs) == TOKENS, s.finish
        spans = weight_spans(s.spans, TOKENS)
        assert [(x.version, x.digest) for x in spans] == [("A", digest["A"]), ("B", digest["B"])]
        switch = spans[1].start
        assert 0 < switch < TOKENS
        expected = (reference_logprobs(root / "A", s.ids)[:switch]
                    + reference_logprobs(root / "B", s.ids)[switch:])
        worst = max(abs(a - b) for a, b in zip(s.logprobs, expected, strict=True))
        assert worst < 1e-3, (switch, worst)
        # the rollout client's rules decide: a mixed sample only where they allow it
        with pytest.raises(MixedPolicy):
            single_policy(spans, SampleRules(model=MODEL))
        single_policy(spans, SampleRules(model=MODEL, allow_mixed_versions=True))
        steps = [x.step for x in spans]  # a staleness bound: one step behind, or none
        assert steps == [first.policy.step, result.policy.step]
        assert PolicyBound(min_step=first.policy.step, max_lag=1).allows(steps)
        assert not PolicyBound(min_step=result.policy.step).allows(steps)


def test_a_staging_failure_leaves_the_fleet_serving_open_nothing_paused(setup):
    fleet, root, trainer = setup
    before = weight_versions(fleet)
    wrong = "blake3:" + "0" * 64
    result = trainer.refresh(root / "A", "A-wrong", digest=wrong)
    assert result.decision == "held" and "nothing was gated" in result.reason, result.reason
    assert wrong in result.reason
    assert not {"gate", "pause", "apply"} & {s["name"] for s in result.steps}
    assert weight_versions(fleet) == before  # the old policy serves on
    for w in fleet.workers:
        paused = httpx.get(f"{w.ready['system_url']}/engine/is_paused", timeout=10)
        assert paused.json()["is_paused"] is False
        staged = httpx.post(f"{w.ready['system_url']}/engine/get_staged_weights", json={},
                            timeout=10).json()["staged"]
        assert not [h for h in staged if h["state"] == "READY"], staged  # nothing left held
    assert len(routed(fleet, 2)) == 2  # both open
    assert trainer.rollout_gate.is_open
    out = trainer.generate("after-held", PROMPT, n=1)  # the trainer rolls out on the old policy
    assert out.policy.digest == before[0][1]
