"""Staging on a worker, from a directory and from a peer: every tensor checked as it lands,
the whole version before READY, deltas only on their exact base, leases while pulling."""

from __future__ import annotations

import asyncio
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from rlfleet.runtime.server import AppServer, bind_socket
from rlfleet.weights import artifacts as art
from rlfleet.weights.catalog import Catalog, CatalogError, VersionState
from rlfleet.weights.digest import checkpoint_digest, digest_tensors, iter_checkpoint_tensors
from rlfleet.weights.publish import Publisher, weights_app
from rlfleet.weights.stage_transfer import StageRequestError, StageState
from rlfleet.weights.staging import StagingArea
from rlfleet.worker.serve import staging_area


def _step(tensors, seed, only="layers.0."):
    g = torch.Generator().manual_seed(seed)
    return {n: t + torch.randn(t.shape, generator=g) * 1e-3 if only in n else t
            for n, t in tensors.items()}


@pytest.fixture(scope="module")
def versions(tiny_model, tmp_path_factory):
    """v1 full, v2 and v3 deltas, in a directory and in a SQLite catalog."""
    root = tmp_path_factory.mktemp("store")
    catalog = f"sqlite://{root / 'catalog.sqlite'}"
    v1 = dict(iter_checkpoint_tensors(tiny_model))
    v2 = _step(v1, 2)
    v3 = _step(v2, 3, only="layers.1.")
    pub = Publisher(f"file://{root}", catalog=catalog, model="tiny")
    out = {"root": root, "catalog": catalog, "tensors": {"v1": v1, "v2": v2, "v3": v3}}
    out["v1"] = pub.publish(v1, "v1")
    out["v2"] = pub.publish(v2, "v2", base="v1")
    out["v3"] = pub.publish(v3, "v3", base="v2")
    return out


async def _staged(area: StagingArea, version: str, source: dict, applied=(None, None), **kw):
    h = await area.stage(version, source, applied=applied, **kw)
    await asyncio.wait_for(h.done.wait(), 60)
    return h


def _disk(versions, v: str, **kw) -> dict:
    return {"kind": "disk", "path": str(versions["root"] / v), **kw}


async def test_full_then_deltas_on_the_resident_version(tmp_path, versions):
    area = StagingArea(tmp_path / "staging")
    try:
        h1 = await _staged(area, "v1", _disk(versions, "v1"))
        assert h1.state is StageState.READY, h1.error
        assert h1.digest == versions["v1"]["digest"] and h1.format == "full"
        s = h1.summary()
        assert s["bytes_done"] == s["bytes_total"] > 0 and s["tensors_done"] == s["tensors_total"]
        # the staged buffers are a version directory: what the engine loads
        assert checkpoint_digest(h1.dir) == h1.digest
        assert all(p.stat().st_mode & 0o222 == 0 for p in h1.dir.glob("*.safetensors"))
        await area.applied(h1.handle)
        assert h1.state is StageState.RELEASED and h1.applied
        h2 = await _staged(area, "v2", _disk(versions, "v2"), applied=("v1", h1.digest))
        assert h2.state is StageState.READY, h2.error
        assert h2.format == "xor-delta" and h2.digest == versions["v2"]["digest"]
        assert h2.bytes_total < h1.bytes_total / 4  # only the changed tensors moved
        await area.applied(h2.handle)
        assert not h1.dir.exists()  # the previous resident copy is dropped
        h3 = await _staged(area, "v3", _disk(versions, "v3"), applied=("v2", h2.digest))
        assert h3.digest == versions["v3"]["digest"]
        assert digest_tensors(iter_checkpoint_tensors(h3.dir)) == \
            digest_tensors(versions["tensors"]["v3"].items())
    finally:
        await area.close()
    assert not area.root.exists()


async def test_a_delta_on_the_wrong_base_is_refused(tmp_path, versions):
    area = StagingArea(tmp_path / "staging")
    try:
        h = await _staged(area, "v3", _disk(versions, "v3"), applied=("v1", "blake3:whatever"))
        assert h.state is StageState.FAILED
        assert h.error.startswith("this delta needs base v2; the worker serves v1")
        h1 = await _staged(area, "v1", _disk(versions, "v1"))
        await area.applied(h1.handle)
        # the resident copy is v1, but the engine serves something else now
        h = await _staged(area, "v2", _disk(versions, "v2"), applied=("other", "blake3:x"))
        assert h.state is StageState.FAILED and "the worker serves other" in h.error
        with pytest.raises(StageRequestError, match="is FAILED: this delta needs base v1"):
            area.ready(h.handle)
        # with "chain": true the chain is replayed from the last full version instead
        h = await _staged(area, "v3", _disk(versions, "v3", chain=True), applied=("x", "y"))
        assert h.state is StageState.READY, h.error
        assert h.digest == versions["v3"]["digest"]
    finally:
        await area.close()


async def test_the_base_is_matched_by_content_whatever_its_label(tmp_path, versions):
    """A resident copy relabelled by the engine still is v1's content: v2 applies on it. A
    worker serving v1's content from its own checkpoint (no resident copy) applies v2 with
    v1 named by a local path; with the catalog, a label that differs is not a refusal."""
    area = StagingArea(tmp_path / "staging", allowed_roots=[str(versions["root"])])
    v1 = versions["v1"]["digest"]
    try:
        h1 = await _staged(area, "v1", _disk(versions, "v1"))
        await area.applied(h1.handle, v1)
        h = await _staged(area, "v2", _disk(versions, "v2", base={"digest": v1}),
                          applied=("policy-7", v1))
        assert h.state is StageState.READY, h.error
        assert h.digest == versions["v2"]["digest"]
        await area.release(h.handle)
        await area.weights_replaced()  # serves v1's bytes from elsewhere: no resident copy
        h = await _staged(area, "v2", _disk(versions, "v2", base={"digest": v1}),
                          applied=(None, v1))
        assert h.state is StageState.FAILED and '"base": {"path": DIR}' in h.error
        h = await _staged(area, "v2", _disk(versions, "v2", base={
            "path": str(versions["root"] / "v1"), "digest": v1, "version": "v1"}),
            applied=(None, v1))
        assert h.state is StageState.READY, h.error
        assert h.digest == versions["v2"]["digest"]
        assert h.summary()["source"]["base"]["version"] == "v1"
        h = await _staged(area, "v2", _disk(versions, "v2", base={
            "path": str(versions["root"] / "v1"), "version": "v0"}), applied=(None, v1))
        assert h.state is StageState.FAILED and "the delta's base is 'v1', not the 'v0'" in h.error
    finally:
        await area.close()
    area = StagingArea(tmp_path / "staging2", catalog=versions["catalog"],
                       allowed_roots=[str(versions["root"])])
    try:
        with pytest.raises(StageRequestError, match="needs base v1; the worker serves x "
                           ".content digest blake3:other, the base's is " + v1):
            await area.stage("v2", _disk(versions, "v2"), applied=("x", "blake3:other"))
        h1 = await _staged(area, "v1", _disk(versions, "v1"))
        await area.applied(h1.handle, v1)
        h = await _staged(area, "v2", _disk(versions, "v2"), applied=("relabelled", v1))
        assert h.state is StageState.READY, h.error
        with pytest.raises(StageRequestError, match="the catalog records this delta's base as v1"):
            await area.stage("v2", _disk(versions, "v2", base={"version": "v0"}),
                             applied=("v1", v1))
    finally:
        await area.close()


async def test_a_delta_on_the_startup_checkpoint_named_by_digest_alone(tmp_path, tiny_model,
                                                                      versions):
    """A worker started from v1's checkpoint (nothing staged) applies v2 with the base named
    by its content digest alone: the files have it, checked. A digest that matches nothing
    is refused with what to send; so is a checkpoint whose files changed."""
    v1 = versions["v1"]["digest"]
    assert checkpoint_digest(tiny_model) == v1
    engine = SimpleNamespace(info=SimpleNamespace(model_path=str(tiny_model)))
    args = SimpleNamespace(weights_staging_dir=str(tmp_path / "staging"), weights_catalog=None,
                           allowed_weights_root=[], admin_token=None)
    area = staging_area(args, engine)  # the worker's: it knows the engine's model path
    try:
        assert area.startup is not None and area.startup.path == tiny_model
        h = await _staged(area, "v2", _disk(versions, "v2", base={"digest": v1}),
                          applied=(None, v1))
        assert h.state is StageState.READY, h.error
        assert h.digest == versions["v2"]["digest"] and h.format == "xor-delta"
        await area.applied(h.handle, h.digest)
        h = await _staged(area, "v3", _disk(versions, "v3"), applied=("v2", h.digest))
        assert h.state is StageState.READY and h.digest == versions["v3"]["digest"], h.error
        other = "blake3:" + "1" * 64
        h = await _staged(area, "v2", _disk(versions, "v2", base={"digest": other}),
                          applied=(None, v1))
        assert h.state is StageState.FAILED
        assert h.error.startswith("this delta needs base v1; the worker serves")
        assert f"The base digest {other} is neither a staged copy's nor that of the " \
               f"checkpoint this worker started from ({tiny_model}: {v1})" in h.error
        assert '"base": {"path": DIR}' in h.error and '"chain": true' in h.error
    finally:
        await area.close()
    changed = tmp_path / "changed"
    shutil.copytree(tiny_model, changed)
    area = StagingArea(tmp_path / "staging2", startup_checkpoint=changed)
    try:
        assert area.startup.digest() == v1
        f = next(changed.glob("*.safetensors"))
        tensors = {n: t.clone() for n, t in iter_checkpoint_tensors(changed)}
        name = sorted(tensors)[0]
        tensors[name] += 1
        save_file(tensors, f)
        h = await _staged(area, "v2", _disk(versions, "v2", base={"digest": v1}),
                          applied=(None, v1))
        assert h.state is StageState.FAILED and "neither a staged copy's" in h.error
        assert area.startup.digest() != v1  # digested again: the files changed
    finally:
        await area.close()
    # the mocker's model path is no directory: no startup checkpoint, the refusal as before
    mocked = staging_area(args, SimpleNamespace(info=SimpleNamespace(model_path="mock://tiny")))
    assert mocked.startup is None
    await mocked.close()


async def test_plain_checkpoint_and_corruption(tmp_path, tiny_model, versions):
    area = StagingArea(tmp_path / "staging")
    try:
        h = await _staged(area, "base", {"kind": "disk", "path": str(tiny_model)})
        assert h.state is StageState.READY and h.format == "checkpoint"
        assert h.digest == checkpoint_digest(tiny_model)
        bad = tmp_path / "bad"
        bad.mkdir()
        for f in (versions["root"] / "v1").iterdir():
            data = bytearray(f.read_bytes())
            if f.suffix == ".safetensors":
                data[-3] ^= 1
            (bad / f.name).write_bytes(bytes(data))
        h = await _staged(area, "v1", {"kind": "disk", "path": str(bad)})
        assert h.state is StageState.FAILED and "Adler-32" in h.error
        assert not list(area.root.glob("v1.*"))  # a failed transfer leaves nothing behind
        nan = tmp_path / "nan"
        v1 = versions["tensors"]["v1"]
        norm = torch.full_like(v1["model.norm.weight"], torch.nan)
        art.write_artifact(art.FileStorage(tmp_path),
                           art.encode_full("nan", {**v1, "model.norm.weight": norm}, "-"))
        h = await _staged(area, "nan", {"kind": "disk", "path": str(nan)})
        assert h.state is StageState.FAILED and f"holds {norm.numel()} NaN" in h.error, h.error
        assert not list(area.root.glob("nan.*"))  # refused while serving, never applied
        h = await _staged(area, "v1", _disk(versions, "v1"), digest="blake3:" + "0" * 64)
        assert h.state is StageState.FAILED
        assert "the version's is blake3:000" in h.error
    finally:
        await area.close()


async def test_bad_requests_and_release(tmp_path, versions):
    area = StagingArea(tmp_path / "staging", allowed_roots=[str(versions["root"])])
    try:
        for source, message in [
            (None, "source is required"),
            ({"kind": "ftp"}, "source.kind must be one of"),
            ({"kind": "disk"}, "source.path is required"),
            ({"kind": "disk", "path": str(tmp_path)}, "outside the allowed weights roots"),
            ({"kind": "disk", "path": str(versions["root"] / "nope")}, "does not exist"),
            ({"kind": "s3", "uri": "s3://bucket"}, "names a bucket"),
            ({"kind": "trainer"}, "trainer publisher's http://host:port"),
            ({"kind": "peer"}, r"not in the catalog \(this worker has no catalog\)"),
            ({"kind": "disk", "path": str(versions["root"] / "v1"), "timeout": 0},
             "positive number"),
            ({"kind": "disk", "path": str(versions["root"] / "v1"), "uri": "s3://b/p/v1",
              "rate": 1}, "unknown fields rate, uri for a disk source"),
            ({"kind": "s3", "uri": "s3://b/p/v1", "url": "http://x"},
             "unknown field url for a s3 source"),
            ({"kind": "disk", "path": str(versions["root"] / "v1"), "base": {"label": "v0"}},
             "source.base: unknown field label"),
            ({"kind": "disk", "path": str(versions["root"] / "v1"), "base": "v0"},
             "source.base must be an object"),
            ({"kind": "disk", "path": str(versions["root"] / "v1"),
              "base": {"path": str(tmp_path)}}, "source.base.path: .*outside the allowed"),
        ]:
            with pytest.raises(StageRequestError, match=message):
                await area.stage("v1", source, applied=(None, None))
        with pytest.raises(StageRequestError, match="version is required"):
            await area.stage("../x", _disk(versions, "v1"), applied=(None, None))
        with pytest.raises(StageRequestError, match="unknown staging handle"):
            area.get("nope")
        # released while pulling: the transfer stops, nothing stays
        h = await area.stage("v1", _disk(versions, "v1", max_bytes_per_s=4e6),
                             applied=(None, None))
        while h.bytes_done == 0:
            await asyncio.sleep(0.05)
        await area.release(h.handle)
        await area.release(h.handle)  # idempotent
        await asyncio.wait_for(h.done.wait(), 10)
        assert h.state is StageState.RELEASED and h.bytes_done < h.bytes_total
        assert not list(area.root.glob("v1.*"))
    finally:
        await area.close()


async def test_a_lease_protects_the_version_while_it_is_pulled(tmp_path, versions):
    """The catalog holds a lease for the worker while it pulls: deleting the version then
    does not evict it, and the transfer completes; afterwards the bytes can go."""
    catalog = Catalog(f"sqlite://{tmp_path / 'catalog.sqlite'}")
    pub = Publisher(f"file://{tmp_path / 'store'}", catalog=catalog.url, model="tiny")
    pub.publish(versions["tensors"]["v1"], "v1")
    area = StagingArea(tmp_path / "staging", catalog=catalog, worker_id="w0")
    try:
        h = await area.stage("v1", {"kind": "disk", "path": str(tmp_path / "store" / "v1"),
                                    "max_bytes_per_s": 10e6}, applied=(None, None))
        assert h.expected_digest == (await catalog.get("v1")).digest
        while h.bytes_done == 0:
            await asyncio.sleep(0.05)
        v = await catalog.get("v1")
        assert [lease.holder for lease in v.live_leases()] == ["w0"]
        await catalog.delete("v1")
        evicted = []
        assert not await catalog.evict("v1", lambda v: evicted.append(v.version))
        with pytest.raises(CatalogError, match="RELEASING"):
            await catalog.acquire_lease("v1", "late-worker")
        await asyncio.wait_for(h.done.wait(), 30)
        assert h.state is StageState.READY, h.error  # RELEASING did not break the install
        assert (await catalog.get("v1")).live_leases() == []
        assert await catalog.evict("v1", lambda v: evicted.append(v.version))
        assert evicted == ["v1"] and (await catalog.get("v1")).state is VersionState.EVICTED
        with pytest.raises(StageRequestError, match="v1 is EVICTED in the catalog; only a READY"):
            await area.stage("v1", {"kind": "disk", "path": str(tmp_path / "store" / "v1")},
                             applied=(None, None))
    finally:
        await area.close()
        await catalog.close()


async def test_a_peer_serves_the_version_it_applied(tmp_path, versions):
    catalog = Catalog(versions["catalog"])
    holder = StagingArea(tmp_path / "holder", catalog=catalog, worker_id="holder")
    server = None
    newcomer = StagingArea(tmp_path / "new", catalog=catalog, worker_id="new")
    try:
        server = AppServer(weights_app(holder.resident_dir), bind_socket("127.0.0.1", 0))
        await server.start()
        holder.system_url = server.url
        h = await _staged(holder, "v1", _disk(versions, "v1"))
        await holder.applied(h.handle)
        h = await _staged(holder, "v2", _disk(versions, "v2"), applied=("v1", h.digest))
        await holder.applied(h.handle)
        assert set((await catalog.get("v2")).holders) == {"holder"}
        assert (await catalog.get("v1")).holders == {}
        p = await _staged(newcomer, "v2", {"kind": "peer"})
        assert p.state is StageState.READY, p.error
        assert p.digest == versions["v2"]["digest"] and p.summary()["source"]["url"] == server.url
        p = await _staged(newcomer, "v1", {"kind": "peer", "url": server.url, "timeout": 3})
        assert p.state is StageState.FAILED and "version v1 is not served here" in p.error
    finally:
        if server is not None:
            await server.stop()
        await newcomer.close()
        await holder.close()
        assert (await catalog.get("v2")).holders == {}
        await catalog.close()


def test_staged_files_match_safetensors(tmp_path):
    """The staging buffers are laid out exactly as safetensors writes the same tensors."""
    import safetensors.torch

    from rlfleet.weights.stage_transfer import StagedFiles

    tensors = {"b": torch.arange(6, dtype=torch.bfloat16), "a": torch.ones(3),
               "c": torch.zeros(2, 2, dtype=torch.float16)}
    staged = StagedFiles(tmp_path / "v", [art.spec_of(n, t) for n, t in tensors.items()])
    for n, t in tensors.items():
        staged.slots[n][:] = art.tensor_bytes(t)
        staged.checksums[n] = art.adler32_hex(art.tensor_bytes(t))
    staged.finish()
    staged.close()
    expected = safetensors.torch.save(tensors, metadata={n: art.adler32_hex(art.tensor_bytes(t))
                                                         for n, t in tensors.items()})
    got = (tmp_path / "v" / "model-00001-of-00001.safetensors").read_bytes()
    (h_got, start_got), (h_exp, start_exp) = (art.parse_header(b, "x") for b in (got, expected))
    assert h_got == h_exp and got[start_got:] == expected[start_exp:]
    loaded = safetensors.torch.load(got)
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_staging_handle_transitions():
    from rlfleet.weights.stage_transfer import TRANSITIONS, Source, StagedVersion

    assert set(TRANSITIONS) == set(StageState) and TRANSITIONS[StageState.RELEASED] == frozenset()
    h = StagedVersion("h", "v", Source("disk", "/x", "v"), None)
    h.move(StageState.READY)
    with pytest.raises(art.ArtifactError, match="cannot go from READY to STAGING"):
        h.move(StageState.STAGING)
    h.move(StageState.RELEASED)
    for new in StageState:
        with pytest.raises(art.ArtifactError):
            h.move(new)
