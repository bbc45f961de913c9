"""The RL listener, read-only, on its own port (a trusted network only): GET /v1/rl/workers
(protocol version 1), and the fleet's status page: GET /fleet (HTML, refreshed live) and
GET /fleet.json (rlfleet.frontend.status)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from rlfleet.frontend.status import FleetStatus, render_page
from rlfleet.protocol.rl import PROTOCOL_VERSION, RlWorker
from rlfleet.runtime.discovery import Discovery, DiscoveryError, entry_key
from rlfleet.runtime.http import ERROR_HANDLERS, json_response


def _brief(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'entry'}: {err['msg']}"
                         for err in e.errors())
    return str(e)


async def probe_routes(http: httpx.AsyncClient, system_url: str, timeout: float) -> list[str]:
    """Ask a worker's system server which /engine routes it serves."""
    r = await http.get(f"{system_url}/engine", timeout=timeout)
    r.raise_for_status()
    body = r.json()
    routes = body.get("routes") if isinstance(body, dict) else None
    if not isinstance(routes, list) or not all(isinstance(x, str) for x in routes):
        raise ValueError("the worker's route listing is malformed")
    return sorted(set(routes))


def rl_app(discovery: Discovery, namespace: str, journal: str | None = None) -> Starlette:
    """`journal`: the refresh journal the status page shows (default $RLFLEET_JOURNAL)."""
    timeout = float(os.environ.get("DYN_RL_REQUEST_TIMEOUT_SECS", 30))
    limit = asyncio.Semaphore(max(1, int(os.environ.get("DYN_RL_MAX_CONCURRENT_PROBES", 32))))
    http = httpx.AsyncClient()

    async def describe(entry: dict[str, Any]) -> dict[str, Any]:
        w = RlWorker.from_entry(entry)  # the caller checked that it validates
        if w.system_url is None:
            w.error = "the worker has no system server (start it with --system-port)"
            return w.dump()
        async with limit:
            try:
                w.routes = await asyncio.wait_for(probe_routes(http, w.system_url, timeout), timeout)
            except (TimeoutError, httpx.HTTPError, ValueError) as e:
                w.error = f"route probe of {w.system_url} failed: {e!r}"
        return w.dump()

    async def workers(request: Request) -> Response:
        try:
            found = await discovery.listing(namespace=namespace, endpoint="rl")
        except DiscoveryError as e:
            return json_response({"error": "discovery_failed", "message": str(e)}, 500)
        # one bad entry is reported beside the others, never a failed listing
        skipped = [s.dump() for s in found.skipped]
        valid = []
        for entry in found.entries:
            try:
                RlWorker.from_entry(entry)
            except (ValidationError, TypeError) as e:
                skipped.append({"where": f"instance {entry.get('instance_id')}",
                                "key": entry_key(entry),
                                "error": f"entry fails the listing schema: {_brief(e)}"})
            else:
                valid.append(entry)
        listed = await asyncio.gather(*(describe(e) for e in valid))
        body: dict[str, Any] = {"protocol_version": PROTOCOL_VERSION, "namespace": namespace,
                                "workers": sorted(listed, key=lambda w: w["instance_id"]),
                                "discovery": discovery.url}
        if skipped:
            body["skipped"] = skipped
        return json_response(body)

    page = FleetStatus(discovery, namespace, http, journal or os.environ.get("RLFLEET_JOURNAL"))

    async def fleet_json(request: Request) -> Response:
        return json_response(await page.snapshot())

    async def fleet_html(request: Request) -> Response:
        return HTMLResponse(render_page(await page.snapshot()))

    return Starlette(routes=[Route("/v1/rl/workers", workers, methods=["GET"]),
                             Route("/fleet", fleet_html, methods=["GET"]),
                             Route("/fleet.json", fleet_json, methods=["GET"])],
                     exception_handlers=ERROR_HANDLERS)
