"""The relay route on a worker's system server (rlfleet.protocol.relay): one admin call run
on a subtree of other workers for a coordinator, every worker's answer returned in one
reply. The worker is a relay while it serves too: the calls go out from its event loop, at
most `concurrency` at once, over one kept-alive connection per target.

What the relay adds to a call: nothing but the hop. Each target gets the route's body as
the coordinator wrote it, the coordinator's fleet epoch (the relay call's `X-Fleet-Epoch`)
so that a target fences it exactly as a direct call, the admin token this worker serves
with (the relay route needs it too, when set), and the relay call's trace context. A
target's answer is passed back as it came, not decoded here."""

from __future__ import annotations

import asyncio
import logging

import httpx
import msgspec

from rlfleet.protocol import admin
from rlfleet.protocol.relay import RELAY, RelayReply, RelayRequest, RelayResult, RelayTarget
from rlfleet.runtime import tracing
from rlfleet.runtime.admin_client import AdminConnections
from rlfleet.worker.system_server import Route, call_epoch

log = logging.getLogger("rlfleet.relay")


class Relay:
    """Serves `POST /engine/relay` for one worker (`route()`)."""

    def __init__(self, admin_token: str | None) -> None:
        self.admin_token = admin_token
        self.clients = AdminConnections(keepalive=1)  # one kept-alive connection per target

    def route(self) -> Route:
        return Route(RELAY, self.relay)

    async def relay(self, req: RelayRequest) -> RelayReply:
        """Run `req.route` on every target; each one's answer, in the order given. The
        whole relay ends within `req.timeout`: a target still unanswered then (its call
        waited for a slot, or hung) has no status, and an error that says so."""
        spec = admin.ROUTES[req.route]  # RelayRequest accepts relayable table routes only
        path = f"{admin.ROUTE_PREFIX}/{spec.name}"
        content = msgspec.json.encode(req.request)
        headers = {"content-type": "application/json"}
        if self.admin_token:
            headers[admin.AUTH_HEADER] = admin.bearer(self.admin_token)
        epoch = call_epoch()
        if epoch is not None:
            headers[admin.EPOCH_HEADER] = str(epoch)
        traceparent = tracing.outgoing()
        if traceparent:
            headers["traceparent"] = traceparent
        slots = asyncio.Semaphore(req.concurrency)

        async def one(t: RelayTarget) -> RelayResult:
            async with slots:
                try:
                    r = await self.clients.get(t.system_url).post(
                        t.system_url + path, content=content, headers=headers,
                        timeout=req.timeout)
                except httpx.HTTPError as e:
                    return RelayResult(instance_id=t.instance_id, error=repr(e))
            return RelayResult(instance_id=t.instance_id, http_status=r.status_code,
                               body=_as_json(r))

        tasks = [asyncio.ensure_future(one(t)) for t in req.targets]
        done, pending = await asyncio.wait(tasks, timeout=req.timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        results = []
        for task, target in zip(tasks, req.targets, strict=True):
            if task in done and task.exception() is None:
                results.append(task.result())
            else:
                why = (f"no answer within the relay's deadline ({req.timeout:g} s)"
                       if task in pending else repr(task.exception()))
                results.append(RelayResult(instance_id=target.instance_id, error=why))
        failed = sum(r.http_status != 200 for r in results)
        if failed:
            log.info("relayed %s to %d worker(s): %d did not answer 200", spec.name,
                     len(results), failed)
        return RelayReply(results=results)

    async def aclose(self) -> None:
        await self.clients.aclose()


def _as_json(r: httpx.Response) -> object:
    """A target's body for the reply: its JSON bytes as they came (not decoded here), or
    what there is of a body that is not JSON."""
    if r.headers.get("content-type", "").startswith("application/json") and r.content:
        return msgspec.Raw(r.content)
    return {"raw": r.text[:500]}
