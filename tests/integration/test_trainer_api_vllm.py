"""The trainer-facing API against real vLLM (the session fleet: frontend + 2 workers serving
"tiny"): text and chat prompts give exactly what the same prompt sent as the engine's IDs
gives; a next turn keeps the engine's tokens verbatim; every sampling parameter the
SamplingSpec offers changes what the engine does; Fleet.rollout from 4 threads at once
admits every sample once. Reads only: no weights change."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from transformers import AutoTokenizer

from rlfleet.models.tokenizer import IM_END_ID
from rlfleet.rl import (
    AttemptState,
    Chat,
    Fleet,
    NextTurn,
    RetryPolicy,
    SampleFailed,
    SampleLedger,
    SampleRequest,
    SamplingSpec,
)
from tests.fleets import MODEL_NAME

pytestmark = pytest.mark.engine

PROMPT = [151644, 8948, 198, 40]
GREEDY = SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
SEEDED = SamplingSpec(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, prompt_logprobs=True)


@pytest.fixture(scope="module")
def fleet(vllm_fleet):
    with Fleet(vllm_fleet.url, MODEL_NAME, rl_url=vllm_fleet.rl_url,
               retry=RetryPolicy(2, attempt_timeout=120)) as f:
        yield f


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def same_sample(a, b) -> None:
    """The same prompt IDs, generated tokens and (engine) logprobs, prompt logprobs too."""
    assert a.prompt_ids == b.prompt_ids
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
    for ca, cb in zip(a.completions, b.completions, strict=True):
        assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-5)
    assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
    assert a.prompt_logprobs[1:] == pytest.approx(b.prompt_logprobs[1:], abs=1e-5)


@pytest.mark.parametrize("spec,n", [(GREEDY, 1), (SEEDED, 2)], ids=["greedy", "seeded-n2"])
def test_text_and_chat_prompts_match_the_same_prompt_as_engine_ids(fleet, tokenizer, spec, n):
    tag = f"{spec.temperature}-{n}"
    text = fleet.generate(f"text-{tag}", "The quick brown fox", spec, n=n)
    # the worker's tokenizer made the IDs, and the frontend's /tokenize agrees
    assert text.prompt_ids == fleet.tokenize("The quick brown fox") == \
        tokenizer.encode("The quick brown fox")
    same_sample(text, fleet.generate(f"text-ids-{tag}", text.prompt_ids, spec, n=n))

    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hello, how are you?"}]
    chat = fleet.generate(f"chat-{tag}", Chat(messages, {"enable_thinking": False}), spec, n=n)
    assert tokenizer.decode(chat.prompt_ids) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello, how are you?"
        "<|im_end|>\n<|im_start|>assistant\n")
    same_sample(chat, fleet.generate(f"chat-ids-{tag}", chat.prompt_ids, spec, n=n))
    # streamed chat (chunks parsed into the same sample), and a plain list of messages
    same_sample(chat, fleet.generate(f"chat-stream-{tag}", messages, spec, n=n, stream=True))


def test_a_next_turn_keeps_the_engine_tokens_verbatim(fleet, tokenizer):
    first = [{"role": "user", "content": "Hi"}]
    # turn 1 ends with the engine's EOS (<|im_end|>, forced once min_tokens allow it)
    ended = fleet.generate("turn1-eos", first, SamplingSpec(max_tokens=6, temperature=0.0,
                                                               min_tokens=2,
                                                               logit_bias={IM_END_ID: 100.0}))
    assert ended.completion.finish_reason == "stop" and len(ended.completion.token_ids) == 3
    assert ended.completion.token_ids[-1] == IM_END_ID
    # turn 1 cut by length: the template's whole turn end comes after it
    cut = fleet.generate("turn1-cut", first, SamplingSpec(max_tokens=3, temperature=0.0,
                                                             ignore_eos=True))
    assert cut.completion.finish_reason == "length"
    new = [{"role": "user", "content": "And then?"}]
    rendered_new = "<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
    for earlier, closing in ((ended, "\n"), (cut, "<|im_end|>\n")):
        nxt = fleet.generate(f"turn2-{earlier.sample_id}", NextTurn(earlier, new), GREEDY)
        kept = earlier.prompt_ids + earlier.completion.token_ids
        assert nxt.prompt_ids[:len(kept)] == kept  # the engine's tokens, not re-tokenised
        assert tokenizer.decode(nxt.prompt_ids[len(kept):]) == closing + rendered_new
        assert len(nxt.completion.token_ids) == 8 and nxt.policy.digest == earlier.policy.digest
        # and the engine was prompted with exactly those IDs
        same_sample(nxt, fleet.generate(f"turn2-ids-{earlier.sample_id}", nxt.prompt_ids, GREEDY))


def run(fleet: Fleet, name: str, **spec) -> list[int]:
    return fleet.generate(name, PROMPT, SamplingSpec(max_tokens=8, ignore_eos=True,
                                                     **spec)).completion.token_ids


def test_every_sampling_parameter_reaches_the_engine(fleet, tokenizer):
    """Each parameter changes the engine's output the way vLLM defines it (on this model the
    greedy continuation of PROMPT repeats one token, which makes the effects visible)."""
    greedy = run(fleet, "p-greedy", temperature=0.0)
    x = greedy[0]
    assert greedy == [x] * 8
    # penalties: the repeated token is pushed down after it has appeared
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        got = run(fleet, f"p-{name}", temperature=0.0, **{name: 2.0})
        assert got[0] == x and Counter(got)[x] < 8, (name, got)
    # logit bias: a +100 bias makes the token certain; the same token at +3 shifts its logprob
    forced = run(fleet, "p-bias", temperature=0.0, logit_bias={PROMPT[1]: 100.0})
    assert forced == [PROMPT[1]] * 8
    base = fleet.generate("p-lp", PROMPT, SamplingSpec(max_tokens=1, temperature=0.0))
    biased = fleet.generate("p-lp-bias", PROMPT, SamplingSpec(max_tokens=1, temperature=0.0,
                                                             logit_bias={x: 3.0}))
    assert biased.completion.logprobs[0] > base.completion.logprobs[0] + 2.0
    # min_p = 1 and top_k = 1 keep only the most likely token: sampling at T=1 is greedy
    assert run(fleet, "p-min-p", temperature=1.0, min_p=1.0) == greedy
    assert run(fleet, "p-top-k", temperature=1.0, top_k=1) == greedy
    assert run(fleet, "p-top-p", temperature=1.0, top_p=1e-6) == greedy
    # seed: the same seed samples the same tokens, another seed others
    assert run(fleet, "p-seed-a", seed=5) == run(fleet, "p-seed-b", seed=5)
    assert run(fleet, "p-seed-a2", seed=5) != run(fleet, "p-seed-c", seed=6)
    # stop token IDs and stop strings end the completion at the token that completes them
    for name, stop in (("ids", {"stop_token_ids": (x,)}),
                       ("str", {"stop": (tokenizer.decode([x]),)})):
        s = fleet.generate(f"p-stop-{name}", PROMPT, SamplingSpec(max_tokens=8, temperature=0.0,
                                                                 **stop))
        assert s.completion.token_ids == [x] and s.completion.finish_reason == "stop", name
    # EOS (forced by a bias): ends at once; not before min_tokens; ignored with ignore_eos
    eos = {IM_END_ID: 100.0}
    s = fleet.generate("p-eos", PROMPT, SamplingSpec(max_tokens=8, temperature=0.0, logit_bias=eos))
    assert s.completion.token_ids == [IM_END_ID] and s.completion.finish_reason == "stop"
    s = fleet.generate("p-min-tokens", PROMPT, SamplingSpec(max_tokens=8, temperature=0.0,
                                                            logit_bias=eos, min_tokens=3))
    assert len(s.completion.token_ids) == 4 and s.completion.token_ids[-1] == IM_END_ID
    assert IM_END_ID not in s.completion.token_ids[:3]
    s = fleet.generate("p-ignore-eos", PROMPT, SamplingSpec(max_tokens=5, temperature=0.0,
                                                            logit_bias=eos, ignore_eos=True))
    assert s.completion.token_ids == [IM_END_ID] * 5 and s.completion.finish_reason == "length"


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused(fleet):
    with pytest.raises(SampleFailed) as info:
        fleet.generate("bad-bias", PROMPT, SamplingSpec(logit_bias={10**7: 1.0}))
    assert "400" in info.value.reason and "logit_bias" in info.value.reason
    assert len(info.value.reasons) == 1  # a bad request is not retried


def test_fleet_rollout_from_four_threads_admits_every_sample_once(vllm_fleet):
    """Four trainer threads roll out at once through one Fleet; two of them send the same 8
    samples (a duplicated batch). Every sample is admitted exactly once."""
    ledger = SampleLedger()
    spec = SamplingSpec(max_tokens=4, temperature=1.0, ignore_eos=True)
    batches = [[SampleRequest(f"thread{t}/s{i}", [151644, 100 + i, 198], spec) for i in range(8)]
               for t in range(3)]
    batches.append(batches[0])  # thread 3 repeats thread 0's samples
    results: list = [None] * 4
    errors: list[BaseException] = []
    with Fleet(vllm_fleet.url, MODEL_NAME, ledger=ledger, concurrency=4) as fleet:
        def work(t: int) -> None:
            try:
                results[t] = fleet.rollout(batches[t])
            except BaseException as e:  # noqa: BLE001  (reported below)
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        assert not errors, errors
        admitted = ledger.admitted()  # read from this thread, not the fleet's
    wanted = {s.sample_id for b in batches for s in b}
    assert set(admitted) == wanted and len(wanted) == 24
    for sid in wanted:
        attempts = ledger.attempts(sid)
        assert sum(a.admitted for a in attempts) == 1
        assert all(a.state is not AttemptState.ACCEPTED for a in attempts)  # none left open
    for t in (1, 2):
        assert all(o.admitted for o in results[t])
    # the duplicated samples: per sample, one of the two calls has it, the other says why not
    for a, b in zip(results[0], results[3], strict=True):
        assert a.admitted != b.admitted, (a, b)
        loser = b if a.admitted else a
        assert loser.reason in ("already_admitted", "attempt_closed"), loser.reason
    ledger.close()
