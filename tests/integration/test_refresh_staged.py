"""Stage first, pause only for the swap, on the session's two real vLLM workers (tiny model,
float32): the default refresh of `Fleet.refresh` stages the checkpoint into each engine's
shadow while the fleet serves and commits it in keep mode with streams in flight on both
workers. Each stream finishes whole, its per-token spans name both policies, every token's
logprob is the one of the policy its span names (a transformers forward pass of that
checkpoint over the whole prefix: the KV of the frozen requests was recomputed under the new
weights), and the rollout client's rules decide on the mixed sample. A staging failure (a
wrong digest) leaves the fleet serving the old policy, open, nothing paused. (A worker that
cannot stage falls back to the disk path, journaled: tests/integration/
test_refresh_stage_first_mocker.py; on vLLM, --staged-apply reload, the same code.)"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from rlfleet.protocol.nvext import PolicyBound
from rlfleet.rl import Fleet
from rlfleet.rollout.checks import MixedPolicy, SampleRules, single_policy, weight_spans
from rlfleet.weights.digest import checkpoint_digest
from tests.fleets import MODEL_NAME, routed, weight_versions

pytestmark = pytest.mark.engine

PROMPT = [151644, 872, 198, 15, 16, 17]
TOKENS = 1000  # long enough that the refresh lands mid-stream (~20 s of streaming alone on
#               2 cores; a refresh takes ~1.5 s there, longer beside other test processes)


@pytest.fixture(scope="module")
def setup(vllm_fleet, tiny_model, tiny_model_b, tmp_path_factory):
    """The session fleet, the two checkpoints, and a trainer that refreshes in keep mode; the
    fleet is left on tiny_model (A) for the next modules."""
    ckpts = {"A": tiny_model, "B": tiny_model_b}
    trainer = Fleet(vllm_fleet.url, MODEL_NAME, rl_url=vllm_fleet.rl_url, pause_mode="keep",
                    journal=tmp_path_factory.mktemp("staged-journal") / "j.sqlite",
                    probe_tolerance=1e-4, timeout=120)
    yield vllm_fleet, ckpts, trainer
    try:
        if weight_versions(vllm_fleet)[0][1] != checkpoint_digest(tiny_model):
            back = trainer.refresh(tiny_model, "A-after-staged")
            assert back.ok and back.fleet_moved, back.reason
    finally:
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


def test_keep_mode_refresh_with_streams_in_flight(setup):
    fleet, ckpts, trainer = setup
    first = trainer.refresh(ckpts["A"], "A")  # label the weights the workers start from
    assert first.ok and first.fleet_moved, first.reason
    streams = [Stream(w.ready["url"], f"keep-{i}-{j}") for i, w in enumerate(fleet.workers)
               for j in range(2)]
    for s in streams:
        s.wait_tokens(8)
    result = trainer.refresh(ckpts["B"], "B")  # the default path: stage first, keep mode
    assert result.ok and result.fleet_moved, result.reason
    assert "stage" in result.step_seconds()
    digest = {n: checkpoint_digest(ckpts[n]) for n in ("A", "B")}
    assert result.policy.digest == digest["B"]  # the digest the workers computed as they staged
    assert weight_versions(fleet) == [("B", digest["B"])] * 2

    # every worker swapped in the version its engine prepared while it served (journaled)
    entry = trainer.coordinator.journal.get(result.refresh_id)
    for w in entry["workers"].values():
        stage = next(c for c in w["calls"] if c["step"] == "stage")
        assert stage["route"] == "staged" and stage["body"]["prepared"] == "swap", stage
        assert "apply_staged_weights" in [c["route"] for c in w["calls"]]

    for s in streams:
        s.thread.join(300)
        assert s.finish == "length" and len(s.ids) == len(s.logprobs) == TOKENS, s.finish
        spans = weight_spans(s.spans, TOKENS)
        assert len(spans) == 2, f"a stream ended before the swap: {result.step_seconds()}"
        assert [(x.version, x.digest) for x in spans] == [("A", digest["A"]), ("B", digest["B"])]
        switch = spans[1].start
        assert 0 < switch < TOKENS
        expected = (reference_logprobs(ckpts["A"], s.ids)[:switch]
                    + reference_logprobs(ckpts["B"], s.ids)[switch:])
        worst = max(abs(a - b) for a, b in zip(s.logprobs, expected, strict=True))
        assert worst < 1e-3, (switch, worst)
        # the rollout client's rules decide: a mixed sample only where they allow it
        with pytest.raises(MixedPolicy):
            single_policy(spans, SampleRules(model=MODEL_NAME))
        single_policy(spans, SampleRules(model=MODEL_NAME, allow_mixed_versions=True))
        steps = [x.step for x in spans]  # a staleness bound: one step behind, or none
        assert steps == [first.policy.step, result.policy.step]
        assert PolicyBound(min_step=first.policy.step, max_lag=1).allows(steps)
        assert not PolicyBound(min_step=result.policy.step).allows(steps)


def test_a_staging_failure_leaves_the_fleet_serving_open_nothing_paused(setup):
    fleet, ckpts, trainer = setup
    before = weight_versions(fleet)
    wrong = "blake3:" + "0" * 64
    result = trainer.refresh(ckpts["A"], "A-wrong", digest=wrong)
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
