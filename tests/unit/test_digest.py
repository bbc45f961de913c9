"""Checkpoint content digests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlfleet.models import make_model
from rlfleet.weights.digest import (
    DigestBuilder,
    checkpoint_digest,
    digest_tensors,
    iter_checkpoint_tensors,
    non_finite,
    tensor_digest,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a.weight": torch.randn(8, 4, generator=g),
        "b.weight": torch.randn(16, generator=g).to(torch.bfloat16),
        "c.bias": torch.arange(5, dtype=torch.int64),
        "d.scalar": torch.tensor(3.5),
        "e.norm.weight": torch.ones(4),
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("digest") / "tiny", seed=0)


def test_tensor_digest_covers_name_dtype_shape_and_bytes() -> None:
    t = torch.arange(6, dtype=torch.float32)
    base = tensor_digest("w", t)
    assert len(base) == 32
    assert tensor_digest("w", t.clone()) == base
    assert tensor_digest("v", t) != base
    assert tensor_digest("w", t.reshape(2, 3)) != base
    assert tensor_digest("w", t.view(torch.int32)) != base
    changed = t.clone()
    changed[3] += 1
    assert tensor_digest("w", changed) != base


def test_tensor_digest_bfloat16_and_non_contiguous() -> None:
    t = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert tensor_digest("w", t.t()) == tensor_digest("w", t.t().contiguous())
    assert tensor_digest("w", t) != tensor_digest("w", t.float())
    assert tensor_digest("s", torch.tensor(1.0)) != tensor_digest("s", torch.tensor([1.0]))


def test_builder_is_order_independent() -> None:
    tensors = _tensors()
    forward, backward = DigestBuilder(), DigestBuilder()
    for name, t in tensors.items():
        forward.add(name, t)
    for name, t in reversed(tensors.items()):
        backward.add(name, t)
    root = forward.root()
    assert re.fullmatch(r"blake3:[0-9a-f]{64}", root)
    assert backward.root() == root == digest_tensors(tensors.items())
    assert len(forward) == len(tensors)
    with pytest.raises(ValueError, match="duplicate"):
        forward.add("a.weight", tensors["a.weight"])


def test_builder_root_depends_on_set_of_names() -> None:
    tensors = _tensors()
    fewer = dict(tensors)
    fewer.pop("c.bias")
    assert digest_tensors(fewer.items()) != digest_tensors(tensors.items())


def test_resharding_keeps_digest(tmp_path: Path) -> None:
    tensors = _tensors()
    one = tmp_path / "one"
    one.mkdir()
    save_file(tensors, one / "model.safetensors")
    two = tmp_path / "two"
    two.mkdir()
    names = sorted(tensors)
    # Different split, and files whose name order is the reverse of tensor order.
    save_file({n: tensors[n] for n in names[3:]}, two / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[:3]}, two / "model-00002-of-00002.safetensors")
    digest = checkpoint_digest(one)
    assert checkpoint_digest(two) == digest == digest_tensors(tensors.items())
    assert sorted(n for n, _ in iter_checkpoint_tensors(two)) == names


def test_one_element_changes_digest(tmp_path: Path) -> None:
    tensors = _tensors()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    save_file(tensors, a / "model.safetensors")
    changed = {n: t.clone() for n, t in tensors.items()}
    changed["b.weight"][5] = changed["b.weight"][5] + 1
    save_file(changed, b / "model.safetensors")
    assert checkpoint_digest(a) != checkpoint_digest(b)


def test_duplicate_name_across_shards(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, tmp_path / "x.safetensors")
    save_file({"a.weight": tensors["a.weight"]}, tmp_path / "y.safetensors")
    with pytest.raises(ValueError, match="a.weight"):
        checkpoint_digest(tmp_path)
    with pytest.raises(ValueError, match="a.weight"):
        next(iter_checkpoint_tensors(tmp_path))


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        checkpoint_digest(tmp_path / "missing")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        checkpoint_digest(tmp_path)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        checkpoint_digest(tmp_path / "file.txt")


def test_model_checkpoint_digest(tiny: Path, tmp_path: Path) -> None:
    digest = checkpoint_digest(tiny)
    assert checkpoint_digest(make_model(tmp_path / "same", seed=0)) == digest
    assert checkpoint_digest(make_model(tmp_path / "other", seed=1)) != digest
    assert checkpoint_digest(make_model(tmp_path / "bf16", seed=0, dtype="bfloat16")) != digest
    # Ignores non-weight files.
    (tiny / "notes.txt").write_text("hello")
    assert checkpoint_digest(tiny) == digest


def test_cli_digest(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rlfleet.cli import main

    assert main(["digest", str(tiny)]) == 0
    assert capsys.readouterr().out.strip() == checkpoint_digest(tiny)
    assert main(["digest", str(tiny / "nope")]) == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_non_finite_finds_every_bad_value_and_only_those(dtype) -> None:
    big = torch.finfo(dtype).max
    ok = {"a": torch.randn(1000).to(dtype), "ids": torch.arange(10),
          "huge": torch.full((64,), big, dtype=dtype)}  # finite, but its sum overflows
    assert non_finite(ok.items()) is None
    for bad, what in ((float("nan"), "1 NaN and 0 infinite"), (float("inf"), "0 NaN and 1 infinite")):
        t = {**ok, "b": torch.zeros(4097, dtype=dtype)}
        t["b"][4000] = bad
        assert what in non_finite(t.items()) and "tensor b" in non_finite(t.items())
    both = {"c": torch.tensor([float("inf"), float("-inf"), 1.0], dtype=dtype)}  # sums to NaN
    assert "0 NaN and 2 infinite" in non_finite(both.items())
    builder = DigestBuilder()
    assert non_finite(ok.items(), builder) is None and len(builder) == 3
