"""SGLang's /generate as the frontend reads and answers it (rlfleet.protocol.sglang,
rlfleet.frontend.sglang.render), without a fleet: which prompts and options a request stands
for, what the engine is asked, which fields are refused by name, and the answer's
meta_info, finish reason and logprob entries built from engine events."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlfleet.frontend.result import Result
from rlfleet.protocol.sglang import REFUSED, SglangGenerateRequest
from tests import render
from tests.render import event

PROMPT = [100, 101, 102]


def parse(**body) -> SglangGenerateRequest:
    return SglangGenerateRequest.model_validate(body)


def refused(**body) -> str:
    with pytest.raises(ValidationError) as info:
        parse(**body)
    return str(info.value)


def test_single_and_batch_prompts():
    one = parse(input_ids=PROMPT)
    assert one.is_single and one.batch_size == 1 and one.item().input_ids == PROMPT
    text = parse(text="hi")
    assert text.is_single and text.item().text == "hi" and text.item().input_ids is None
    batch = parse(input_ids=[[1], [2, 3]], return_logprob=[True, False],
                  top_logprobs_num=[2, 0], sampling_params=[{"max_new_tokens": 3}, {}])
    items = batch.items()
    assert not batch.is_single and batch.batch_size == 2
    assert [i.input_ids for i in items] == [[1], [2, 3]]
    assert [i.return_logprob for i in items] == [True, False]
    assert [i.sampling.max_new_tokens for i in items] == [3, 128]  # SGLang's default
    texts = parse(text=["a", "b", "c"], return_logprob=True)
    assert [i.text for i in texts.items()] == ["a", "b", "c"]
    assert all(i.return_logprob for i in texts.items())
    # input_ids win over text when both are given
    both = parse(input_ids=PROMPT, text="ignored")
    assert both.item().input_ids == PROMPT and both.item().text is None


def test_what_the_engine_is_asked():
    s = parse(input_ids=PROMPT, return_logprob=True, top_logprobs_num=3, logprob_start_len=0,
              sampling_params={"max_new_tokens": 7, "min_new_tokens": 2, "sampling_seed": 5,
                               "no_stop_trim": True, "stop": "x", "logit_bias": {"7": -2.0},
                               "spaces_between_special_tokens": False, "stream_interval": 4,
                               "ebnf": "root ::= \"a\""}).sampling()
    assert (s.max_tokens, s.min_tokens, s.seed, s.stop) == (7, 2, 5, ["x"])
    assert s.include_stop_str_in_output and not s.spaces_between_special_tokens
    assert s.logit_bias == {7: -2.0} and s.stream_interval == 4
    assert s.structured_outputs == {"grammar": "root ::= \"a\""}
    assert (s.logprobs, s.prompt_logprobs) == (3, 3)
    plain = parse(input_ids=PROMPT, sampling_params={"json_schema": '{"type": "object"}'})
    assert plain.sampling().structured_outputs == {"json": {"type": "object"}}
    assert (plain.sampling().logprobs, plain.sampling().prompt_logprobs) == (None, None)
    # null is the default, as SGLang's SamplingParams takes it
    assert parse(input_ids=PROMPT, sampling_params={"temperature": None}).sampling().temperature == 1.0
    assert parse(input_ids=PROMPT, sampling_params=None).item().sampling.max_new_tokens == 128
    with pytest.raises(ValueError, match="Only one of"):
        parse(input_ids=PROMPT, sampling_params={"regex": "a", "ebnf": "b"}).sampling()


@pytest.mark.parametrize("body, named", [
    ({"sampling_params": {}}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [[1], []]}, "input_ids"),
    ({"input_ids": PROMPT, "sampling_params": {"bogus": 1}}, "bogus"),
    ({"input_ids": PROMPT, "sampling_params": {"n": 2}}, "n"),
    ({"input_ids": PROMPT, "sampling_params": {"stop_regex": ["a"]}}, "stop_regex"),
    ({"input_ids": PROMPT, "sampling_params": {"custom_params": {"a": 1}}}, "custom_params"),
    ({"input_ids": [[1], [2]], "rid": ["r", "r"]}, "Duplicate"),
    ({"input_ids": [[1], [2]], "return_logprob": [True]}, "return_logprob"),
    ({"input_ids": PROMPT, "rid": ["r"]}, "rid"),
    ({"input_ids": PROMPT, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"input_ids": [[1], [2]], "lora_path": ["a", "b"]}, "lora_path"),
    ({"input_ids": PROMPT, "image_data": ["x.png"]}, "image_data"),
    ({"input_ids": PROMPT, "input_embeds": [[0.5]]}, "input_embeds"),
    ({"input_ids": PROMPT, "session_params": {"id": "s"}}, "session_params"),
    ({"input_ids": PROMPT, "priority": 3}, "priority"),
    ({"text": ["a"] * 1025}, "at most 1024"),
])
def test_refused_by_name(body, named):
    assert named in refused(**body)


def test_every_refused_field_is_refused_when_set_and_accepted_at_its_default():
    for name in REFUSED:
        assert name in refused(input_ids=PROMPT, **{name: "set"})
        assert parse(input_ids=PROMPT, **{name: None}).item().input_ids == PROMPT


def test_lora_path_names_the_adapter():
    assert parse(input_ids=PROMPT, lora_path="my-adapter").adapter == "my-adapter"
    res = Result("rid-1", 1)  # an adapter's policy is stamped with its name
    res.apply(event({"prompt_token_ids": PROMPT, "weight_version": "a1", "weight_digest": "d",
                     "weight_adapter": "my-adapter"}))
    meta = render.sglang_body(parse(input_ids=PROMPT, lora_path="my-adapter"), res)["meta_info"]
    assert (meta["weight_adapter"], meta["weight_version"]) == ("my-adapter", "a1")
    assert parse(input_ids=[[1], [2]], lora_path=["a", None]).adapter == "a"
    assert parse(input_ids=PROMPT).adapter is None


def result(finish: str | None, stop_reason=None, prompt_logprobs=None, tokens=(7, 8, 9)
           ) -> Result:
    res = Result("rid-1", 1)
    res.apply(event({"prompt_token_ids": PROMPT, "worker_id": 3, "weight_version": "v2",
                     "weight_digest": "d2", "weight_step": 4}))
    res.apply(event({"choices": [{
        "index": 0, "token_ids": list(tokens), "text": "".join(f"<{t}>" for t in tokens),
        "logprobs": [{"token_id": t, "logprob": -0.5, "decoded": f"<{t}>",
                      "top": [(t, -0.5, f"<{t}>"), (t + 1, -1.5, f"<{t + 1}>")]}
                     for t in tokens],
        "finish_reason": finish, "stop_reason": stop_reason}]}))
    if finish is not None:
        res.apply(event({"done": True, "prompt_logprobs": prompt_logprobs, "cached_tokens": 2}))
    return res


def body(res: Result, **req) -> dict:
    return render.sglang_body(parse(input_ids=PROMPT, rid="rid-1", **req), res)


def test_finish_reasons_as_sglang_shapes_them():
    assert body(result("length"))["meta_info"]["finish_reason"] == {"type": "length",
                                                                    "length": 3}
    # the EOS token that ended it is what matched, as SGLang's FINISH_MATCHED_TOKEN
    assert body(result("stop"))["meta_info"]["finish_reason"] == {"type": "stop", "matched": 9}
    assert body(result("stop", "END"))["meta_info"]["finish_reason"] == {"type": "stop",
                                                                         "matched": "END"}
    abort = body(result("abort"))["meta_info"]["finish_reason"]
    assert abort["type"] == "abort" and {"message", "status_code", "err_type"} <= set(abort)
    running = body(result(None))["meta_info"]
    assert running["finish_reason"] is None and "e2e_latency" not in running


def test_meta_info_and_logprob_entries():
    prompt_lps = [None] + [{str(t): {"logprob": -2.0, "rank": 2, "decoded_token": f"[{t}]"},
                            "5": {"logprob": -0.1, "rank": 1, "decoded_token": "[5]"},
                            "6": {"logprob": -3.0, "rank": 3, "decoded_token": "[6]"}}
                           for t in PROMPT[1:]]
    out = body(result("length", prompt_logprobs=prompt_lps), return_logprob=True,
               top_logprobs_num=2, logprob_start_len=0, return_text_in_logprobs=True)
    meta = out["meta_info"]
    assert out["output_ids"] == [7, 8, 9] and out["text"] == "<7><8><9>"
    assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"]) == ("rid-1", 3, 3)
    assert (meta["weight_version"], meta["weight_digest"], meta["weight_step"]) == ("v2", "d2", 4)
    assert meta["total_retractions"] == 0 and meta["cached_tokens"] == 2  # the engine's
    assert meta["e2e_latency"] >= 0
    assert meta["output_token_logprobs"] == [[-0.5, t, f"<{t}>"] for t in (7, 8, 9)]
    assert meta["output_token_logprobs_length"] == 3
    assert meta["output_top_logprobs"][0] == [[-0.5, 7, "<7>"], [-1.5, 8, "<8>"]]
    assert meta["input_token_logprobs"] == [[None, 100, ""], [-2.0, 101, "[101]"],
                                            [-2.0, 102, "[102]"]]
    # the top 2 by rank (the prompt's own token is among them here); none at the first
    assert meta["input_top_logprobs"] == [None, [[-0.1, 5, "[5]"], [-2.0, 101, "[101]"]],
                                          [[-0.1, 5, "[5]"], [-2.0, 102, "[102]"]]]
    # without return_text_in_logprobs the text is null; from position 2 on
    plain = body(result("length", prompt_logprobs=prompt_lps), return_logprob=True,
                 logprob_start_len=2)["meta_info"]
    assert plain["output_token_logprobs"][0] == [-0.5, 7, None]
    assert plain["input_token_logprobs"] == [[-2.0, 102, None]]
    assert "output_top_logprobs" not in plain and "input_top_logprobs" not in plain
    bare = body(result("length"))["meta_info"]
    assert not {"output_token_logprobs", "input_token_logprobs"} & set(bare)
