"""An adapter version loaded beside the serving one, without an engine process: the admin
bodies of staging and switching, the versions a request naming an adapter (or a version's
own engine name) runs on, and an adapter version's source checks."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import msgspec
import pytest

from rlfleet.models import make_adapter, make_model
from rlfleet.protocol import admin
from rlfleet.protocol.admin import read_request
from rlfleet.protocol.admin_base import AdminRequestError
from rlfleet.protocol.admin_lora import LoraLoadRequest, LoraStagedQuery, LoraStageRequest, LoraVersionRequest
from rlfleet.vllm.adapters import LoraAdapters
from rlfleet.weights.adapters import publish_adapter
from rlfleet.weights.artifacts import ArtifactError
from rlfleet.weights.catalog import Catalog, VersionState
from rlfleet.weights.digest import checkpoint_digest, checkpoint_signature
from rlfleet.weights.publish import TrainerServer
from rlfleet.weights.stage_transfer import StageRequestError
from rlfleet.weights.staging import StagingArea
from rlfleet.worker.engine import BadRequest, UnknownAdapter
from rlfleet.worker.lora_admin import LoraAdmin
from rlfleet.worker.system_server import FleetFence, StaleEpoch


def test_the_staging_and_switching_bodies_say_what_is_missing():
    assert LoraLoadRequest(lora_name="a", handle="h1").handle == "h1"
    with pytest.raises(AdminRequestError, match="lora_path is required.*stage_lora_adapter"):
        LoraLoadRequest(lora_name="a")
    with pytest.raises(AdminRequestError, match="not both"):
        LoraLoadRequest(lora_name="a", lora_path="/x", handle="h1")
    with pytest.raises(AdminRequestError, match="version is required"):
        read_request(admin.STAGE_LORA_ADAPTER, {"lora_name": "a", "source": {"kind": "s3"}})
    with pytest.raises(AdminRequestError, match="weight_version is required"):
        read_request(admin.ACTIVATE_LORA_ADAPTER, {"lora_name": "a"})
    got = read_request(admin.DISCARD_LORA_ADAPTER, {"lora_name": "a", "weight_version": "v"})
    assert got == LoraVersionRequest(lora_name="a", weight_version="v")
    names = admin.route_names(admin.LORA_STAGED)
    assert names <= set(admin.ROUTES)
    assert not any(n in ("load_lora", "unload_lora") for n in names)  # Dynamo's RL route list


class FakeLlm:
    """What LoraAdapters calls on vLLM's AsyncLLM: add_lora / remove_lora, recorded."""

    def __init__(self) -> None:
        self.loaded: dict[int, str] = {}

    async def add_lora(self, lora) -> bool:
        self.loaded[lora.lora_int_id] = lora.lora_name
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return self.loaded.pop(lora_id, None) is not None


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("beside")
    model = make_model(root / "model", size="tiny", seed=1)
    return (checkpoint_signature(model),
            {k: make_adapter(root / k, rank=4, seed=i) for i, k in enumerate(("v1", "v2", "v3"))})


def test_a_version_loaded_beside_serves_only_its_own_name_until_activated(base_and_adapters):
    sig, ads = base_and_adapters

    async def run() -> None:
        llm = FakeLlm()
        loras = LoraAdapters(llm, sig, max_loras=4, max_rank=8)
        await loras.load("a", ads["v1"], "v1", 1)
        running = loras.bind("a")  # a request running on v1 through the switch
        policy, name = await loras.load_beside("a", ads["v2"], "v2", 2)
        assert policy.version == "v2" and name.startswith("a@")
        assert loras.policy_of("a").version == "v1"  # the adapter's name: still v1
        assert loras.policy_of(name).version == "v2"  # its own name: v2
        assert [s.policy.version for s in loras.states()] == ["v1"]
        with pytest.raises(UnknownAdapter, match="no version 'v9' loaded beside"):
            await loras.activate("a", "v9")
        _, replaced = await loras.activate("a", "v2")
        assert replaced == "v1" and loras.policy_of("a").version == "v2"
        assert len(llm.loaded) == 2  # v1 stays until its request ends
        loras.release(running)
        await asyncio.sleep(0)
        assert list(llm.loaded.values()) == [name]

        _, third = await loras.load_beside("a", ads["v3"], "v3", 3)
        await loras.discard("a", "v3")
        await asyncio.sleep(0)
        assert loras.policy_of("a").version == "v2" and third not in llm.loaded.values()
        with pytest.raises(BadRequest, match="digest"):  # refused by name, nothing loaded
            await loras.load_beside("a", ads["v3"], "v3", 3, digest="blake3:00")
        assert loras.beside == {}

    asyncio.run(run())


def test_a_first_version_loaded_beside_is_an_adapter_once_activated(base_and_adapters):
    sig, ads = base_and_adapters

    async def run() -> None:
        loras = LoraAdapters(FakeLlm(), sig, max_loras=1, max_rank=8)
        _, name = await loras.load_beside("b", ads["v1"], "v1", 0)
        with pytest.raises(UnknownAdapter):
            loras.policy_of("b")  # not served under its name yet
        assert loras.bind(name).policy.version == "v1"
        with pytest.raises(BadRequest, match="--max-loras"):  # the one beside counts
            await loras.load("c", ads["v2"], "v2", 0)
        await loras.activate("b", "v1")
        assert loras.policy_of("b").version == "v1"

    asyncio.run(run())


def test_an_adapter_source_must_name_an_adapter_version_whole(tmp_path, base_and_adapters):
    _, ads = base_and_adapters
    publish_adapter(ads["v1"], tmp_path / "out", "p-v1")
    (tmp_path / "plain").mkdir()
    lora = LoraAdmin(SimpleNamespace(adapter_limits=lambda: (2, 8)), [tmp_path],
                     lambda: "base")
    cfg = lora._config({"kind": "disk", "path": str(tmp_path / "out" / "p-v1")}, "p-v1")
    assert cfg == (ads["v1"] / "adapter_config.json").read_bytes()
    cases = {
        "has no adapter_config.json": {"kind": "disk", "path": str(tmp_path / "plain")},
        "pulled whole": {"kind": "peer", "url": "http://127.0.0.1:9", "fanout": {}},
        "source.url is required": {"kind": "peer"},
        "outside": {"kind": "disk", "path": "/etc"},
    }
    for says, source in cases.items():
        with pytest.raises(StageRequestError, match=says):
            lora._config(source, "p-v1")
    with pytest.raises(ArtifactError, match="reading adapter_config.json failed"):
        lora._config({"kind": "trainer", "url": f"http://127.0.0.1:{free_port()}"}, "p-v1")
    # the route's caller reads the refusal in the reply, and nothing is left staged
    for says, source in {"source.kind must be one of": {},
                         "has no adapter_config.json": cases["has no adapter_config.json"]
                         }.items():
        reply = asyncio.run(lora.stage_lora_adapter(
            LoraStageRequest(lora_name="p", version="p-v1", source=source)))
        assert reply.status == "error" and says in reply.message, reply
        assert reply.handle is msgspec.UNSET
    staged = asyncio.run(lora.get_staged_lora_adapter(LoraStagedQuery(lora_name="p")))
    assert staged.status == "error" and "nothing was staged" in staged.message


def test_an_adapter_version_in_the_catalog_is_staged_from_the_holders_it_lists(
        tmp_path, base_and_adapters):
    """publish_adapter with a catalog registers the version READY (a delta with its base),
    as a model version; a worker with that catalog finds the other workers that hold it
    (not itself) and reads the version from the first holder that answers."""
    _, ads = base_and_adapters
    cat = tmp_path / "catalog.sqlite"
    with TrainerServer(tmp_path / "out") as holder:  # serves /weights as a worker does
        publish_adapter(ads["v1"], holder.dir, "c-v1", catalog=cat, model="c")
        publish_adapter(ads["v2"], holder.dir, "c-v2", base=("c-v1", ads["v1"]), catalog=cat,
                        model="c")
        staging = StagingArea(tmp_path / "staging", catalog=str(cat), worker_id="w1")
        lora = LoraAdmin(SimpleNamespace(adapter_limits=lambda: (2, 8)), [tmp_path],
                         lambda: "base", staging=staging)

        async def run() -> None:
            async with Catalog(cat) as c:
                v1, v2 = await c.get("c-v1"), await c.get("c-v2")
                assert (v1.model, v1.state, v1.format.value, v1.digest) == (
                    "c", VersionState.READY, "full", checkpoint_digest(ads["v1"]))
                assert (v2.state, v2.format.value, v2.base_version) == (
                    VersionState.READY, "xor-delta", "c-v1")
                with pytest.raises(StageRequestError, match="no other worker holds c-v1"):
                    await lora._config_of("c", {"kind": "peer"}, "c-v1")
                dead = f"http://127.0.0.1:{free_port()}"
                for worker, url in (("w0", dead), ("w1", "http://self"), ("w2", holder.url)):
                    await c.add_holder("c-v1", worker, system_url=url)
            assert await lora._area("c").holder_urls("c-v1") == [dead, holder.url]
            got = await lora._config_of("c", {"kind": "peer"}, "c-v1")
            assert got == (ads["v1"] / "adapter_config.json").read_bytes()
            bare = LoraAdmin(SimpleNamespace(adapter_limits=lambda: (2, 8)), [tmp_path],
                             lambda: "base")
            with pytest.raises(StageRequestError, match=r"in this worker's catalog \(it has "
                                                        r"none\)"):
                await bare._config_of("c", {"kind": "peer"}, "c-v1")

        asyncio.run(run())


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reading_an_adapters_staged_versions_with_a_stale_epoch_is_refused(tmp_path):
    """As the base model's staged-weights read: an epoch older than the adapter's newest is
    refused (StaleEpoch, 409) and does not move the fence; another adapter's is its own."""
    lora = LoraAdmin(SimpleNamespace(adapter_limits=lambda: (2, 8)), [tmp_path],
                     lambda: "base")
    lora.fences["a"] = FleetFence()
    lora.fences["a"].check(5, advance=True)

    async def run() -> None:
        with pytest.raises(StaleEpoch):
            await lora.get_staged_lora_adapter(LoraStagedQuery(lora_name="a", fleet_epoch=4))
        got = await lora.get_staged_lora_adapter(LoraStagedQuery(lora_name="a", fleet_epoch=6))
        assert "nothing was staged" in got.message and lora.fences["a"].newest == 5
        got = await lora.get_staged_lora_adapter(LoraStagedQuery(lora_name="b", fleet_epoch=1))
        assert "nothing was staged" in got.message

    asyncio.run(run())
