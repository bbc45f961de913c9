"""The trainer side of the weight plane: publish a policy version (full, or an exact-base
XOR delta against one published before) to a directory, S3, or the trainer's own HTTP
server, and register it in the catalog, READY once every file is written.

    from rlfleet.weights.publish import Publisher
    pub = Publisher("s3://bucket/policies", catalog="sqlite:///run/catalog.sqlite",
                    model="qwen3", dtype=torch.bfloat16)
    pub.publish(model.state_dict(), "step-1")                     # full
    pub.publish(model.state_dict(), "step-2", base="step-1")      # delta

    server = TrainerServer()              # workers stage {"kind": "trainer", "url": server.url}
    pub = Publisher(server.uri, ...)

`publish(...)` is the one-shot form; `rlfleet publish CHECKPOINT --version V [--base V0]
--to URI` the command. Each call returns (the command prints) one JSON object:
``{"version", "base_version", "digest", "bytes_full", "bytes_written"}``.

With a catalog and `retention` (rlfleet.weights.retention.Retention; `--retain-versions K`),
every publish ends with a collection: the versions retention does not keep are released and,
once no lease holds them, evicted and their bytes removed (`pins`: what else is in use,
e.g. `journal_pins` of the fleet's refresh journal); the result says what it did
(`retention`)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import APIRouter, FastAPI, Request  # resolved at import: FastAPI reads the handler's annotations

from rlfleet.runtime.http import shared_routes
from rlfleet.runtime.progress import Progress
from rlfleet.runtime.server import AppServer, bind_socket
from rlfleet.weights import artifacts as art
from rlfleet.weights.catalog import Catalog, CatalogError
from rlfleet.weights.digest import digest_tensors, iter_checkpoint_tensors
from rlfleet.weights.retention import Retention, collect

if TYPE_CHECKING:  # torch only names types here: a process that never publishes never imports it
    import torch

log = logging.getLogger("rlfleet.weights.publish")


def _run(coro):
    """Run a catalog coroutine from synchronous code (also from inside a running loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e
    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def prepare_tensors(tensors: Mapping[str, torch.Tensor] | Any,
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors as the engine will receive them: on the CPU, contiguous, in `dtype`
    (e.g. float32 master weights published as bfloat16), a tied output layer dropped."""
    out = {}
    for name, t in dict(tensors).items():
        t = t.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        out[name] = t.to("cpu").contiguous()
    return art.drop_tied_output(out)


def catalog_entry(model: str, artifact: art.Artifact, location: str) -> dict[str, Any]:
    """What the catalog records of an artifact published at `location` (Catalog.create's
    arguments but the idempotency key)."""
    return {"model": model, "version": artifact.version, "format": artifact.format,
            "digest": artifact.digest, "base_version": artifact.base_version,
            "locations": [location], "size": artifact.bytes_full, "parts": artifact.parts}


def register_written(catalog: Catalog | str | Path, model: str, artifact: art.Artifact,
                     location: str) -> None:
    """Register an artifact whose files are all written at `location`: created in the
    catalog with every part published (READY)."""
    async def run() -> None:
        cat = Catalog(catalog.url if isinstance(catalog, Catalog) else catalog)
        try:
            await cat.create(**catalog_entry(model, artifact, location))
            for part in artifact.parts:
                await cat.publish_part(artifact.version, part)
        finally:
            await cat.close()
    _run(run())


class Publisher:
    """Publishes successive versions to one destination. It keeps the bytes of the last
    version it published, so a delta against it needs no read-back; any other base is read
    from the destination (its chain replayed)."""

    def __init__(self, to: str | Path, *, catalog: Catalog | str | Path | None = None,
                 model: str = "policy", dtype: torch.dtype | None = None,
                 endpoint_url: str | None = None, shard_limit: int = art.SHARD_LIMIT,
                 retention: Retention | None = None,
                 pins: Callable[[], Mapping[str, str]] | None = None,
                 workers: Callable[[], Collection[str]] | None = None) -> None:
        """`retention`: collect after every publish (needs `catalog`); `pins()`: the versions
        in use that retention must keep besides those it sees in the catalog, and why;
        `workers()`: the workers in use (a holder among none of them is not counted)."""
        if retention is not None and catalog is None:
            raise ValueError("retention needs a catalog: it releases and evicts the versions "
                             "the catalog lists")
        self.storage = art.open_storage(to, endpoint_url)
        self.endpoint_url = endpoint_url
        self.retention, self.pins, self.workers = retention, pins, workers
        if isinstance(self.storage, art.HttpStorage):
            raise ValueError(f"cannot publish to {to}: use file:///dir, s3://bucket/prefix or "
                             "a TrainerServer's uri")
        self.catalog_url = catalog.url if isinstance(catalog, Catalog) else catalog
        self.model = model
        self.dtype = dtype
        self.shard_limit = shard_limit
        self.last: tuple[str, dict[str, np.ndarray]] | None = None  # version, bytes

    def _base_bytes(self, base: str) -> dict[str, np.ndarray]:
        if self.last is not None and self.last[0] == base:
            return self.last[1]
        try:
            _, data = art.read_version(self.storage, base)
        except FileNotFoundError as e:
            raise art.ArtifactError(f"base {base} is not at {self.storage.uri}: {e}") from None
        return data

    def publish(self, tensors: Mapping[str, torch.Tensor] | Any, version: str, *,
                base: str | None = None, idempotency_key: str | None = None) -> dict[str, Any]:
        """Write `tensors` as `version` (full, or a delta on `base`), register it, READY."""
        if not version or "/" in version:
            raise ValueError(f"bad version name {version!r} (non-empty, no '/')")
        t0 = time.perf_counter()
        prepared = prepare_tensors(tensors, self.dtype)
        digest = digest_tensors(prepared.items())
        if base is None:
            artifact = art.encode_full(version, prepared, digest, self.shard_limit)
        else:
            artifact = art.encode_delta(version, base, prepared, self._base_bytes(base), digest,
                                        self.shard_limit)
        encode_s = time.perf_counter() - t0
        location = f"{self.storage.uri}/{version}"

        async def write_all() -> None:
            catalog = Catalog(self.catalog_url) if self.catalog_url is not None else None
            try:
                if catalog is not None:
                    await catalog.create(**catalog_entry(self.model, artifact, location),
                                         idempotency_key=idempotency_key)
                files = [*artifact.files, (art.INDEX, artifact.index_bytes)]
                with Progress(f"publishing {version} to {location}",
                              sum(len(d) for _, d in files)) as written:
                    for name, data in files:
                        await asyncio.to_thread(self.storage.write, f"{version}/{name}", data)
                        written.add(len(data))
                        if catalog is not None:
                            await catalog.publish_part(version, name)
            finally:
                if catalog is not None:
                    await catalog.close()
        _run(write_all())
        self.last = (version, {n: art.tensor_bytes(t).copy() for n, t in prepared.items()})
        out = {"version": version, "base_version": base, "digest": digest,
               "bytes_full": artifact.bytes_full, "bytes_written": artifact.bytes_written,
               "tensors_changed": artifact.changed, "encode_seconds": round(encode_s, 4),
               "seconds": round(time.perf_counter() - t0, 4), "location": location}
        if self.retention is not None:
            out["retention"] = self.collect()
        return out

    def collect(self, dry_run: bool = False) -> dict[str, Any] | None:
        """The retention collection over this publisher's catalog (rlfleet.weights
        .retention); its report, or None when the catalog could not be read (said in the
        log: the publish stands, the next one collects)."""
        async def run() -> dict[str, Any]:
            catalog = Catalog(self.catalog_url)
            try:
                return await collect(catalog, self.retention or Retention(),
                                     pins=self.pins() if self.pins else None, dry_run=dry_run,
                                     endpoint_url=self.endpoint_url,
                                     workers=self.workers() if self.workers else None)
            finally:
                await catalog.close()
        try:
            return _run(run())
        except (CatalogError, art.ArtifactError, OSError) as e:
            log.warning("retention after publishing: %s (the next publish collects again)", e)
            return None

    def close(self) -> None:
        self.storage.close()


def publish(tensors: Mapping[str, torch.Tensor] | str | Path, version: str, *, to: str | Path,
            base: str | None = None, catalog: Catalog | str | Path | None = None,
            model: str | None = None, dtype: torch.dtype | None = None,
            endpoint_url: str | None = None, idempotency_key: str | None = None,
            retention: Retention | None = None,
            pins: Callable[[], Mapping[str, str]] | None = None,
            workers: Callable[[], Collection[str]] | None = None) -> dict[str, Any]:
    """Publish a state dict (or a checkpoint directory) as `version` at `to` (full, or a
    delta against `base`, whose bytes are read from `to`); see the module doc."""
    if isinstance(tensors, (str, Path)):
        path = Path(tensors)
        model = model or path.resolve().name
        tensors = dict(iter_checkpoint_tensors(path))
    pub = Publisher(to, catalog=catalog, model=model or "policy", dtype=dtype,
                    endpoint_url=endpoint_url, retention=retention, pins=pins,
                    workers=workers)
    try:
        return pub.publish(tensors, version, base=base, idempotency_key=idempotency_key)
    finally:
        pub.close()


# ---------------------------------------------------------------- serving versions over HTTP


def version_file_response(directory: Path | None, version: str, file: str):
    """The response for GET /weights/<version>/<file> from a version directory: the file
    (Starlette's FileResponse answers Range requests), or a 404 that says what is served."""
    from fastapi.responses import FileResponse, JSONResponse

    if directory is None:
        return JSONResponse({"error": "Not found", "message": f"version {version} is not "
                             "served here"}, status_code=404)
    if "/" in file or file in (".", "..") or not (directory / file).is_file():
        return JSONResponse({"error": "Not found", "message": f"{version} has no file {file!r}"},
                            status_code=404)
    return FileResponse(directory / file)


def unauthorized(request: Request, admin_token: str | None):
    """The 401 for a request to a weights route that lacks the admin token (None: it may
    pass)."""
    import hmac

    from fastapi.responses import JSONResponse

    if admin_token and not hmac.compare_digest(
            request.headers.get("authorization", "").encode(), f"Bearer {admin_token}".encode()):
        return JSONResponse({"error": "Unauthorized", "message": "this route needs "
                             "'Authorization: Bearer <admin token>'"}, status_code=401)
    return None


def add_weights_route(app: Any, lookup, admin_token: str | None = None) -> None:
    """``GET /weights/{version}/{file}`` on `app`; `lookup(version)` gives the version's
    directory or None. With `admin_token`, requests must carry it (peers do)."""
    app.state.weights = (lookup, admin_token)
    app.router.routes.extend(shared_routes(_weights_routes))


def _weights_routes(r: APIRouter) -> None:
    """Shared by the process's workers (shared_routes): each app's own `lookup` and admin
    token in `app.state.weights`."""
    @r.get("/weights/{version}/{file}")
    async def version_file(version: str, file: str, request: Request):
        lookup, admin_token = request.app.state.weights
        if (refused := unauthorized(request, admin_token)) is not None:
            return refused
        return version_file_response(lookup(version), version, file)


def weights_app(lookup) -> Any:
    """A FastAPI app serving ``GET /weights/{version}/{file}`` (see add_weights_route)."""
    app = FastAPI(title="rlfleet weights", docs_url=None, redoc_url=None)
    add_weights_route(app, lookup)
    return app


class TrainerServer:
    """The trainer's publisher: serves the versions published to `uri` (a local directory,
    by default a fresh one in shared memory) over HTTP byte ranges, from a thread of the
    trainer process. Workers stage with ``{"kind": "trainer", "url": server.url}``."""

    def __init__(self, directory: str | Path | None = None, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        own = directory is None
        if own:
            base = "/dev/shm" if Path("/dev/shm").is_dir() else None
            directory = tempfile.mkdtemp(prefix="rlfleet-trainer-", dir=base)
        self.dir = Path(directory)
        self._own = own
        self.dir.mkdir(parents=True, exist_ok=True)

        def lookup(version: str) -> Path | None:
            d = self.dir / version
            return d if "/" not in version and (d / art.INDEX).is_file() else None

        self._server = AppServer(weights_app(lookup), bind_socket(host, port))
        self.url = self._server.url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="trainer-weights",
                                        daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result(30)

    @property
    def uri(self) -> str:
        return f"file://{self.dir}"

    def close(self) -> None:
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if self._own:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> TrainerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
