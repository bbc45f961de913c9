"""Policy versions as files, byte-compatible with ModelExpress's S3 layout.

A version lives under ``<prefix>/<version>/`` with ``model.safetensors.index.json``:

* full: index ``{"metadata": {"total_size", "checksum_format": "adler32"}, "weight_map"}``;
  shards ``model-NNNNN-of-NNNNN.safetensors`` (at most 4 GiB of tensors each) whose
  safetensors metadata maps every tensor to the Adler-32 (8 hex digits) of its bytes.
* xor-delta: index ``{"metadata": {"version", "base_version", "delta_encoding": "xor",
  "compression_format": "zstd", "checksum_format": "adler32"}, "weight_map"}``; every
  changed tensor is the bytewise XOR of target and base over the whole tensor, compressed
  as its own zstd level-1 frame and stored as a uint8 array; unchanged tensors are absent;
  the shard metadata holds the Adler-32 of each changed tensor's *target* bytes. Delta
  shards are ``model-NNNNN-of-NNNNN.safetensors`` numbered from 0 (ModelExpress writes one
  per rank that has changes), full shards from 1, in the order the tensors were given. A
  delta is applied only on the exact base it names (by label, or by content digest).

Tensors may be of every dtype the safetensors library reads (`ST_DTYPES`, its own table).

Index JSON is written with sorted keys and no spaces, last, so a reader never sees a
version whose files are not all there. The same layout lives in a local directory
(``file://``), on S3 (``s3://bucket/prefix``), and is served over HTTP byte ranges by a
trainer (`rlfleet.weights.publish`) or a peer worker (`/weights/<version>/<file>`).

This module stays whole because it is one format: the layout, the code that plans and
reads a version, and the three storages that hold it change together."""

from __future__ import annotations

import abc
import concurrent.futures
import functools
import json
import os
import struct
import threading
import urllib.parse
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

try:  # ISA-L's Adler-32 is several times faster than zlib's; the same checksum
    from isal.isal_zlib import adler32 as _adler32
except ImportError:  # pragma: no cover - isal has wheels for the usual platforms
    from zlib import adler32 as _adler32

INDEX = "model.safetensors.index.json"
SHARD_LIMIT = 4 << 30  # bytes of tensors per shard, as ModelExpress batches them
CHECKSUM_FORMAT = "adler32"
TIED_OUTPUT = "lm_head.weight"
TIED_INPUT = "model.embed_tokens.weight"

if TYPE_CHECKING:
    import torch


@functools.cache
def st_dtypes() -> dict[str, torch.dtype]:
    """safetensors dtype codes -> torch dtypes: the safetensors library's own table (every
    code its torch reader knows, float8 and complex included). torch is imported here, on
    first use, not with this module: a process that lists, plans or serves no tensors (the
    control service, a simulated worker) starts without it (~2 s of CPU)."""
    import safetensors.torch
    return dict(safetensors.torch._TYPES)


@functools.cache
def _st_codes() -> dict[torch.dtype, str]:
    return {v: k for k, v in st_dtypes().items()}


def __getattr__(name: str) -> Any:
    if name == "ST_DTYPES":  # the table, read as a constant
        return st_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ArtifactError(RuntimeError):
    """An artifact is missing, malformed or does not check out; the message says which."""


class ArtifactMissing(ArtifactError, FileNotFoundError):
    """A file of the version is not at the source."""


class WrongBase(ArtifactError):
    """A delta offered on a base other than the one it names."""


STREAM_PIECE = 256 << 10  # bytes per piece of a streamed ranged read


def shard_name(i: int, n: int) -> str:
    """A shard's file name; full shards count from 1, delta shards from 0 (ModelExpress)."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def adler32_hex(data: Any) -> str:
    return f"{_adler32(data) & 0xFFFFFFFF:08x}"


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw little-endian bytes as a flat uint8 array (no copy when possible)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return _st_codes()[dtype]
    except KeyError:
        raise ArtifactError(f"dtype {dtype} cannot be stored in safetensors") from None


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * st_dtypes()[self.dtype].itemsize

    def as_tensor(self, data: np.ndarray) -> torch.Tensor:
        """A tensor view over `data` (the spec's bytes; a read-only buffer stays unwritten:
        the views are only read)."""
        import torch

        if not self.nbytes:
            return torch.empty(self.shape, dtype=st_dtypes()[self.dtype])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable"
            raw = torch.frombuffer(data, dtype=torch.uint8)  # any dtype: bytes, then a view
        return raw.view(st_dtypes()[self.dtype]).reshape(self.shape)


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, dtype_code(t.dtype), tuple(t.shape))


def drop_tied_output(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A tied output layer is not stored twice: drop `lm_head.weight` when it is the input
    embedding (same storage, or equal bytes)."""
    import torch

    out = dict(tensors)
    head, emb = out.get(TIED_OUTPUT), out.get(TIED_INPUT)
    if head is not None and emb is not None and head.shape == emb.shape and (
            head.data_ptr() == emb.data_ptr() or torch.equal(head, emb)):
        del out[TIED_OUTPUT]
    return out


# ---------------------------------------------------------------- safetensors headers


def order_specs(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """The order safetensors writes tensors in: larger items first, then by name (keeps
    every tensor aligned to its item size)."""
    return sorted(specs, key=lambda s: (-st_dtypes()[s.dtype].itemsize, s.name))


def build_header(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None
                 ) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """A safetensors header (length prefix included) for `specs`, and each tensor's
    (start, end) offsets within the data region."""
    head: dict[str, Any] = {}
    if metadata:
        head["__metadata__"] = dict(metadata)
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for s in order_specs(specs):
        offsets[s.name] = (pos, pos + s.nbytes)
        head[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
        pos += s.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def parse_header(data: bytes, source: str) -> tuple[dict[str, Any], int]:
    """(header, data start) of a safetensors file whose first bytes are `data`."""
    if len(data) < 8:
        raise ArtifactError(f"{source}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > 100 << 20 or 8 + n > len(data):
        raise ArtifactError(f"{source}: invalid safetensors header length {n}")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise ArtifactError(f"{source}: invalid safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise ArtifactError(f"{source}: invalid safetensors header")
    return header, 8 + n


# ---------------------------------------------------------------- encoding


@dataclass
class Artifact:
    """An encoded version, ready to write: `files` then the index (last)."""

    version: str
    format: str  # "full" | "xor-delta"
    base_version: str | None
    files: list[tuple[str, bytes]]
    index: dict[str, Any]
    bytes_full: int  # bytes of the whole model's tensors
    digest: str
    changed: int = 0  # tensors stored (a delta stores only the changed ones)

    @property
    def index_bytes(self) -> bytes:
        return json.dumps(self.index, sort_keys=True, separators=(",", ":")).encode()

    @property
    def bytes_written(self) -> int:
        return sum(len(d) for _, d in self.files) + len(self.index_bytes)

    @property
    def parts(self) -> list[str]:
        return [name for name, _ in self.files] + [INDEX]


def _batches(items: list[tuple[str, int]], limit: int) -> list[list[str]]:
    out: list[list[str]] = []
    size = 0
    for name, n in items:
        if out and out[-1] and size + n <= limit:
            out[-1].append(name)
            size += n
        else:
            out.append([name])
            size = n
    return out


def encode_full(version: str, tensors: Mapping[str, torch.Tensor], digest: str,
                shard_limit: int = SHARD_LIMIT) -> Artifact:
    """A full version: shards of at most `shard_limit` bytes, Adler-32 per tensor, batched in
    the order the tensors are given (as ModelExpress batches a state dict)."""
    from safetensors.torch import save

    if not tensors:
        raise ArtifactError(f"version {version}: no tensors to publish")
    names = list(tensors)
    batches = _batches([(n, tensors[n].numel() * tensors[n].element_size()) for n in names],
                       shard_limit)
    files, weight_map, total = [], {}, 0
    for i, batch in enumerate(batches, start=1):
        fname = shard_name(i, len(batches))
        part = {n: tensors[n].detach().cpu().contiguous() for n in batch}
        sums = {n: adler32_hex(tensor_bytes(t)) for n, t in part.items()}
        files.append((fname, save(part, metadata=sums)))
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total, "checksum_format": CHECKSUM_FORMAT},
             "weight_map": weight_map}
    return Artifact(version, "full", None, files, index, total, digest, len(names))


CODEC_CHUNK = 1 << 20  # XOR, checksum and compress in pieces that stay in cache


def encode_tensor(target: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, str] | None:
    """(zstd frame of target XOR base, Adler-32 of target), or None when they are equal.

    One pass in cache-sized pieces: each piece is XORed into a small buffer, checksummed and
    fed to one streaming zstd level-1 frame (one frame per tensor, as the format wants). While
    every piece so far is zero nothing is compressed: an unchanged tensor costs one XOR."""
    import zstandard

    if target.nbytes != base.nbytes:
        raise ArtifactError("tensor changed byte size")
    n = target.nbytes
    buf = np.empty(min(CODEC_CHUNK, max(n, 1)), dtype=np.uint8)
    comp, parts, value, pos = None, [], 1, 0
    while pos < n:
        k = min(len(buf), n - pos)
        x = buf[:k]
        np.bitwise_xor(target[pos:pos + k], base[pos:pos + k], out=x)
        if comp is None:
            if not x.any():
                pos += k
                continue
            comp = zstandard.ZstdCompressor(level=1).compressobj(size=n)
            if pos:  # the equal prefix: zeros in the frame, its bytes in the checksum
                value = _adler32(target[:pos], value)
                zeros = np.zeros(min(len(buf), pos), dtype=np.uint8)
                for z in range(0, pos, len(zeros)):
                    parts.append(comp.compress(zeros[:min(len(zeros), pos - z)]))
        value = _adler32(target[pos:pos + k], value)
        parts.append(comp.compress(x))
        pos += k
    if comp is None:
        return None
    parts.append(comp.flush())
    return np.frombuffer(b"".join(parts), dtype=np.uint8), f"{value & 0xFFFFFFFF:08x}"


def encode_delta(version: str, base_version: str, tensors: Mapping[str, torch.Tensor],
                 base: Mapping[str, np.ndarray], digest: str,
                 shard_limit: int = SHARD_LIMIT, threads: int | None = None) -> Artifact:
    """An exact-base XOR delta of `tensors` against `base` (name -> base bytes)."""
    from safetensors.numpy import save

    if set(tensors) != set(base):
        missing, extra = sorted(set(base) - set(tensors)), sorted(set(tensors) - set(base))
        raise ArtifactError(f"version {version} and its base {base_version} hold different "
                            f"tensors (missing: {missing[:3]}, new: {extra[:3]}): publish it full")

    def one(name: str) -> tuple[str, np.ndarray | None, str | None, int]:
        cur = tensor_bytes(tensors[name])
        if cur.nbytes != base[name].nbytes:
            raise ArtifactError(f"tensor {name} changed byte size since {base_version}: "
                                "publish a full version")
        encoded = encode_tensor(cur, base[name])
        if encoded is None:
            return name, None, None, cur.nbytes
        return name, *encoded, cur.nbytes

    with ThreadPoolExecutor(threads or codec_threads()) as pool:
        results = list(pool.map(one, sorted(tensors)))
    total = sum(r[3] for r in results)
    changed = [(n, frame, s) for n, frame, s, _ in results if frame is not None]
    batches = _batches([(n, f.nbytes) for n, f, _ in changed], shard_limit)
    by_name = {n: (f, s) for n, f, s in changed}
    files, weight_map = [], {}
    for i, batch in enumerate(batches):  # numbered from 0, as ModelExpress's per-rank shards
        fname = shard_name(i, len(batches))
        files.append((fname, save({n: by_name[n][0] for n in batch},
                                  metadata={n: by_name[n][1] for n in batch})))
        weight_map.update(dict.fromkeys(batch, fname))
    index = {"metadata": {"version": version, "base_version": base_version,
                          "delta_encoding": "xor", "compression_format": "zstd",
                          "checksum_format": CHECKSUM_FORMAT},
             "weight_map": weight_map}
    return Artifact(version, "xor-delta", base_version, files, index, total, digest, len(changed))


# ---------------------------------------------------------------- storage


class Storage(abc.ABC):
    """Where versions live: keys are ``<version>/<file>`` below the storage's root."""

    uri: str

    @abc.abstractmethod
    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of `key` (the whole object without a range)."""

    def stream(self, key: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) of `key` in pieces as they arrive (a reader can use each one
        before the range is complete); the pieces may fall short of `end` when the
        transfer breaks off."""
        yield self.read(key, start, end)

    def write(self, key: str, data: bytes) -> None:
        raise ArtifactError(f"{self.uri} is read-only")

    def delete_version(self, version: str) -> None:
        """Remove every file of `version`, its index first: a reader that has not read the
        index yet finds no version rather than one with files missing (idempotent)."""
        raise ArtifactError(f"{self.uri} is read-only")

    def version_bytes(self, version: str) -> int:
        """Bytes of every file stored under `version` (0 when there is none)."""
        raise ArtifactError(f"{self.uri}: cannot measure {version}")

    def exists(self, key: str) -> bool:
        try:
            self.read(key, 0, 1)
            return True
        except FileNotFoundError:
            return False

    def list_version(self, version: str) -> list[str]:
        """File names of a version directory (only where listing is possible)."""
        raise ArtifactError(f"{self.uri}: cannot list {version}; it needs {INDEX}")

    def close(self) -> None:
        return None


class FileStorage(Storage):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.uri = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        p = (self.root / key)
        if ".." in Path(key).parts:
            raise ArtifactError(f"bad key {key!r}")
        return p

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        with open(self._path(key), "rb") as f:
            if start is None:
                return f.read()
            f.seek(start)
            return f.read(end - start if end is not None else -1)

    def write(self, key: str, data: bytes) -> None:
        p = self._path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, p)

    def delete_version(self, version: str) -> None:
        import shutil

        self._path(f"{version}/{INDEX}").unlink(missing_ok=True)
        shutil.rmtree(self._path(version), ignore_errors=True)

    def version_bytes(self, version: str) -> int:
        d = self._path(version)
        return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.is_dir() else 0

    def list_version(self, version: str) -> list[str]:
        d = self._path(version)
        if not d.is_dir():
            raise FileNotFoundError(f"{d} is not a directory")
        return sorted(p.name for p in d.iterdir() if p.is_file())


class S3Storage(Storage):
    """boto3 against any S3 endpoint; credentials from the usual environment. Every call
    has connect and read timeouts; retries are the caller's (it knows its deadline)."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None,
                 timeout: float = 30.0) -> None:
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.client = boto3.client(
            "s3", endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None,
            config=Config(connect_timeout=timeout, read_timeout=timeout,
                          retries={"max_attempts": 1, "mode": "standard"},
                          s3={"addressing_style": "path"}))

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        from botocore.exceptions import ClientError

        kw: dict[str, Any] = {}
        if start is not None:
            kw["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self._key(key), **kw)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(f"{self.uri}/{key}") from None
            raise
        with r["Body"] as body:
            return body.read()

    def stream(self, key: str, start: int, end: int) -> Iterator[bytes]:
        from botocore.exceptions import ClientError

        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self._key(key),
                                       Range=f"bytes={start}-{end - 1}")
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(f"{self.uri}/{key}") from None
            raise
        body = r["Body"]  # a StreamingBody (its context manager yields the raw stream)
        try:
            yield from body.iter_chunks(STREAM_PIECE)
        finally:
            body.close()

    def write(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def _objects(self, version: str) -> Iterator[dict[str, Any]]:
        pager = self.client.get_paginator("list_objects_v2")
        for page in pager.paginate(Bucket=self.bucket, Prefix=self._key(version) + "/"):
            yield from page.get("Contents", [])

    def delete_version(self, version: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(f"{version}/{INDEX}"))
        keys = [o["Key"] for o in self._objects(version)]
        for i in range(0, len(keys), 1000):  # at most 1,000 keys per DeleteObjects
            self.client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})

    def version_bytes(self, version: str) -> int:
        return sum(int(o["Size"]) for o in self._objects(version))

    def close(self) -> None:
        self.client.close()


class HttpStorage(Storage):
    """Read-only: ``<base_url>/weights/<version>/<file>`` with Range requests (a trainer's
    publisher or a peer worker's system server)."""

    def __init__(self, base_url: str, timeout: float = 30.0,
                 headers: Mapping[str, str] | None = None) -> None:
        import httpx

        self.base = base_url.rstrip("/")
        self.uri = self.base
        self.http = httpx.Client(timeout=timeout, headers=dict(headers or {}))

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        headers = {}
        if start is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        r = self.http.get(f"{self.base}/weights/{key}", headers=headers)
        if r.status_code == 404:
            raise FileNotFoundError(f"{self.base}/weights/{key}: {r.text[:200]}")
        if r.status_code not in (200, 206):
            raise ArtifactError(f"{self.base}/weights/{key}: HTTP {r.status_code} {r.text[:200]}")
        data = r.content
        if start is not None and r.status_code == 200:  # the server ignored the range
            data = data[start:end]
        return data

    def stream(self, key: str, start: int, end: int) -> Iterator[bytes]:
        url = f"{self.base}/weights/{key}"
        with self.http.stream("GET", url, headers={"Range": f"bytes={start}-{end - 1}"}) as r:
            if r.status_code == 404:
                raise FileNotFoundError(f"{url}: {r.read()[:200]!r}")
            if r.status_code == 200:  # the server ignored the range
                yield r.read()[start:end]
                return
            if r.status_code != 206:
                raise ArtifactError(f"{url}: HTTP {r.status_code} {r.read()[:200]!r}")
            yield from r.iter_bytes(STREAM_PIECE)

    def close(self) -> None:
        self.http.close()


def open_storage(uri: str | Path, endpoint_url: str | None = None,
                 timeout: float = 30.0) -> Storage:
    """``file:///dir``, a plain directory path, ``s3://bucket[/prefix]`` or ``http(s)://``."""
    text = str(uri)
    p = urllib.parse.urlsplit(text)
    if p.scheme == "s3":
        if not p.netloc:
            raise ValueError(f"bad S3 URI {text!r}: expected s3://bucket/prefix")
        return S3Storage(p.netloc, p.path, endpoint_url, timeout)
    if p.scheme in ("http", "https"):
        return HttpStorage(text, timeout)
    if p.scheme == "file":
        if p.netloc not in ("", "localhost"):
            raise ValueError(f"bad file URI {text!r}: expected file:///absolute/dir")
        return FileStorage(urllib.parse.unquote(p.path))
    if p.scheme == "":
        return FileStorage(text)
    raise ValueError(f"unsupported weights location {text!r}: use file:///dir, s3://bucket/prefix "
                     "or http(s)://host:port")


def split_version_uri(uri: str) -> tuple[str, str]:
    """``s3://b/prefix/VERSION`` -> (``s3://b/prefix``, ``VERSION``)."""
    text = str(uri).rstrip("/")
    parent, _, version = text.rpartition("/")
    if not version or not parent or parent.endswith(":/"):
        if text.startswith("s3://") and text.count("/") == 2:
            raise ValueError(f"{uri!r} names a bucket, not a version: s3://bucket/prefix/VERSION")
        raise ValueError(f"{uri!r} does not name a version directory")
    return parent, version


def write_artifact(storage: Storage, artifact: Artifact,
                   on_part: Callable[[str], Any] | None = None) -> int:
    """Write the files, then the index; `on_part(name)` after each. Returns bytes written."""
    for name, data in artifact.files:
        storage.write(f"{artifact.version}/{name}", data)
        if on_part:
            on_part(name)
    storage.write(f"{artifact.version}/{INDEX}", artifact.index_bytes)
    if on_part:
        on_part(INDEX)
    return artifact.bytes_written


# ---------------------------------------------------------------- reading


@dataclass
class Entry:
    """One stored tensor: where its bytes are and what they must check out to."""

    name: str
    file: str  # file name within the version directory
    start: int  # absolute byte range in the file
    end: int
    spec: TensorSpec  # the stored tensor (a delta: the compressed uint8 frame)
    checksum: str | None  # Adler-32 of the (target) bytes, when the artifact carries one


@dataclass
class VersionPlan:
    """What a version directory holds, from its index and shard headers alone."""

    key: str  # the version's directory below the storage root
    format: str  # "full" | "xor-delta" | "checkpoint" (plain HF, no checksums)
    version: str | None  # as the index names it (deltas); None otherwise
    base_version: str | None
    entries: list[Entry] = field(default_factory=list)

    @property
    def stored_bytes(self) -> int:
        return sum(e.end - e.start for e in self.entries)


def _read_index(read: Callable[..., bytes], key: str,
                list_files: Callable[[str], list[str]] | None
                ) -> tuple[dict[str, Any], dict[str, str] | None, list[str]]:
    """(index metadata, weight_map, shard files) of the version at `key`; without an index
    (a plain HF checkpoint directory) the files are listed, where the storage can list."""
    try:
        raw = read(f"{key}/{INDEX}")
    except FileNotFoundError as missing:
        if list_files is None:
            raise ArtifactError(f"{key}: no {INDEX}, not a published version ({missing})"
                                ) from None
        files = [f for f in list_files(key) if f.endswith(".safetensors")]
        if not files:
            raise ArtifactError(f"{key}: neither {INDEX} nor *.safetensors files") from None
        return {}, None, files
    try:
        index = json.loads(raw)
        weight_map = index["weight_map"]
        meta = index.get("metadata") or {}
    except (ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"{key}/{INDEX}: not a valid index ({e!r})") from e
    if not isinstance(weight_map, dict) or not isinstance(meta, dict):
        raise ArtifactError(f"{key}/{INDEX}: weight_map and metadata must be objects")
    files = sorted(set(weight_map.values()))
    for f in files:
        if not isinstance(f, str) or "/" in f or f in (".", "..") or not f.endswith(".safetensors"):
            raise ArtifactError(f"{key}/{INDEX}: bad shard name {f!r}")
    return meta, weight_map, files


def _check_index_metadata(key: str, meta: dict[str, Any], version: str | None,
                          base_version: str | None) -> bool:
    """Refuse an index this reader cannot apply, or one naming another version (or, for a
    delta, another base) than the one asked for. True for a delta."""
    named = meta.get("version")
    if version is not None and named is not None and named != version:
        raise ArtifactError(f"{key}/{INDEX}: the index is version {named!r}, not the "
                            f"{version!r} asked for")
    if meta.get("delta_encoding") is None:
        if meta.get("checksum_format") not in (None, CHECKSUM_FORMAT):
            raise ArtifactError(f"{key}/{INDEX}: checksum_format {meta['checksum_format']!r} is "
                                "not supported (adler32 is)")
        return False
    for k, want in (("delta_encoding", "xor"), ("compression_format", "zstd"),
                    ("checksum_format", CHECKSUM_FORMAT)):
        if meta.get(k) != want:
            raise ArtifactError(f"{key}/{INDEX}: {k} is {meta.get(k)!r}; only {want!r} is "
                                "supported")
    if not meta.get("base_version"):
        raise ArtifactError(f"{key}/{INDEX}: a delta without base_version")
    if base_version is not None and meta["base_version"] != base_version:
        raise ArtifactError(f"{key}/{INDEX}: the delta's base is {meta['base_version']!r}, "
                            f"not the {base_version!r} expected")
    return True


def plan_version(read: Callable[..., bytes], key: str,
                 list_files: Callable[[str], list[str]] | None = None, *,
                 version: str | None = None, base_version: str | None = None) -> VersionPlan:
    """Read the index (or, for a plain HF checkpoint directory, list its safetensors files)
    and every shard's header. `read(key, start, end)` is the storage's ranged read. An index
    that names a `version` other than the one asked for, or a delta whose `base_version` is
    not the expected one, is refused."""
    meta, weight_map, files = _read_index(read, key, list_files)
    is_delta = _check_index_metadata(key, meta, version, base_version)
    checked = meta.get("checksum_format") == CHECKSUM_FORMAT
    plan = VersionPlan(key, "xor-delta" if is_delta else ("full" if checked else "checkpoint"),
                       meta.get("version"), meta.get("base_version"))
    seen: set[str] = set()
    for f in files:
        head = read(f"{key}/{f}", 0, 8)
        if len(head) < 8:
            raise ArtifactError(f"{key}/{f}: truncated safetensors file")
        (n,) = struct.unpack("<Q", head)
        header, start = parse_header(head + read(f"{key}/{f}", 8, 8 + n), f"{key}/{f}")
        sums = header.pop("__metadata__", None) or {}
        for name, info in header.items():
            if weight_map is not None and weight_map.get(name) != f:
                continue  # not this shard's (an index is the authority)
            if name in seen:
                raise ArtifactError(f"{key}: tensor {name} stored twice")
            seen.add(name)
            try:
                b, e = info["data_offsets"]
                spec = TensorSpec(name, info["dtype"], tuple(info["shape"]))
            except (KeyError, TypeError, ValueError) as err:
                raise ArtifactError(f"{key}/{f}: bad header entry for {name}") from err
            if spec.dtype not in st_dtypes():
                raise ArtifactError(f"{key}/{f}: tensor {name} has dtype {spec.dtype!r}, which "
                                    "the safetensors library does not read "
                                    f"({', '.join(st_dtypes())})")
            if e - b != spec.nbytes:
                raise ArtifactError(f"{key}/{f}: bad header entry for {name}")
            if is_delta and spec.dtype != "U8":
                raise ArtifactError(f"{key}/{f}: delta tensor {name} is {spec.dtype}, not U8")
            sum_ = sums.get(name) if checked else None
            if checked and not isinstance(sum_, str):
                raise ArtifactError(f"{key}/{f}: no Adler-32 for tensor {name} in the shard "
                                    "metadata")
            plan.entries.append(Entry(name, f, start + b, start + e, spec, sum_))
    if weight_map is not None and seen != set(weight_map):
        missing = sorted(set(weight_map) - seen)
        raise ArtifactError(f"{key}: tensors in the index but in no shard: {missing[:3]}")
    return plan


def check_bytes(name: str, data: np.ndarray, checksum: str | None) -> None:
    if checksum is not None:
        got = adler32_hex(data)
        if got != checksum:
            raise ArtifactError(f"tensor {name}: Adler-32 {got} does not match the artifact's "
                                f"{checksum} (corrupt or truncated transfer)")


DECODE_CHUNK = 2 << 20  # decompress, XOR and checksum in cache-sized pieces


def decode_delta(name: str, frame: np.ndarray, base: np.ndarray, out: np.ndarray,
                 checksum: str | None) -> str:
    """out = base XOR decompress(frame), checked against the target's Adler-32 (returned).
    `out` may be `base` itself (in place)."""
    import zstandard

    n = base.nbytes
    buf = np.empty(min(DECODE_CHUNK, max(n, 1)), dtype=np.uint8)
    pos, value = 0, 1
    try:
        with zstandard.ZstdDecompressor().stream_reader(memoryview(frame)) as reader:
            while pos < n:
                k = reader.readinto(memoryview(buf)[:min(len(buf), n - pos)])
                if not k:
                    break
                region = out[pos:pos + k]
                np.bitwise_xor(base[pos:pos + k], buf[:k], out=region)
                value = _adler32(region, value)
                pos += k
            extra = reader.read(1)
    except zstandard.ZstdError as e:
        raise ArtifactError(f"tensor {name}: bad zstd frame ({e})") from e
    if pos != n or extra:
        raise ArtifactError(f"tensor {name}: the delta does not have the base's {n} bytes")
    got = f"{value & 0xFFFFFFFF:08x}"
    if checksum is not None and got != checksum:
        raise ArtifactError(f"tensor {name}: Adler-32 {got} does not match the artifact's "
                            f"{checksum} (corrupt or truncated transfer)")
    return got


def codec_threads() -> int:
    """Threads for encoding and decoding: one tensor per core (zstd, the XOR and Adler-32
    release the GIL), up to 8."""
    return min(8, os.cpu_count() or 1)


def decode_deltas(jobs: Iterable[tuple[str, np.ndarray, np.ndarray, np.ndarray, str | None]],
                  on_done: Callable[[str, str], None] | None = None,
                  threads: int | None = None) -> None:
    """`decode_delta` for every (name, frame, base, out, checksum) of `jobs`, one tensor per
    thread. `jobs` is consumed in the calling thread (it may read the frames from a source)
    and at most two per thread wait at a time; `on_done(name, adler32)` runs in the calling
    thread after each; the first failure is raised once the decodes under way have ended."""
    threads = threads or codec_threads()
    pending: dict[Any, str] = {}

    def drain(keep: int) -> None:
        while len(pending) > keep:
            done = next(iter(concurrent.futures.as_completed(pending)))
            name = pending.pop(done)
            checksum = done.result()
            if on_done:
                on_done(name, checksum)

    with ThreadPoolExecutor(threads) as pool:
        try:
            for name, frame, base, out, checksum in jobs:
                pending[pool.submit(decode_delta, name, frame, base, out, checksum)] = name
                drain(2 * threads)
            drain(0)
        finally:
            for f in pending:
                f.cancel()


def read_version(storage: Storage, key: str, max_chain: int = 64
                 ) -> tuple[dict[str, TensorSpec], dict[str, np.ndarray]]:
    """Every tensor of the version at `key`, replaying its delta chain (up to `max_chain`
    links, bases found as siblings under the same root) from the last full version. For a
    trainer publishing a delta against what it published before, and for tests."""
    plans: list[VersionPlan] = []
    k: str | None = key
    while k is not None:
        if len(plans) >= max_chain:
            raise ArtifactError(f"{key}: delta chain longer than {max_chain}")
        list_files = storage.list_version if isinstance(storage, FileStorage) else None
        plan = plan_version(storage.read, k, list_files, version=k)
        plans.append(plan)
        k = plan.base_version if plan.format == "xor-delta" else None
    specs: dict[str, TensorSpec] = {}
    data: dict[str, np.ndarray] = {}
    for plan in reversed(plans):
        if plan.format != "xor-delta":
            specs, data = {}, {}
            for e in plan.entries:
                buf = np.frombuffer(storage.read(f"{plan.key}/{e.file}", e.start, e.end),
                                    dtype=np.uint8)
                check_bytes(e.name, buf, e.checksum)
                specs[e.name], data[e.name] = e.spec, buf
            continue
        missing = [e.name for e in plan.entries if e.name not in data]
        if missing:
            raise ArtifactError(f"{plan.key}: delta tensor {missing[0]} is not in its base")
        outs = {e.name: np.empty_like(data[e.name]) for e in plan.entries}
        decode_deltas((e.name, np.frombuffer(storage.read(f"{plan.key}/{e.file}", e.start,
                                                          e.end), dtype=np.uint8),
                       data[e.name], outs[e.name], e.checksum) for e in plan.entries)
        data.update(outs)
    return specs, data


def as_tensors(specs: Mapping[str, TensorSpec], data: Mapping[str, np.ndarray]
               ) -> dict[str, torch.Tensor]:
    return {n: specs[n].as_tensor(data[n]) for n in specs}
