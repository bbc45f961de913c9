"""LoRA adapters as policies, without an engine: the adapter in PolicyIdentity's surfaces,
the checks of an adapter's files against a base model, routing a request that names an
adapter, the admin bodies, and the refresh config."""

from __future__ import annotations

import msgspec
import pytest

from rlfleet.frontend.router import NoWorker, Worker, WorkerPool, within
from rlfleet.journal.record import IDENTITY_FIELDS, stored_columns
from rlfleet.models import make_adapter, make_model
from rlfleet.protocol import admin, admin_lora
from rlfleet.protocol.admin_base import AdminRequestError
from rlfleet.protocol.engine import Head
from rlfleet.protocol.identity import PolicyIdentity, WeightSpan
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.refresh.config import RefreshConfig
from rlfleet.vllm.adapters import adapter_problem
from rlfleet.vllm.args import engine_args, parse_args
from rlfleet.weights.adapters import is_artifact, materialize_adapter, publish_adapter
from rlfleet.weights.artifacts import WrongBase
from rlfleet.weights.digest import checkpoint_digest, checkpoint_signature

ADAPTED = PolicyIdentity(version="a-v1", digest="blake3:aa", step=3, adapter="a")
BASE = PolicyIdentity(version="v1", digest="blake3:bb", step=2)


def test_the_adapter_is_on_every_surface_and_the_base_model_spells_none():
    assert ADAPTED.to_dict()["adapter"] == "a" and "adapter" not in BASE.to_dict()
    assert ADAPTED.stamped()["weight_adapter"] == "a" and "weight_adapter" not in BASE.stamped()
    assert PolicyIdentity.from_stamped(ADAPTED.stamped()) == ADAPTED
    assert PolicyIdentity.from_dict(ADAPTED.to_dict()) == ADAPTED
    assert PolicyIdentity(adapter=None) == PolicyIdentity() and not PolicyIdentity(adapter=None)
    assert Head.of([1], ADAPTED).policy == ADAPTED
    assert b"adapter" not in msgspec.json.encode(WeightSpan.of(BASE, 0, 2))
    assert WeightSpan.of(ADAPTED, 0, 2).policy == ADAPTED
    assert ADAPTED.span_label() == "a-v1|blake3:aa|3"  # the engine's label: the base's shape
    assert ADAPTED.of_adapter(None) == PolicyIdentity(version="a-v1", digest="blake3:aa", step=3)
    assert "adapter" in IDENTITY_FIELDS  # a journal column of its own
    assert stored_columns({"target": ADAPTED})["target_adapter"] == "a"


@pytest.fixture(scope="module")
def base_signature(tmp_path_factory):
    return checkpoint_signature(make_model(tmp_path_factory.mktemp("base") / "m", size="tiny"))


def test_an_adapter_is_checked_against_the_base_by_rank_and_shape(tmp_path, base_signature):
    rank, why = adapter_problem(make_adapter(tmp_path / "ok", rank=8), base_signature, 16)
    assert (rank, why) == (8, None)
    rank, why = adapter_problem(make_adapter(tmp_path / "r32", rank=32), base_signature, 16)
    assert rank == 32 and "--max-lora-rank 16" in why
    _, why = adapter_problem(make_adapter(tmp_path / "small", size="small", rank=4),
                             base_signature, 16)
    assert "another base model" in why
    _, why = adapter_problem(tmp_path / "none", base_signature, 16)
    assert "does not exist" in why
    (tmp_path / "empty").mkdir()
    _, why = adapter_problem(tmp_path / "empty", base_signature, 16)
    assert "adapter_config.json" in why


def worker(iid: int, step: int, adapters: list[dict] | None = None) -> Worker:
    entry = {"weight_step": step, **({"adapters": adapters} if adapters else {})}
    return Worker(iid, "base", f"http://w{iid}", f"w{iid}:1", entry)


def test_a_request_naming_an_adapter_goes_to_workers_that_serve_it_within_its_own_bound():
    pool = WorkerPool(discovery=None, namespace="ns")  # type: ignore[arg-type]
    a1 = {"adapter": "a", "version": "a-v1", "step": 7}
    a2 = {"adapter": "a", "version": "a-v2", "step": 9}
    pool.workers = {1: worker(1, 1, [a1]), 2: worker(2, 1, [a2]), 3: worker(3, 1)}
    assert pool.adapters() == {"a": "base"}
    assert {w.instance_id for w in pool.for_model("a")} == {1, 2}
    assert {w.instance_id for w in pool.for_model("base")} == {1, 2, 3}
    # the staleness bound counts the adapter's own steps, not the base model's
    ok = within(PolicyBound(max_lag=0), pool.for_model("a"), "a")
    assert [w.instance_id for w in ok] == [2]
    with pytest.raises(NoWorker) as e:
        pool.pick("b")
    assert e.value.status == 404 and "LoRA adapters: a" in str(e.value)
    # an adapter closed by its refresh: its requests wait, the base model's go on
    pool.workers = {1: worker(1, 1, [{**a1, "open": False}])}
    with pytest.raises(NoWorker) as e:
        pool.pick("a")
    assert e.value.status == 503 and pool.workers[1].gated_for("a")
    assert pool.pick("base").instance_id == 1 and not pool.workers[1].gated_for("base")


def test_adapter_admin_bodies_say_what_is_missing():
    with pytest.raises(AdminRequestError, match="lora_path is required"):
        admin.read_request(admin.LOAD_LORA_ADAPTER, {"lora_name": "a"})
    with pytest.raises(AdminRequestError, match="lora_name is required"):
        admin.read_request(admin.LOAD_LORA_ADAPTER, {"lora_name": "", "lora_path": "/x"})
    with pytest.raises(AdminRequestError, match="fleet_epoch"):
        admin.read_request(admin.SET_LORA_ADMISSION, {"lora_name": "a", "open": True,
                                                      "fleet_epoch": -1})
    assert {"load_lora", "unload_lora"}.isdisjoint(admin.ROUTES)
    reply = admin_lora.LoraAdapterReply(lora_name="a", **ADAPTED.reply_fields())
    assert reply.policy() == ADAPTED


def test_an_adapter_refresh_names_its_adapter():
    cfg = RefreshConfig(rl_url="http://x", path="vllm-adapter", adapter="a")
    assert cfg.adapter == "a"
    with pytest.raises(ValueError, match="adapter"):
        RefreshConfig(rl_url="http://x", path="vllm-adapter")
    with pytest.raises(ValueError, match="adapter"):
        RefreshConfig(rl_url="http://x", adapter="a")


def test_adapter_versions_travel_as_artifacts_and_a_delta_applies_on_its_base_only(tmp_path):
    a1, a2 = make_adapter(tmp_path / "a1", seed=1), make_adapter(tmp_path / "a2", seed=2)
    publish_adapter(a1, tmp_path / "art", "v1")
    delta = publish_adapter(a2, tmp_path / "art", "v2", base=("v1", a1))
    assert delta.format == "xor-delta" and delta.digest == checkpoint_digest(a2)
    assert is_artifact(tmp_path / "art" / "v2") and not is_artifact(a1)
    m1 = materialize_adapter(tmp_path / "art" / "v1", tmp_path / "m1", None)
    assert checkpoint_digest(m1) == checkpoint_digest(a1)
    m2 = materialize_adapter(tmp_path / "art" / "v2", tmp_path / "m2", ("v1", m1))
    assert checkpoint_digest(m2) == checkpoint_digest(a2)
    with pytest.raises(WrongBase, match="delta against adapter version 'v1'.*serves 'v2'"):
        materialize_adapter(tmp_path / "art" / "v2", tmp_path / "m3", ("v2", m2))
    with pytest.raises(WrongBase, match="serves 'none'"):
        materialize_adapter(tmp_path / "art" / "v2", tmp_path / "m4", None)


def test_the_worker_takes_vllms_lora_arguments_and_checks_them(capsys):
    args = parse_args(["--model", "m", "--enable-lora", "--max-loras", "3", "--max-lora-rank",
                       "16", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b"}'])
    ea = engine_args(args)
    assert ea.enable_lora and ea.max_loras == 3 and ea.max_lora_rank == 16
    assert [(m.name, m.path) for m in args.lora_modules] == [("a", "/x/a"), ("b", "/x/b")]
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--lora-modules", "a=/x/a"])
    assert "needs --enable-lora" in capsys.readouterr().err
