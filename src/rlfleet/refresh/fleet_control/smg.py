"""The fleet control service's SMG route: `/v1/rl/engine/{path}?selector=`, the engine route on
every worker a selector matches, answered as SMG's RlFanoutResponse, errors in SMG's codes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rlfleet.protocol import admin, smg
from rlfleet.refresh.control import FleetWorker
from rlfleet.refresh.fleet_control.bodies import Handlers
from rlfleet.refresh.fleet_control.service import FleetControl, FleetFailure, fleet_now

#: SMG's route and its handler (each bound by `@HANDLERS.route`)
HANDLERS = Handlers()


def smg_error(e: FleetFailure) -> JSONResponse:
    """SMG's error body: `{"error": <code>, "message"}` (the code leads the message, or is
    `upstream_error`)."""
    code, sep, rest = str(e).partition(": ")
    if not sep or " " in code:
        code, rest = smg.UPSTREAM_ERROR, str(e)
    return JSONResponse(smg.error(code, rest), status_code=e.status)


def _selected(selector: str | None, ws: list[FleetWorker]) -> list[FleetWorker]:
    """The workers an SMG selector (`key=value[,key=value...]`: engine, model, id) matches;
    FleetFailure 400 in SMG's codes for a missing or malformed one, or none matching."""
    if not selector:
        raise FleetFailure(f"{smg.SELECTOR_REQUIRED}: send ?selector=key=value (keys: "
                           f"{', '.join(smg.SELECTOR_KEYS)})", 400)
    terms = [t.partition("=") for t in selector.split(",")]
    bad = [k + eq + v for k, eq, v in terms if not eq or not v or k not in smg.SELECTOR_KEYS]
    if bad:
        raise FleetFailure(f"{smg.INVALID_SELECTOR}: {bad[0]!r} (keys: "
                           f"{', '.join(smg.SELECTOR_KEYS)}; engine={smg.ENGINE} is every "
                           "worker)", 400)
    have = {"engine": lambda w: smg.ENGINE, "model": lambda w: w.model or "",
            "id": lambda w: str(w.instance_id)}
    chosen = [w for w in ws if all(have[k](w) == v for k, _, v in terms)]
    if not chosen:
        raise FleetFailure(f"{smg.NO_WORKERS_MATCH}: no worker matches {selector!r}", 400)
    return chosen


async def _fanout_one(ctl: FleetControl, w: FleetWorker, request: Request, path: str,
                      body: bytes) -> tuple[smg.CallOutcome | None, smg.FailedCall | None]:
    """One worker's call of an engine route: its /engine/<path> when the path is a route of
    the admin table, else its native route at /<path>."""
    where = f"{admin.ROUTE_PREFIX}/{path}" if path in admin.ROUTES else f"/{path}"
    url, wid = f"{w.system_url}{where}", str(w.instance_id)
    headers = {"content-type": "application/json"}
    if ctl.config.admin_token:
        headers["Authorization"] = f"Bearer {ctl.config.admin_token}"
    t0 = time.monotonic()
    try:
        r = await ctl.clients.get(w.system_url).request(
            request.method, url, content=body or None, headers=headers,
            params={k: v for k, v in request.query_params.items() if k != "selector"},
            timeout=ctl.config.timeout)
    except httpx.TimeoutException as e:
        return None, smg.FailedCall(worker_id=wid, url=url, error=smg.UPSTREAM_TIMEOUT,
                                    message=repr(e))
    except httpx.HTTPError as e:
        return None, smg.FailedCall(worker_id=wid, url=url, error=smg.UPSTREAM_UNREACHABLE,
                                    message=repr(e))
    try:
        said: Any = r.json()
    except ValueError:
        said = r.text
    outcome = smg.CallOutcome(worker_id=wid, url=url, status=r.status_code, body=said,
                              latency_ms=int((time.monotonic() - t0) * 1000))
    # an /engine route answers a refusal 200 with "status": "error" (or SGLang's
    # "success": false): a failure too
    refused = isinstance(said, dict) and (said.get("status") == "error"
                                          or said.get("success") is False)
    if r.is_success and not refused:
        return outcome, None
    return outcome, smg.FailedCall(worker_id=wid, url=url, error=smg.UPSTREAM_ERROR,
                                   message=str(said)[:2000], status=r.status_code)


@HANDLERS.route("smg", "/v1/rl/engine/{path:path}")
async def _smg_fanout(ctl: FleetControl, request: Request) -> Response:
    """SMG's `/v1/rl/engine/{path}?selector=`: the engine route on every matching worker, as
    it is (no fleet transaction); SMG's RlFanoutResponse, 207 when any failed."""
    path = request.path_params["path"].strip("/")
    if not path or ".." in path.split("/"):
        raise FleetFailure(f"{smg.INVALID_ENGINE_PATH}: {path!r}", 400)
    body = await request.body()
    _, ws = await fleet_now(ctl)
    chosen = _selected(request.query_params.get("selector"), ws)
    done = await asyncio.gather(*(_fanout_one(ctl, w, request, path, body) for w in chosen))
    out = smg.FanoutResponse(
        results={o.worker_id: o for o, _ in done if o is not None},
        failed=[f for _, f in done if f is not None], total=len(chosen),
        succeeded=sum(1 for _, f in done if f is None))
    return Response(msgspec.json.encode(out), status_code=207 if out.failed else 200,
                    media_type="application/json")
