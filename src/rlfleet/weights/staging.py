"""Staging on a worker: the staging area pulls a version into host buffers while the engine
keeps serving (from a store: rlfleet.weights.stage_transfer; from a fan-out upstream:
rlfleet.weights.fanout_pull), holds it until it is READY, then hands it to the engine at a
safe point; it keeps the resident copy and serves it to peers. The sources a stage request
names are in rlfleet.weights.stage_transfer's docstring."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlfleet.weights import artifacts as art
from rlfleet.weights.artifacts import ArtifactError, VersionPlan
from rlfleet.weights.fanout import ChunkBoard, Held
from rlfleet.weights.fanout_pull import fanout_transfer
from rlfleet.weights.stage_transfer import (
    READ_TIMEOUT,
    CannotStage,
    DeltaBase,
    Resident,
    Source,
    StagedVersion,
    StageRequestError,
    StageState,
    StartupCheckpoint,
    open_source_storage,
    parse_source,
    transfer,
)

log = logging.getLogger("rlfleet.weights.staging")

# ---------------------------------------------------------------- the staging area


def default_staging_root() -> Path:
    """This process's staging directory in /dev/shm (else the temp directory); those of
    processes that are gone are removed first."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    _remove_orphans(base)
    return base / f"rlfleet-staging-{os.getpid()}"


class StagingArea:
    """A worker's staged versions and its resident one. The transfer runs in a thread; the
    catalog (when the worker has one) is asked for a lease on the version while it is
    pulled, for peers when the source is ``{"kind": "peer"}``, and told which versions this
    worker holds applied."""

    def __init__(self, root: str | Path | None = None, *, catalog=None, worker_id: str = "",
                 system_url: str | None = None, allowed_roots: list[str] | None = None,
                 lease_ttl: float = 60.0, admin_token: str | None = None,
                 engine: Any = None, startup_checkpoint: str | Path | None = None) -> None:
        """`engine`: the worker's EngineControl; a version is READY once its bytes are
        checked and the engine has prepared it (prepare_staged) while serving.
        `startup_checkpoint`: the checkpoint directory the worker was started from (the base
        of a delta named by its content digest alone, when its files have that digest)."""
        self.root = Path(root) if root is not None else default_staging_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.catalog = catalog  # a Catalog, or its URL (opened on first use, in the loop)
        self._own_catalog = isinstance(catalog, (str, Path))
        self.worker_id = worker_id
        self.admin_token = admin_token  # peers' /weights routes want it when they have one
        self.system_url = system_url
        self.roots = [Path(r).resolve() for r in allowed_roots or []]
        self.lease_ttl = lease_ttl
        self.engine = engine
        self.startup = StartupCheckpoint(startup_checkpoint) if startup_checkpoint else None
        self.handles: dict[str, StagedVersion] = {}
        self.resident: Resident | None = None
        self._staged: dict[str, Resident] = {}  # handle -> READY buffers
        self._resident_board: ChunkBoard | None = None  # the resident copy, for downstreams
        self._tasks: set[asyncio.Task] = set()
        #: other copies this worker serves to peers on its /weights route (its adapters'
        #: resident versions: rlfleet.worker.lora_admin), looked up after its own
        self.also_serves: list[Callable[[str], Path | None]] = []

    def attach(self, worker_id: str, system_url: str | None) -> None:
        """Who this worker is, once its system server listens (peers find it there)."""
        self.worker_id, self.system_url = worker_id, system_url

    def _open_catalog(self) -> None:
        if isinstance(self.catalog, (str, Path)):
            from rlfleet.weights.catalog import Catalog

            self.catalog = Catalog(self.catalog)

    # ------------------------------------------------------------ stage

    async def _started_from(self, digest: str) -> bool:
        """Whether the checkpoint this worker started from has content `digest` (its files
        digested once per state, off the event loop)."""
        return self.startup is not None and await asyncio.to_thread(self.startup.digest) == digest

    async def stage(self, version: str, source: Any, *, applied: tuple[str | None, str | None],
                    digest: str | None = None, require_swap: bool = False,
                    prepare: bool = True) -> StagedVersion:
        """Start staging `version` from `source` (a handle, STAGING). `require_swap`: only
        where the engine prepares it while serving, so that installing it is a swap; a
        worker that cannot (CannotStage, raised at once: no room for a shadow of the model,
        an engine that does not prepare versions) is installed from disk instead.
        `prepare` False: the caller installs it at once, inside a pause (vLLM's weight
        transfer): the engine does not prepare a shadow of it, it reloads it in place."""
        # torch, which a worker imports when it first reads tensors (not at start: a simulated
        # worker that never stages never pays its ~2 s of CPU), is imported here, off the
        # event loop and before any transfer, not in the middle of one (a fan-out parent
        # serves its first chunks while it receives the rest); any stage call warms it
        await asyncio.to_thread(art.st_dtypes)
        if not isinstance(version, str) or not version or "/" in version or version in (".", ".."):
            raise StageRequestError("version is required: a version name (no '/')")
        self._open_catalog()
        expected = digest
        entry = None
        if self.catalog is not None:
            from rlfleet.weights.catalog import CatalogError

            try:
                entry = await self.catalog.find(version)
            except CatalogError as e:  # staging goes on without it; the digest check stays
                log.warning("catalog unavailable while staging %s: %s", version, e)
            if entry is not None and entry.state.value == "EVICTED" and isinstance(source, dict) \
                    and source.get("kind") in ("disk", "s3"):  # said before the path's checks
                raise StageRequestError(
                    f"version {version} is EVICTED in the catalog; only a READY version is "
                    f"staged from its artifact (its bytes were removed after it was released: "
                    f"{entry.release_reason or 'deleted'})")
        src = parse_source(source, version, self.roots)
        if require_swap:
            why = ("this worker has no engine to prepare it" if self.engine is None
                   else await self.engine.staging_refusal())
            if why is not None:
                raise CannotStage(why)
        if self.catalog is not None:
            if entry is not None and expected is None:
                expected = entry.digest
            if entry is not None and expected != entry.digest:
                raise StageRequestError(f"digest {expected} differs from the catalog's "
                                        f"{entry.digest} for {version}")
        if entry is not None and src.kind in ("disk", "s3") and entry.state.value != "READY":
            raise StageRequestError(f"version {version} is {entry.state.value} in the catalog; "
                                    "only a READY version is staged from its artifact")
        base = src.base
        if entry is not None and entry.base_version and entry.format.value == "xor-delta":
            base = await self._catalog_base(src.base, entry.base_version)
            if (not src.chain and base.path is None and src.kind in ("disk", "s3")
                    and applied[0] != base.version
                    and (base.digest is None
                         or (applied[1] != base.digest
                             and not await self._started_from(base.digest)))):
                serving = applied[0] if applied[0] is not None else "an unversioned model"
                raise StageRequestError(
                    f"this delta needs base {base.version}; the worker serves {serving} "
                    f"(content digest {applied[1]}, the base's is {base.digest}). Stage the "
                    "base or a full version first, name a local copy of it (\"base\": "
                    "{\"path\": DIR}), or send \"chain\": true to replay the chain from the "
                    "last full version")
        if src.kind == "peer" and not src.location and entry is None:
            raise StageRequestError(f"no peer URL given and version {version} is not in the "
                                    "catalog" + ("" if self.catalog else
                                                 " (this worker has no catalog)"))
        h = StagedVersion(uuid.uuid4().hex[:16], version, src, expected, done=asyncio.Event(),
                          base=base, require_swap=require_swap, prepare=prepare)
        self._forget_old()
        self.handles[h.handle] = h
        task = asyncio.get_running_loop().create_task(self._run(h, applied))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return h

    async def _catalog_base(self, base: DeltaBase, base_version: str) -> DeltaBase:
        """The request's base completed from the catalog: the label the catalog records for
        the delta, and that version's content digest (a worker serving it under another
        label still holds the base)."""
        if base.version is not None and base.version != base_version:
            raise StageRequestError(f"source.base.version is {base.version}; the catalog "
                                    f"records this delta's base as {base_version}")
        digest = base.digest
        if digest is None:
            from rlfleet.weights.catalog import CatalogError

            try:
                found = await self.catalog.find(base_version)
            except CatalogError as e:
                log.warning("catalog unavailable for base %s: %s", base_version, e)
                found = None
            digest = found.digest if found is not None else None
        return DeltaBase(base_version, digest, base.path)

    def _forget_old(self, keep: int = 64) -> None:
        """Released and failed handles are listed for a while, not forever."""
        done = [k for k, h in self.handles.items()
                if h.state in (StageState.RELEASED, StageState.FAILED)]
        for k in done[:max(0, len(done) - keep)]:
            del self.handles[k]

    def _holder_urls(self, entry) -> list[str]:
        """The system URLs of the other workers the catalog entry lists holding it."""
        return [d.get("system_url") for w, d in sorted((entry.holders if entry else {}).items())
                if w != self.worker_id and d.get("system_url")]

    async def holder_urls(self, version: str) -> list[str]:
        """The other workers the catalog lists holding `version` applied, by system URL
        (none without a catalog, or while it cannot be read)."""
        self._open_catalog()
        if self.catalog is None:
            return []
        from rlfleet.weights.catalog import CatalogError

        try:
            return self._holder_urls(await self.catalog.find(version))
        except CatalogError as e:
            log.warning("catalog unavailable for the holders of %s: %s", version, e)
            return []

    def _peers(self, h: StagedVersion, entry) -> list[str]:
        if h.source.location:
            return [h.source.location]
        urls = self._holder_urls(entry)
        if not urls:
            raise ArtifactError(f"no peer holds {h.version} applied (catalog {self.catalog.url})")
        return urls

    async def _run(self, h: StagedVersion, applied: tuple[str | None, str | None]) -> None:
        lease = None
        renew: asyncio.Task | None = None
        try:
            entry, lease = await self._lease(h)
            if lease is not None:
                renew = asyncio.get_running_loop().create_task(self._renew(h.version, lease))
            result = await self._pull(h, entry, applied)
            if h.expected_digest is not None and result.digest != h.expected_digest:
                await self._forget(h, result)
                raise ArtifactError(f"the staged tensors have digest {result.digest}, the "
                                    f"version's is {h.expected_digest}; not applying it")
            if h.state is not StageState.STAGING:  # released meanwhile
                await self._forget(h, result)
                return
            h.digest = result.digest
            if h.prepared is None:
                await self._prepare(h, result)
            if h.state is not StageState.STAGING:  # released while the engine prepared it
                await self._forget(h, result)
                return
            self._staged[h.handle] = result
            h.move(StageState.READY)
            log.info("staged %s (%s from %s%s) in %.2f s", h.version, h.format,
                     h.source.kind, ", read straight into the engine" if not result.owned
                     else "", time.time() - h.started_at)
        except Exception as e:  # noqa: BLE001 - every failure ends the handle FAILED
            if h.state is StageState.STAGING:
                h.error = str(e) if isinstance(e, ArtifactError) else f"{type(e).__name__}: {e}"
                if isinstance(e, CannotStage):
                    h.cannot = str(e)
                h.move(StageState.FAILED)
                log.warning("staging %s failed: %s", h.version, h.error)
        finally:
            h.finished_at = time.time()
            # how the transfer ended, taken before the lease is let go: a READY handle may be
            # applied meanwhile (its directory is then the resident copy, not to be removed)
            ended = h.state
            if renew is not None:
                renew.cancel()
            if lease is not None:
                try:
                    await self.catalog.release_lease(h.version, lease.lease_id)
                except Exception as e:  # noqa: BLE001 - the lease expires anyway
                    log.warning("releasing the lease on %s: %r", h.version, e)
            if ended is not StageState.READY:
                if h.board is not None:  # downstreams pulling from it go elsewhere (410)
                    h.board.close()
                if h.dir is not None:
                    shutil.rmtree(h.dir, ignore_errors=True)
            h.done.set()

    async def _lease(self, h: StagedVersion) -> tuple[Any, Any]:
        """The version's catalog entry (None without one) and a lease on its bytes while they
        are pulled from their artifact (None: none taken)."""
        if self.catalog is None:
            return None, None
        from rlfleet.weights.catalog import CatalogError, VersionState

        entry = None
        try:
            entry = await self.catalog.find(h.version)
            if entry is not None and entry.state is VersionState.READY \
                    and h.source.kind in ("disk", "s3"):  # the bytes the lease keeps
                return entry, await self.catalog.acquire_lease(
                    h.version, self.worker_id or "worker", self.lease_ttl)
        except CatalogError as e:  # pulled without a lease: the digest still checks
            log.warning("no catalog lease on %s: %s", h.version, e)
        return entry, None

    async def _pull(self, h: StagedVersion, entry, applied: tuple[str | None, str | None]
                    ) -> Resident:
        """The version's bytes, checked: staged into this area's buffers, or (a full version
        or checkpoint on this host's disk, and an engine that prepares it while it serves)
        read once, straight into the engine's shadow of the model."""
        if h.source.fanout is not None:
            return await asyncio.to_thread(fanout_transfer, h, h.source, self.root,
                                           self.admin_token)
        if h.source.kind == "peer":
            return await self._from_peers(h, entry, applied)
        storage = open_source_storage(h.source, min(READ_TIMEOUT, h.source.timeout))
        try:
            plan = await self._direct_plan(h, storage)
            if plan is not None:
                return await self._into_engine(h, plan)
            return await asyncio.to_thread(transfer, h, h.source, storage, self.root,
                                           self.resident, applied, self.startup)
        finally:
            storage.close()

    async def _direct_plan(self, h: StagedVersion, storage: art.Storage) -> VersionPlan | None:
        """The plan of a version the engine can read in place (a full version or plain
        checkpoint from a disk source, an engine that prepares versions while it serves);
        None: it is staged into this area's buffers."""
        if h.source.kind != "disk" or self.engine is None or not h.prepare or not isinstance(
                storage, art.FileStorage):
            return None
        plan = await asyncio.to_thread(art.plan_version, storage.read, h.source.key,
                                       storage.list_version, version=h.version,
                                       base_version=h.base.version)
        if plan.format == "xor-delta":
            return None
        why = await self.engine.staging_refusal()
        if why is not None:
            if h.require_swap:
                raise CannotStage(why)
            return None
        return plan

    async def _into_engine(self, h: StagedVersion, plan: VersionPlan) -> Resident:
        """Have the engine read `plan`'s files once into its shadow, each tensor hashed and
        checked (finite; its Adler-32 where the artifact has one) as it is loaded; the
        source's directory is the resident copy from then on (not this area's: kept)."""
        where = Path(h.source.location) / h.source.key
        h.format, h.base_version = plan.format, plan.base_version
        h.tensors_total, h.bytes_total = len(plan.entries), plan.stored_bytes
        sums = {e.name: e.checksum for e in plan.entries if e.checksum is not None}
        # ArtifactError when a tensor is bad (non-finite, a wrong Adler-32)
        prepared = await self.engine.prepare_staged(where, None, sums)
        if prepared is None:
            raise CannotStage(f"the engine could not prepare {h.version} in its own format "
                              "while serving (see its log)")
        h.prepared, h.prepare_seconds = prepared.how, prepared.seconds
        h.bytes_done, h.tensors_done = h.bytes_total, h.tensors_total
        return Resident(h.version, prepared.digest, where,
                        {e.name: e.spec for e in plan.entries}, sums, owned=False)

    async def _prepare(self, h: StagedVersion, result: Resident) -> None:
        """The engine prepares the staged bytes in its own format while it serves (so that
        installing them is a swap); a handle that asked for a swap and got none fails as
        `cannot` (its caller installs from disk instead), any other is installed by an
        in-place reload."""
        if self.engine is None or not h.prepare:
            return
        try:
            prepared = await self.engine.prepare_staged(result.dir, result.digest)
        except Exception as e:  # noqa: BLE001 - applying it reloads in place
            log.warning("the engine did not prepare %s (%r); applying it reloads in place",
                        h.version, e)
            prepared = None
        if prepared is not None:
            h.prepared, h.prepare_seconds = prepared.how, prepared.seconds
        elif h.require_swap:
            result.drop()
            raise CannotStage(f"the engine did not prepare {h.version} in its own format while "
                              "serving (see its log); installing it would reload it in place")

    async def _from_peers(self, h: StagedVersion, entry, applied) -> Resident:
        errors = []
        for url in self._peers(h, entry):
            src = Source("peer", url, h.version, timeout=h.source.timeout,
                         max_bytes_per_s=h.source.max_bytes_per_s)
            h.peer = url
            storage = open_source_storage(src, min(READ_TIMEOUT, src.timeout), self.admin_token)
            h.bytes_done = h.tensors_done = 0
            try:
                return await asyncio.to_thread(transfer, h, src, storage, self.root,
                                               self.resident, applied, self.startup)
            except ArtifactError as e:
                errors.append(f"{url}: {e}")
                if h.cancel.is_set():
                    break
            finally:
                storage.close()
        raise ArtifactError("no peer could serve it: " + "; ".join(errors))

    async def _renew(self, version: str, lease) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl / 3)
            try:
                await self.catalog.renew_lease(version, lease.lease_id, self.lease_ttl)
            except Exception as e:  # noqa: BLE001 - keep pulling; the lease may lapse
                log.warning("renewing the lease on %s: %r", version, e)

    # ------------------------------------------------------------ queries

    def get(self, handle: Any) -> StagedVersion:
        if not isinstance(handle, str) or handle not in self.handles:
            raise StageRequestError(f"unknown staging handle {handle!r}; list them with "
                                    "get_staged_weights")
        return self.handles[handle]

    def summaries(self) -> list[dict[str, Any]]:
        return [h.summary() for h in self.handles.values()]

    def ready(self, handle: Any) -> tuple[StagedVersion, Resident]:
        """The READY handle and its buffers, for the engine to load (StageRequestError when
        the handle is not READY)."""
        h = self.get(handle)
        if h.state is not StageState.READY:
            why = f": {h.error}" if h.error else ""
            raise StageRequestError(f"staging handle {h.handle} ({h.version}) is "
                                    f"{h.state.value}{why}; only a READY handle can be applied")
        return h, self._staged[h.handle]

    def resident_dir(self, version: str) -> Path | None:
        r = self.resident
        if r is not None and r.version == version:
            return r.dir
        return next((d for find in self.also_serves if (d := find(version)) is not None), None)

    def held(self, version: str) -> Held | None:
        """What this worker can serve of `version` to fan-out downstreams: the newest handle
        staging it (or READY), else the resident copy (rlfleet.weights.fanout routes)."""
        for h in reversed(self.handles.values()):
            if h.version == version and h.board is not None and not h.board.closed \
                    and h.state in (StageState.STAGING, StageState.READY):
                return Held(h.board, lambda h=h: h.state.value, lambda h=h: h.digest)
        r, board = self.resident, self._resident_board
        if r is not None and r.version == version and board is not None and not board.closed:
            return Held(board, lambda: StageState.READY.value, lambda: r.digest)
        return None

    # ------------------------------------------------------------ apply / release

    async def applied(self, handle: str, engine_digest: str | None = None) -> None:
        """The engine now serves `handle`'s version (and reports `engine_digest` for it): its
        buffers become the resident copy (peers may read it, the next delta starts from it);
        the previous one is dropped."""
        h, staged = self.ready(handle)
        staged.engine_digest = engine_digest
        old, self.resident = self.resident, staged
        if self._resident_board is not None:
            self._resident_board.close()
        self._resident_board, h.board = h.board, None
        del self._staged[handle]
        h.applied = True
        h.move(StageState.RELEASED)
        if old is not None:
            old.drop()
            await self._holder(old.version, add=False)
        await self._holder(staged.version, add=True)

    async def weights_replaced(self) -> None:
        """The engine's weights came from elsewhere (disk, a trainer broadcast): the resident
        copy no longer describes them."""
        old, self.resident = self.resident, None
        if self._resident_board is not None:
            self._resident_board.close()
            self._resident_board = None
        if old is not None:
            old.drop()
            await self._holder(old.version, add=False)

    async def _holder(self, version: str, add: bool) -> None:
        if self.catalog is None or not self.worker_id:
            return
        try:
            if add:
                await self.catalog.add_holder(version, self.worker_id, system_url=self.system_url)
            else:
                await self.catalog.remove_holder(version, self.worker_id)
        except Exception as e:  # noqa: BLE001 - a version not in the catalog has no holders
            log.info("catalog holder update for %s: %s", version, e)

    async def release(self, handle: Any) -> StagedVersion:
        """Drop a handle's buffers (idempotent); a transfer under way stops."""
        h = self.get(handle)
        if h.state in (StageState.STAGING, StageState.READY, StageState.FAILED):
            h.cancel.set()
            h.move(StageState.RELEASED)
            if h.board is not None:
                h.board.close()
            staged = self._staged.pop(handle, None)
            if staged is not None:
                await self._forget(h, staged)
        return h

    async def _forget(self, h: StagedVersion, staged: Resident) -> None:
        """Drop a handle's buffers that will not be applied, and what the engine prepared
        of them."""
        staged.drop()
        if h.prepared and self.engine is not None:
            await self.engine.discard_staged(staged.dir)

    async def close(self) -> None:
        for h in list(self.handles.values()):
            h.cancel.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.resident is not None:
            await self._holder(self.resident.version, add=False)
        shutil.rmtree(self.root, ignore_errors=True)
        if self.catalog is not None and not isinstance(self.catalog, (str, Path)) and \
                self._own_catalog:
            await self.catalog.close()


def _remove_orphans(base: Path) -> None:
    """Staging directories of worker processes that died without cleaning up (they hold
    shared memory until removed)."""
    for d in base.glob("rlfleet-staging-*"):
        try:
            pid = int(d.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:  # another user's live process
            continue

