"""The RL listener, read-only, on its own port (a trusted network only): GET /v1/rl/workers
(protocol version 1), and the fleet's status page: GET /fleet (HTML, refreshed live) and
GET /fleet.json (rlfleet.frontend.status).

Every GET /v1/rl/workers reads the discovery store (a refresh coordinator lists before each
of its phases and must see the store as it is, not a view that lags it). A worker's /engine
route list is probed once in its life: the routes are kept under (instance ID, system URL)
and probed again only when either changes, or after a probe that failed; concurrent
listings share one probe of a worker, so a listing of workers already probed answers
without a call to any of them (`rlfleet_frontend_route_probes_total` counts the probes).

While the discovery store cannot be read (etcd killed or stopped, a file store whose
directory cannot be listed) the listener answers 503 with a `Retry-After` header and an
error body naming the store (`"type": "discovery_unavailable"`, `"discovery": <its URL>`),
never a stale listing; it lists again as soon as the store answers. Routing goes on
meanwhile: the frontend's workers stay those it last saw."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from operator import itemgetter
from typing import Any

import aiohttp
import httpx
import msgspec
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from rlfleet.frontend.status import FleetStatus, render_page
from rlfleet.protocol.rl import PROTOCOL_VERSION, STRICT_MIRRORS, RlWorker, RlWorkerStrict
from rlfleet.runtime import metrics
from rlfleet.runtime.discovery import Discovery, DiscoveryError, entry_key
from rlfleet.runtime.http import ERROR_HANDLERS, error_body, json_response

NO_SYSTEM = "the worker has no system server (start it with --system-port)"
_encode = msgspec.json.Encoder().encode  # as json_response encodes (a listing's parts)

#: seconds a client is told to wait (Retry-After) when the discovery store cannot be read
RETRY_AFTER = 2


def _brief(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'entry'}: {err['msg']}"
                         for err in e.errors())
    return str(e)


async def probe_routes(session: aiohttp.ClientSession, system_url: str,
                       timeout: float) -> list[str]:
    """Ask a worker's system server which /engine routes it serves."""
    async with session.get(f"{system_url}/engine",
                           timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            raise ValueError(f"GET {system_url}/engine answered HTTP {r.status}")
        body = await r.json(content_type=None)
    routes = body.get("routes") if isinstance(body, dict) else None
    if not isinstance(routes, list) or not all(isinstance(x, str) for x in routes):
        raise ValueError("the worker's route listing is malformed")
    return sorted(set(routes))


#: what a failed probe raises (it is listed as the worker's `error`)
PROBE_ERRORS = (TimeoutError, aiohttp.ClientError, OSError, ValueError)


class RouteBook:
    """Each listed worker's /engine routes, probed once per (instance ID, system URL): a
    worker's routes do not change in its life, and a new life is a new instance ID. A
    failed probe is not kept (the next listing probes again); concurrent listings wait on
    the same probe. Workers no longer listed are forgotten (`keep`).

    Probes go through aiohttp (a fraction of httpx's CPU per call), one session while any
    is under way, connections closed after each (a worker is probed once: nothing to keep
    alive). `probe` replaces the HTTP probe (system URL -> routes)."""

    def __init__(self, timeout: float, concurrency: int,
                 probe: Callable[[str], Awaitable[list[str]]] | None = None) -> None:
        self.timeout = timeout
        self._limit = asyncio.Semaphore(max(1, concurrency))
        self._known: dict[tuple[int, str], asyncio.Future[list[str]]] = {}
        self._get = probe or self._http_probe
        self._session: aiohttp.ClientSession | None = None
        self._inflight = 0
        self.probes = 0  # probes sent (also rlfleet_frontend_route_probes_total)

    async def routes(self, instance_id: int, system_url: str) -> list[str]:
        """The worker's routes; raises what its probe raised (one of PROBE_ERRORS)."""
        key = (instance_id, system_url)
        fut = self._known.get(key)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = self._known[key] = asyncio.ensure_future(self._probe(system_url))
            # a failed probe is not kept: the next listing probes again
            fut.add_done_callback(lambda f, k=key: self._forget_failed(k, f))
        return list(await asyncio.shield(fut))

    def known(self, instance_id: int, system_url: str) -> list[str] | None:
        """The worker's routes if a probe found them (None: probe it, `routes`): the list
        the probe answered, the same object until the worker is probed again (read it,
        never change it)."""
        fut = self._known.get((instance_id, system_url))
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return None
        return fut.result()

    def _forget_failed(self, key: tuple[int, str], fut: asyncio.Future[list[str]]) -> None:
        if (fut.cancelled() or fut.exception() is not None) and self._known.get(key) is fut:
            del self._known[key]

    async def _probe(self, system_url: str) -> list[str]:
        async with self._limit:
            self.probes += 1
            try:
                routes = await asyncio.wait_for(self._get(system_url), self.timeout)
            except BaseException:
                metrics.FRONTEND_ROUTE_PROBES.labels("failed").inc()
                raise
            metrics.FRONTEND_ROUTE_PROBES.labels("ok").inc()
            return routes

    async def _http_probe(self, system_url: str) -> list[str]:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=0))
        session = self._session
        self._inflight += 1
        try:
            return await probe_routes(session, system_url, self.timeout)
        finally:
            self._inflight -= 1
            if not self._inflight and self._session is session:
                self._session = None  # none under way: hold no session between listings
                await session.close()

    def keep(self, listed: set[tuple[int, str]]) -> None:
        """Forget the workers not in `listed` (gone, or moved to another system URL)."""
        for key in self._known.keys() - listed:
            del self._known[key]  # a probe under way ends on its own (a listing may wait on it)


_TAKEN = frozenset(RlWorker.model_fields) - {"routes", "error"}  # RlWorker.from_entry's


def _listed(entry: dict[str, Any]) -> tuple[RlWorker | RlWorkerStrict, dict[str, Any]]:
    """The entry's listing and its dump (RlWorker.from_entry(entry), .dump()); raises what
    RlWorker raises for an entry that fails its schema."""
    if STRICT_MIRRORS:
        fields = {k: v for k, v in entry.items() if k in _TAKEN and v is not None}
        try:
            w = msgspec.convert(fields, RlWorkerStrict)
            if w.passes():
                return w, {f: v for f in RlWorkerStrict.__struct_fields__
                           if (v := getattr(w, f)) is not None}
        except (msgspec.ValidationError, ValueError):
            pass  # RlWorker says why (or takes what msgspec's strict types do not)
    got = RlWorker.from_entry(entry)
    return got, got.dump()


class _Described:
    """A discovery entry's listing (RlWorker, its dump without routes, and the JSON of its
    dump with the routes last listed), validated once per value of the entry and encoded
    once per value and routes: a listing of unchanged entries validates and encodes none
    of them again (the store's own entries, `Discovery.listing(shared=True)`: an unchanged
    one is the same object)."""

    def __init__(self) -> None:
        # (component, instance ID) -> [entry, listing or why not, dump, routes, its JSON]
        self._by_key: dict[tuple[Any, Any], list[Any]] = {}

    def of(self, entry: dict[str, Any]) -> list[Any]:
        """[the entry, its listing (or why it fails the schema), its dump, routes, JSON]:
        read `encoded` for the JSON."""
        key = (entry.get("component"), entry.get("instance_id"))
        seen = self._by_key.get(key)
        if seen is not None and (seen[0] is entry or seen[0] == entry):
            seen[0] = entry
            return seen
        got: RlWorker | RlWorkerStrict | Exception
        try:
            got, dumped = _listed(entry)
        except (ValidationError, TypeError) as e:
            got, dumped = e, {}
        seen = self._by_key[key] = [entry, got, dumped, None, None]
        return seen

    @staticmethod
    def encoded(seen: list[Any], routes: list[str] | str) -> msgspec.Raw:
        """The JSON of the worker's listing with `routes` (a list: its routes; a string:
        its error), kept while they are the same."""
        if seen[4] is None or (seen[3] is not routes and seen[3] != routes):
            out = dict(seen[2])
            out["routes" if isinstance(routes, list) else "error"] = routes
            seen[3], seen[4] = routes, msgspec.Raw(_encode(out))
        return seen[4]

    def keep(self, entries: list[dict[str, Any]]) -> None:
        """Forget the entries not in this listing."""
        if len(self._by_key) > len(entries):
            listed = {(e.get("component"), e.get("instance_id")) for e in entries}
            for key in self._by_key.keys() - listed:
                del self._by_key[key]


def discovery_unavailable(discovery: Discovery, e: DiscoveryError) -> Response:
    """503, Retry-After: the store cannot be read now (the listing is never guessed)."""
    body = error_body(503, f"the discovery store {discovery.url} cannot be read: {e}; "
                      f"retry in {RETRY_AFTER} s", "discovery_unavailable")
    body["discovery"] = discovery.url
    return json_response(body, 503, {"Retry-After": str(RETRY_AFTER)})


def rl_app(discovery: Discovery, namespace: str, journal: str | None = None) -> Starlette:
    """`journal`: the refresh journal the status page shows (default $RLFLEET_JOURNAL)."""
    timeout = float(os.environ.get("DYN_RL_REQUEST_TIMEOUT_SECS", 30))
    http = httpx.AsyncClient()  # the status page's
    book = RouteBook(timeout, int(os.environ.get("DYN_RL_MAX_CONCURRENT_PROBES", 32)))
    described = _Described()

    async def probed(w: RlWorker, seen: list[Any]) -> tuple[int, msgspec.Raw]:
        try:
            got: list[str] | str = await book.routes(w.instance_id, w.system_url)  # type: ignore[arg-type]
        except PROBE_ERRORS as e:
            got = f"route probe of {w.system_url} failed: {e!r}"
        return w.instance_id, described.encoded(seen, got)

    async def workers(request: Request) -> Response:
        try:
            found = await discovery.listing(namespace=namespace, endpoint="rl", shared=True)
        except DiscoveryError as e:
            return discovery_unavailable(discovery, e)
        # one bad entry is reported beside the others, never a failed listing
        skipped = [s.dump() for s in found.skipped]
        listed: list[tuple[int, msgspec.Raw]] = []  # (instance ID, its listing's JSON)
        probing = []  # workers whose routes are not known yet
        urls: set[tuple[int, str]] = set()
        for entry in found.entries:
            seen = described.of(entry)
            w = seen[1]
            if isinstance(w, Exception):
                skipped.append({"where": f"instance {entry.get('instance_id')}",
                                "key": entry_key(entry),
                                "error": f"entry fails the listing schema: {_brief(w)}"})
                continue
            if w.system_url is None:
                listed.append((w.instance_id, described.encoded(seen, NO_SYSTEM)))
                continue
            urls.add((w.instance_id, w.system_url))
            routes = book.known(w.instance_id, w.system_url)
            if routes is None:
                probing.append(probed(w, seen))
            else:
                listed.append((w.instance_id, described.encoded(seen, routes)))
        described.keep(found.entries)
        book.keep(urls)
        if probing:
            listed += await asyncio.gather(*probing)
        listed.sort(key=itemgetter(0))
        body: dict[str, Any] = {"protocol_version": PROTOCOL_VERSION, "namespace": namespace,
                                "workers": [raw for _, raw in listed],
                                "discovery": discovery.url}
        if skipped:
            body["skipped"] = skipped
        return json_response(body)

    page = FleetStatus(discovery, namespace, http, journal or os.environ.get("RLFLEET_JOURNAL"))

    async def fleet_json(request: Request) -> Response:
        return json_response(await page.snapshot())

    async def fleet_html(request: Request) -> Response:
        return HTMLResponse(render_page(await page.snapshot()))

    app = Starlette(routes=[Route("/v1/rl/workers", workers, methods=["GET"]),
                            Route("/fleet", fleet_html, methods=["GET"]),
                            Route("/fleet.json", fleet_json, methods=["GET"])],
                    exception_handlers=ERROR_HANDLERS)
    app.state.route_book = book
    return app
