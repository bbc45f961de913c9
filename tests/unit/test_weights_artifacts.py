"""Full and XOR-delta artifacts: ModelExpress's layout byte for byte, read back by a reader
built from ModelExpress's own functions, and artifacts that ModelExpress's functions build
read and staged by rlfleet."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from rlfleet.weights import artifacts as art
from rlfleet.weights.digest import digest_tensors, iter_checkpoint_tensors
from rlfleet.weights.publish import Publisher, publish
from tests.modelexpress_reader import (
    Adler32Checksum,
    compress_delta,
    compute_delta,
    read_safetensors_header,
)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _adler(data) -> str:
    c = Adler32Checksum()
    c.update(data)
    return c.hexdigest()


def _step(tensors: dict[str, torch.Tensor], seed: int, only: str = "layers.0.") -> dict:
    """A training step that touches only some tensors (others stay bit-identical)."""
    g = torch.Generator().manual_seed(seed)
    return {n: (t + torch.randn(t.shape, generator=g) * 1e-3).to(t.dtype) if only in n else t
            for n, t in tensors.items()}


@pytest.fixture(scope="module")
def tensors(tiny_model) -> dict[str, torch.Tensor]:
    return dict(iter_checkpoint_tensors(tiny_model))


def mx_read(root: Path, version: str, base: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """ModelExpress's reading of one version, from its functions: index, shard headers,
    Adler-32 of every tensor (full) or of every reconstructed target (delta)."""
    import zstandard

    index = json.loads((root / version / art.INDEX).read_text())
    meta, weight_map = index["metadata"], index["weight_map"]
    assert meta["checksum_format"] == "adler32"
    out = dict(base or {})
    for shard in sorted(set(weight_map.values())):
        data = (root / version / shard).read_bytes()
        header, start = read_safetensors_header(data, shard)
        sums = header["__metadata__"]
        for name in (n for n, s in weight_map.items() if s == shard):
            b, e = header[name]["data_offsets"]
            raw = np.frombuffer(data, dtype=np.uint8, count=e - b, offset=start + b)
            if base is None:
                assert _adler(raw) == sums[name]
                out[name] = raw
            else:
                assert header[name]["dtype"] == "U8" and len(header[name]["shape"]) == 1
                delta = np.frombuffer(zstandard.ZstdDecompressor().stream_reader(raw.tobytes())
                                      .read(), dtype=np.uint8)
                target = np.bitwise_xor(base[name], delta)
                assert _adler(target) == sums[name]  # the checksum is of the *target*
                out[name] = target
    return out


def test_full_layout_is_modelexpress_s(tmp_path, tensors):
    res = publish(tensors, "v1", to=f"file://{tmp_path}")
    raw = (tmp_path / "v1" / art.INDEX).read_bytes()
    index = json.loads(raw)
    assert raw == json.dumps(index, sort_keys=True, separators=(",", ":")).encode()
    assert index["metadata"] == {"checksum_format": "adler32",
                                 "total_size": sum(t.numel() * t.element_size()
                                                   for t in tensors.values())}
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    got = mx_read(tmp_path, "v1", None)
    assert all(np.array_equal(got[n], _bytes(t)) for n, t in tensors.items())
    assert res["digest"] == digest_tensors(tensors.items())
    assert res["bytes_full"] == index["metadata"]["total_size"]
    assert res["bytes_written"] == sum(p.stat().st_size for p in (tmp_path / "v1").iterdir())


def test_full_shards_stay_under_the_limit(tmp_path, tensors):
    limit = 8 << 20
    pub = Publisher(f"file://{tmp_path}", shard_limit=limit)
    pub.publish(tensors, "v1")
    shards = sorted(p.name for p in (tmp_path / "v1").glob("*.safetensors"))
    assert len(shards) > 1
    assert shards == [art.shard_name(i, len(shards)) for i in range(1, len(shards) + 1)]
    for s in shards:
        header, _ = read_safetensors_header((tmp_path / "v1" / s).read_bytes(), s)
        big = [n for n in header if n != "__metadata__"]
        size = sum(np.subtract(*reversed(header[n]["data_offsets"])) for n in big)
        assert size <= limit or len(big) == 1
    got = mx_read(tmp_path, "v1", None)
    assert all(np.array_equal(got[n], _bytes(t)) for n, t in tensors.items())


def test_delta_layout_and_exact_base(tmp_path, tensors):
    v2 = _step(tensors, 2)
    pub = Publisher(f"file://{tmp_path}")
    pub.publish(tensors, "v1")
    res = pub.publish(v2, "v2", base="v1")
    index = json.loads((tmp_path / "v2" / art.INDEX).read_text())
    assert index["metadata"] == {"version": "v2", "base_version": "v1", "delta_encoding": "xor",
                                 "compression_format": "zstd", "checksum_format": "adler32"}
    changed = {n for n in tensors if compute_delta(_bytes(v2[n]), _bytes(tensors[n]))[0] is not None}
    assert set(index["weight_map"]) == changed and 0 < len(changed) < len(tensors)
    # each changed tensor is ModelExpress's own compress_delta(compute_delta(...)), exactly
    shard = (tmp_path / "v2" / index["weight_map"][sorted(changed)[0]]).read_bytes()
    stored = safetensors.numpy.load(shard)
    for n in changed:
        delta, _ = compute_delta(_bytes(v2[n]), _bytes(tensors[n]))
        assert np.array_equal(stored[n], compress_delta(delta))
    base = {n: _bytes(t) for n, t in tensors.items()}
    got = mx_read(tmp_path, "v2", base)
    assert all(np.array_equal(got[n], _bytes(t)) for n, t in v2.items())
    assert res["bytes_written"] < res["bytes_full"] / 4
    assert res["digest"] == digest_tensors(v2.items())
    # read back by rlfleet, chain replayed from the full version
    specs, data = art.read_version(art.FileStorage(tmp_path), "v2")
    assert digest_tensors(art.as_tensors(specs, data).items()) == res["digest"]


def test_tied_output_layer_is_stored_once(tmp_path, tensors):
    with_head = dict(tensors)
    with_head["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied: same storage
    res = publish(with_head, "v1", to=f"file://{tmp_path}")
    index = json.loads((tmp_path / "v1" / art.INDEX).read_text())
    assert "lm_head.weight" not in index["weight_map"]
    assert res["digest"] == digest_tensors(tensors.items())


def test_bf16_published_from_float32_master_weights(tmp_path, tensors):
    res = publish(tensors, "v1", to=f"file://{tmp_path}", dtype=torch.bfloat16)
    specs, data = art.read_version(art.FileStorage(tmp_path), "v1")
    assert {s.dtype for s in specs.values()} == {"BF16"}
    got = art.as_tensors(specs, data)
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in tensors.items())
    assert res["bytes_full"] == sum(t.numel() * 2 for t in tensors.values())


def write_mx_version(root: Path, version: str, target: dict[str, torch.Tensor],
                     base: tuple[str, dict[str, torch.Tensor]] | None) -> None:
    """A version written the way ModelExpress's canonical publisher writes it, with its own
    functions (compute_delta, compress_delta, Adler32Checksum) and file names (its
    single-rank delta shard is model-00000-of-00001)."""
    d = root / version
    d.mkdir(parents=True)
    if base is None:
        sums = {n: _adler(_bytes(t)) for n, t in target.items()}
        shard = "model-00001-of-00001.safetensors"
        (d / shard).write_bytes(safetensors.torch.save(target, metadata=sums))
        meta = {"total_size": sum(t.numel() * t.element_size() for t in target.values()),
                "checksum_format": "adler32"}
        weight_map = dict.fromkeys(target, shard)
    else:
        encoded, sums = {}, {}
        for n, t in target.items():
            delta, _ = compute_delta(_bytes(t).copy(), _bytes(base[1][n]))
            if delta is not None:
                encoded[n] = compress_delta(delta)
                sums[n] = _adler(_bytes(t))
        shard = "model-00000-of-00001.safetensors"
        (d / shard).write_bytes(safetensors.numpy.save(encoded, metadata=sums))
        meta = {"version": version, "base_version": base[0], "delta_encoding": "xor",
                "compression_format": "zstd", "checksum_format": "adler32"}
        weight_map = dict.fromkeys(encoded, shard)
    (d / art.INDEX).write_bytes(json.dumps({"metadata": meta, "weight_map": weight_map},
                                           sort_keys=True, separators=(",", ":")).encode())


def test_modelexpress_written_chain_is_read_by_rlfleet(tmp_path, tensors):
    v2 = _step(tensors, 2)
    v3 = _step(v2, 3, only="layers.1.")
    write_mx_version(tmp_path, "v1", tensors, None)
    write_mx_version(tmp_path, "v2", v2, ("v1", tensors))
    write_mx_version(tmp_path, "v3", v3, ("v2", v2))
    specs, data = art.read_version(art.FileStorage(tmp_path), "v3")
    got = art.as_tensors(specs, data)
    assert set(got) == set(v3) and all(torch.equal(got[n], v3[n]) for n in v3)
    # and a delta published by rlfleet on a ModelExpress-written base
    res = publish(_step(v3, 4), "v4", to=f"file://{tmp_path}", base="v3")
    specs, data = art.read_version(art.FileStorage(tmp_path), "v4")
    assert digest_tensors(art.as_tensors(specs, data).items()) == res["digest"]


def test_every_safetensors_dtype_round_trips_and_bases_a_delta(tmp_path):
    """Every dtype the safetensors library reads (its own table, float8 and complex among
    them): a full version of one tensor each is read back by ModelExpress's reader and by
    rlfleet, and serves as the base of a delta (numbered from 0, as ModelExpress's shards)."""
    assert set(art.ST_DTYPES) == set(safetensors.torch._TYPES)
    assert {"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "C64", "U64"} <= set(art.ST_DTYPES)
    g = torch.Generator().manual_seed(0)

    def one(dtype: torch.dtype) -> torch.Tensor:
        if dtype.is_floating_point or dtype.is_complex:  # finite values
            return (torch.rand((3, 8), generator=g) * 4 - 2).to(dtype)
        if dtype == torch.bool:
            return torch.randint(0, 2, (3, 8), generator=g).bool()
        return torch.randint(0, 256, (24 * dtype.itemsize,), generator=g,
                             dtype=torch.uint8).view(dtype).reshape(3, 8)

    finite = {f"w.{code}": one(dtype) for code, dtype in art.ST_DTYPES.items()}
    v2 = {n: (t.float() + 0.25).to(t.dtype) if t.is_floating_point() else t.clone()
          for n, t in finite.items()}  # complex and integer tensors stay as they were
    v2["w.U8"] = v2["w.U8"] + 1
    pub = Publisher(f"file://{tmp_path}")
    pub.publish(finite, "v1")
    pub.close()
    got = mx_read(tmp_path, "v1", None)
    assert all(np.array_equal(got[n], _bytes(t)) for n, t in finite.items())
    res = publish(v2, "v2", to=f"file://{tmp_path}", base="v1")  # reads the float8 base back
    index = json.loads((tmp_path / "v2" / art.INDEX).read_text())
    assert set(index["weight_map"].values()) == {art.shard_name(0, 1)}
    assert {"w.F8_E4M3", "w.F8_E5M2", "w.U8"} <= set(index["weight_map"])
    specs, data = art.read_version(art.FileStorage(tmp_path), "v2")
    back = art.as_tensors(specs, data)
    assert {n: t.dtype for n, t in back.items()} == {n: t.dtype for n, t in v2.items()}
    assert all(np.array_equal(_bytes(back[n]), _bytes(t)) for n, t in v2.items())
    assert digest_tensors(back.items()) == res["digest"]


def test_full_shards_follow_the_order_given(tmp_path, tensors):
    """As ModelExpress batches a state dict: in its order, not sorted by name."""
    names = list(reversed(sorted(tensors)))
    art_ = art.encode_full("v1", {n: tensors[n] for n in names}, "d", shard_limit=4 << 20)
    order = [n for fname, _ in art_.files for n in names if art_.index["weight_map"][n] == fname]
    assert order == names and len(art_.files) > 1


def test_an_index_naming_another_version_is_refused(tmp_path, tensors):
    pub = Publisher(f"file://{tmp_path}")
    pub.publish(tensors, "v1")
    pub.publish(_step(tensors, 2), "v2", base="v1")
    read = art.FileStorage(tmp_path).read
    with pytest.raises(art.ArtifactError, match="the index is version 'v2', not the 'v3'"):
        art.plan_version(read, "v2", version="v3")
    with pytest.raises(art.ArtifactError, match="the delta's base is 'v1', not the 'v0'"):
        art.plan_version(read, "v2", version="v2", base_version="v0")
    assert art.plan_version(read, "v2", version="v2", base_version="v1").format == "xor-delta"


def test_corruption_and_bad_layouts_are_refused(tmp_path, tensors):
    publish(tensors, "v1", to=f"file://{tmp_path}")
    shard = tmp_path / "v1" / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(art.ArtifactError, match="Adler-32 .* does not match"):
        art.read_version(art.FileStorage(tmp_path), "v1")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / art.INDEX).write_text(json.dumps({"metadata": {"delta_encoding": "xor",
                                                          "compression_format": "lz4",
                                                          "checksum_format": "adler32",
                                                          "base_version": "v1"},
                                             "weight_map": {}}))
    with pytest.raises(art.ArtifactError, match="compression_format is 'lz4'"):
        art.read_version(art.FileStorage(tmp_path), "bad")
    clean = Publisher(f"file://{tmp_path / 'clean'}")
    clean.publish(tensors, "v1")
    with pytest.raises(art.ArtifactError, match="hold different tensors"):
        clean.publish({**tensors, "extra": torch.zeros(3)}, "v2", base="v1")
    with pytest.raises(art.ArtifactError, match="base nope is not at"):
        clean.publish(tensors, "v2", base="nope")


def test_a_delta_chain_longer_than_64_is_refused(tmp_path):
    t = {"w": torch.zeros(4)}
    pub = Publisher(f"file://{tmp_path}")
    pub.publish(t, "v0")
    for i in range(1, 66):
        t = {"w": t["w"] + 1}
        pub.publish(t, f"v{i}", base=f"v{i - 1}")
    specs, data = art.read_version(art.FileStorage(tmp_path), "v63")
    assert torch.equal(art.as_tensors(specs, data)["w"], torch.full((4,), 63.0))
    with pytest.raises(art.ArtifactError, match="longer than 64"):
        art.read_version(art.FileStorage(tmp_path), "v65")


def test_publish_command(tmp_path, tiny_model, capsys):
    from rlfleet.cli import main
    from rlfleet.weights.catalog import Catalog, VersionState

    catalog = f"sqlite://{tmp_path / 'catalog.sqlite'}"
    assert main(["publish", str(tiny_model), "--version", "v1", "--to", f"file://{tmp_path}/s",
                 "--catalog", catalog]) == 0
    line = json.loads(capsys.readouterr().out)
    assert set(line) == {"version", "base_version", "digest", "bytes_full", "bytes_written"}
    assert line["digest"] == digest_tensors(iter_checkpoint_tensors(tiny_model))
    assert main(["publish", str(tiny_model), "--version", "v2", "--base", "v1", "--to",
                 f"file://{tmp_path}/s", "--catalog", catalog]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["base_version"] == "v1" and line["bytes_written"] < 1000  # nothing changed

    async def states():
        async with Catalog(catalog) as c:
            return {v.version: (v.state, v.format.value, v.base_version) for v in await c.list()}
    import asyncio

    assert asyncio.run(states()) == {"v1": (VersionState.READY, "full", None),
                                     "v2": (VersionState.READY, "xor-delta", "v1")}
    assert main(["publish", str(tiny_model), "--version", "v3", "--base", "nope", "--to",
                 f"file://{tmp_path}/s"]) == 2
    assert "base nope is not at" in capsys.readouterr().err
    assert main(["publish", str(tiny_model), "--version", "v1", "--to", f"file://{tmp_path}/s",
                 "--catalog", catalog, "--dtype", "bfloat16"]) == 2
    assert "different request" in capsys.readouterr().err
