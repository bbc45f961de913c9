"""One PolicyIdentity through every surface that spells it (rlfleet.protocol.identity), and
a field added to it flows through them all."""

from __future__ import annotations

import msgspec
import pytest

from rlfleet.frontend.result import Result
from rlfleet.protocol.admin_vllm import InstallReply, VersionReply
from rlfleet.protocol.engine import Delta, Frame, Head
from rlfleet.protocol.identity import UNKNOWN, PolicyIdentity, WeightSpan
from rlfleet.protocol.openai import CompletionRequest
from rlfleet.protocol.rl import RlWorker
from rlfleet.protocol.sglang import MetaInfo, SglangGenerateRequest
from rlfleet.rollout.checks import weight_spans
from rlfleet.rollout.partial import PartialOutput, ResumedPrefix
from rlfleet.rollout.response import parse_openai, parse_sglang
from rlfleet.runtime.request_plane.frames import FrameReader, FrameWriter
from tests import render
from tests.render import event

POLICY = PolicyIdentity(version="v|7", digest="sha256:ab12", step=7)  # a version may hold '|'
IDENTITIES = [POLICY, PolicyIdentity(version="v1", digest="d1"), PolicyIdentity(step=0), UNKNOWN]
PROMPT = [1000, 1001, 1002]


@pytest.mark.parametrize("policy", IDENTITIES)
def test_the_identity_round_trips_through_its_own_surfaces(policy):
    assert PolicyIdentity.from_dict(policy.to_dict()) == policy
    assert PolicyIdentity.from_stamped(policy.stamped()) == policy
    assert PolicyIdentity.from_reply(policy.reply_fields()) == policy
    assert PolicyIdentity.from_span_label(policy.span_label()) == policy
    # the stamped shape is JSON as discovery entries and nvext.engine_data carry it
    assert PolicyIdentity.from_stamped(msgspec.json.decode(msgspec.json.encode(
        policy.stamped()))) == policy


def test_each_surface_spells_the_fields_as_the_contract_says():
    assert POLICY.to_dict() == {"version": "v|7", "digest": "sha256:ab12", "step": 7}
    assert POLICY.stamped() == {"weight_version": "v|7", "weight_digest": "sha256:ab12",
                                "weight_step": 7}
    assert POLICY.reply_fields() == {"version": "v|7", "weight_digest": "sha256:ab12", "step": 7}
    assert POLICY.span_label() == "v|7|sha256:ab12|7"
    assert PolicyIdentity.from_span_label("v1|d1") == PolicyIdentity(version="v1", digest="d1")
    assert PolicyIdentity.stamped_on({"id": "x"}) is None
    assert PolicyIdentity.stamped_on({"id": "x", "weight_step": 3}) == PolicyIdentity(step=3)
    assert not UNKNOWN and POLICY


class _Transport:
    def __init__(self) -> None:
        self.sent = bytearray()

    def write(self, data: bytes) -> None:
        self.sent += data

    def is_closing(self) -> bool:
        return False


@pytest.mark.parametrize("policy", IDENTITIES)
async def test_the_request_plane_head_carries_it_byte_for_byte(policy):
    head = Head.of(PROMPT, policy)
    # the wire as it was: prompt, version and digest always (null when unknown), the step
    # only when known
    old = {"prompt_token_ids": PROMPT, "weight_version": policy.version,
           "weight_digest": policy.digest}
    if policy.step is not None:
        old["weight_step"] = policy.step
    assert msgspec.msgpack.encode(head) == msgspec.msgpack.encode(old)
    writer = FrameWriter(_Transport())  # type: ignore[arg-type]
    writer.put(Frame.HEAD, 3, head)
    writer.flush()
    [(kind, sid, body)] = FrameReader().feed(bytes(writer.transport.sent))
    assert (kind, sid) == (Frame.HEAD, 3)
    assert msgspec.msgpack.decode(body, type=Head).policy == policy


def test_a_weight_span_is_the_policy_and_its_positions():
    span = WeightSpan.of(POLICY, 2, 5)
    wire = b'{"version":"v|7","digest":"sha256:ab12","step":7,"start":2,"end":5}'
    assert msgspec.json.encode(span) == wire
    assert span.policy == POLICY and span.moved(3) == WeightSpan.of(POLICY, 5, 8)
    assert WeightSpan.of(UNKNOWN, 0, 1)  # a span of an unknown policy is still a span
    # a request-plane delta's spans, as an engine yields them (dicts) and the frontend reads
    delta = msgspec.convert({"index": 0, "weight_versions": [span.to_dict()]}, Delta)
    assert delta.weight_versions == [span]
    # the rollout client reads nvext.weight_versions into the same type
    assert weight_spans([WeightSpan.of(POLICY, 0, 2).to_dict(), span.to_dict()], 5) == [
        WeightSpan.of(POLICY, 0, 2), span]


def _result(policy: PolicyIdentity) -> Result:
    res = Result("rid-1", 1)
    res.apply(event({"prompt_token_ids": PROMPT, "worker_id": 7, **policy.stamped()}))
    res.apply(event({"choices": [{"index": 0, "token_ids": [5, 6], "text": "ab", "logprobs": None,
                                  "finish_reason": "length", "stop_reason": None}]}))
    res.apply(event({"done": True, "prompt_logprobs": None}))
    return res


@pytest.mark.parametrize("policy", IDENTITIES[:3])
def test_the_frontend_stamps_it_and_the_rollout_client_reads_it_back(policy):
    res = _result(policy)
    assert res.policy == policy
    req = CompletionRequest.model_validate({
        "model": "m", "prompt": PROMPT, "max_tokens": 2,
        "nvext": {"extra_fields": ["engine_data", "weight_versions", "completion_token_ids"]}})
    body = render.completion_response(req, res, "m")
    assert body["nvext"]["engine_data"] == {**policy.stamped(), "completion_token_ids": [5, 6],
                                            "finished": True, "prompt_token_ids": PROMPT}
    gen = parse_openai(body, "rid-1")
    assert gen.policy == policy
    assert weight_spans(gen.choices[0].weight_spans, 2) == [WeightSpan.of(policy, 0, 2)]
    sreq = SglangGenerateRequest.model_validate({
        "input_ids": PROMPT, "model": "m", "rid": "rid-1", "sampling_params": {}})
    assert parse_sglang(render.sglang_body(sreq, res), "rid-1").policy == policy


def test_a_partial_attempt_keeps_its_policy_on_the_samples_spans():
    prefix = ResumedPrefix()
    prefix.keep(PartialOutput("s", 1, "aborted", [5, 6], [-1.0, -1.0], POLICY, 4), None)
    assert prefix.spans == [WeightSpan.of(POLICY, 0, 2)]
    assert prefix.spans[0].policy == POLICY


# ------------------------------------------------------------------ a field added later


class Wider(PolicyIdentity, frozen=True, kw_only=True):
    """PolicyIdentity with one more field, as a later issue adds one."""

    world_size: int | None = None


def test_a_new_field_flows_through_every_surface():
    wide = Wider(version="v1", digest="d1", step=2, world_size=4)
    assert wide.to_dict()["world_size"] == 4 and Wider.from_dict(wide.to_dict()) == wide
    assert wide.stamped()["weight_world_size"] == 4 and Wider.from_stamped(wide.stamped()) == wide
    assert wide.reply_fields()["world_size"] == 4 and Wider.from_reply(wide.reply_fields()) == wide
    assert wide.span_label() == "v1|d1|2|4" and Wider.from_span_label(wide.span_label()) == wide
    assert Wider.from_span_label("v1|d1|2") == Wider(version="v1", digest="d1", step=2)


@pytest.mark.parametrize("surface, names", [
    ("the request-plane Head", set(Head.__struct_fields__)),
    ("SGLang meta_info", set(MetaInfo.__struct_fields__)),
    ("a discovery entry", set(RlWorker.model_fields)),
])
def test_every_stamped_surface_has_a_field_for_each_identity_field(surface, names):
    missing = set(POLICY.stamped()) - names
    assert not missing, f"{surface} lacks {missing}: add them where PolicyIdentity grew"


@pytest.mark.parametrize("reply", [InstallReply, VersionReply])
def test_every_identity_reply_has_a_field_for_each_identity_field(reply):
    missing = set(POLICY.reply_fields()) - set(reply.__struct_fields__)
    assert not missing, f"{reply.__name__} lacks {missing}: add them where PolicyIdentity grew"
    assert reply(**POLICY.reply_fields()).policy() == POLICY


def test_a_weight_span_has_every_identity_field_first():
    n = len(PolicyIdentity.__struct_fields__)
    assert WeightSpan.__struct_fields__[:n] == PolicyIdentity.__struct_fields__
    assert WeightSpan.__struct_fields__[n:] == ("start", "end")
