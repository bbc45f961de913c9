"""Content identity of a checkpoint: a blake3 root over (name, dtype, shape, bytes).

The root depends only on the set of named tensors, not on how they are sharded into
files, their order inside files, or the order in which they are added.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import blake3
from safetensors import safe_open

from rlfleet.runtime.progress import Progress

if TYPE_CHECKING:  # imported where tensors are read: a process that reads none starts without
    import torch

DIGEST_PREFIX = "blake3:"
_TENSOR_DOMAIN = b"rlfleet.tensor.v1\0"
_ROOT_DOMAIN = b"rlfleet.checkpoint.v1\0"
#: Tensors at least this large are hashed with several threads.
_THREADED_BYTES = 1 << 24


def _field(data: bytes) -> bytes:
    """Length-prefixed field, so that concatenated fields are unambiguous."""
    return struct.pack("<Q", len(data)) + data


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """32-byte blake3 digest of the tensor's name, dtype, shape and raw (little-endian) bytes."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy()
    h = blake3.blake3(max_threads=blake3.blake3.AUTO if data.nbytes >= _THREADED_BYTES else 1)
    h.update(_TENSOR_DOMAIN)
    h.update(_field(name.encode()))
    h.update(_field(_dtype_name(t.dtype).encode()))
    h.update(struct.pack("<Q", t.dim()) + struct.pack(f"<{t.dim()}Q", *t.shape))
    h.update(struct.pack("<Q", data.nbytes))
    h.update(memoryview(data))
    return h.digest()


class DigestBuilder:
    """Collects per-tensor digests and combines them into one order-independent root."""

    def __init__(self) -> None:
        self._digests: dict[str, bytes] = {}

    def __len__(self) -> int:
        return len(self._digests)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Add one named tensor; a name may be added only once."""
        self.add_digest(name, tensor_digest(name, tensor))

    def add_digest(self, name: str, digest: bytes) -> None:
        """Add a digest computed earlier by `tensor_digest`."""
        if name in self._digests:
            raise ValueError(f"duplicate tensor name {name!r}")
        if len(digest) != 32:
            raise ValueError(f"tensor digest must be 32 bytes, got {len(digest)}")
        self._digests[name] = digest

    def digest_of(self, name: str) -> bytes:
        """The digest added for `name` (KeyError when none was)."""
        return self._digests[name]

    def root(self) -> str:
        """The root digest, `"blake3:<64 hex digits>"`, over the tensors sorted by name."""
        h = blake3.blake3(_ROOT_DOMAIN)
        h.update(struct.pack("<Q", len(self._digests)))
        for name in sorted(self._digests):
            h.update(_field(name.encode()))
            h.update(self._digests[name])
        return DIGEST_PREFIX + h.hexdigest()


def non_finite(tensors: Iterable[tuple[str, torch.Tensor]], digest: DigestBuilder | None = None
               ) -> str | None:
    """Why these weights must not be installed: the first tensor holding NaN or Inf (None
    when every floating-point value is finite). Adds each tensor to `digest` on the way.

    A sum is finite only when every term is (an Inf or NaN term makes it Inf or NaN), so one
    reduction clears a tensor at memory speed; only a non-finite sum (a bad tensor, or a
    finite one whose sum overflows) is looked at element by element."""
    import torch

    for name, t in tensors:
        if digest is not None:
            digest.add(name, t)
        if not t.is_floating_point():
            continue
        if t.element_size() == 1:  # float8: torch has no sum or isfinite for it
            t = t.to(torch.float16)  # exact (float16 holds every float8 value, NaN and Inf)
        if bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()):
            continue
        return (f"tensor {name} holds {int(torch.isnan(t).sum())} NaN and "
                f"{int(torch.isinf(t).sum())} infinite value(s) of {t.numel()}: non-finite "
                "weights are refused")
    return None


def digest_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Root digest of (name, tensor) pairs, e.g. the tensors handed to a weight loader."""
    builder = DigestBuilder()
    for name, tensor in tensors:
        builder.add(name, tensor)
    return builder.root()


def checkpoint_files(path: Path) -> list[Path]:
    """The `*.safetensors` files of a checkpoint directory, sorted by name."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint directory does not exist: {path}")
    if not path.is_dir():
        raise ValueError(f"checkpoint path is not a directory: {path}")
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not files:
        raise ValueError(f"no *.safetensors files in checkpoint directory: {path}")
    return files


def iter_checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every (name, tensor) of a checkpoint directory, one tensor in memory at a time.

    Files are visited in name order and tensors in name order within a file. All
    headers are read first, so a tensor name present in two files raises `ValueError`
    before any tensor is yielded.
    """
    files = checkpoint_files(path)
    owner: dict[str, Path] = {}
    plan: list[tuple[Path, list[str]]] = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            names = sorted(f.keys())
        for name in names:
            if name in owner:
                raise ValueError(
                    f"tensor {name!r} appears in both {owner[name].name} and {file.name}"
                )
            owner[name] = file
        plan.append((file, names))
    for file, names in plan:
        with safe_open(file, framework="pt") as f:
            for name in names:
                yield name, f.get_tensor(name)


def checkpoint_digest(path: Path) -> str:
    """Root digest (`"blake3:<hex>"`) over all tensors of all safetensors files in `path`
    (its progress is logged: rlfleet.runtime.progress)."""
    total = sum(f.stat().st_size for f in checkpoint_files(path))
    builder = DigestBuilder()
    with Progress(f"digest of {path}", total) as p:
        for name, tensor in iter_checkpoint_tensors(path):
            builder.add(name, tensor)
            p.add(tensor.numel() * tensor.element_size())
    return builder.root()


def checkpoint_signature(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of a checkpoint, from the file headers alone."""
    sig: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                sig[name] = (str(s.get_dtype()), tuple(s.get_shape()))
    return sig


def signature_mismatch(expected: dict[str, tuple[str, tuple[int, ...]]],
                       got: dict[str, tuple[str, tuple[int, ...]]]) -> str | None:
    """Why a checkpoint cannot replace another in place (None when it can)."""
    missing = sorted(expected.keys() - got.keys())
    extra = sorted(got.keys() - expected.keys())
    if missing or extra:
        return (f"tensor names differ (missing: {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                f"unexpected: {extra[:3]}{'...' if len(extra) > 3 else ''})")
    for name in sorted(expected):
        if expected[name][1] != got[name][1]:
            return f"tensor {name} has shape {list(got[name][1])}, expected {list(expected[name][1])}"
    return None
