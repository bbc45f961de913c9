"""Trainer → worker weight transfer over a torch.distributed group (gloo on CPU, NCCL on
GPU): the trainer is rank 0 and broadcasts each tensor; workers join through their
`init_weights_update_group` route and receive through `update_weights_from_distributed`."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import httpx
import torch

from rlfleet.protocol.admin import EPOCH_HEADER


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class TrainerGroup:
    """Rank 0 of a weight-update group. `connect` blocks until every rank joined or the
    timeout passes; every broadcast has the same deadline."""

    def __init__(self, host: str, port: int, world_size: int, backend: str = "gloo",
                 timeout: float = 60.0) -> None:
        self.host, self.port, self.world_size = host, port, world_size
        self.backend, self.timeout = backend, timeout
        self.group = None
        # imported here, not in connect: importing vLLM takes seconds, and connect runs
        # while the workers already wait in the rendezvous under their own deadline
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group
        self._init_group = stateless_init_torch_distributed_process_group

    def connect(self) -> None:
        self.group = self._init_group(
            self.host, self.port, rank=0, world_size=self.world_size, backend=self.backend,
            timeout=timedelta(seconds=self.timeout))

    def send(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
        if self.group is None:
            raise RuntimeError("connect first")
        deadline = timedelta(seconds=self.timeout)
        sent = 0
        for _, t in tensors:
            t = t.detach().contiguous()
            if self.backend == "nccl":
                t = t.cuda()
            self.group.broadcast(t, 0, deadline).wait(deadline)
            sent += t.numel() * t.element_size()
        return sent

    def close(self) -> None:
        if self.group is not None:
            try:
                self.group.shutdown()
            finally:
                self.group = None


class TransferError(RuntimeError):
    def __init__(self, message: str, results: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.results = results


async def _post(http: httpx.AsyncClient, url: str, body: dict, timeout: float,
                headers: dict[str, str]) -> dict[str, Any]:
    try:
        r = await http.post(url, json=body, timeout=timeout, headers=headers)
        data = r.json()
    except (httpx.HTTPError, ValueError) as e:
        return {"status": "error", "message": f"{url}: {e!r}", "http_status": None}
    if not isinstance(data, dict):
        data = {"status": "error", "message": f"{url}: non-object response"}
    data["http_status"] = r.status_code
    return data


def _ok(res: dict[str, Any]) -> bool:
    return res.get("http_status") == 200 and res.get("status") == "ok"


async def push_weights(system_urls: Sequence[str], tensors: Sequence[tuple[str, torch.Tensor]],
                       version: str | None, *, host: str = "127.0.0.1", port: int | None = None,
                       backend: str = "gloo", timeout: float = 60.0,
                       admin_token: str | None = None, epoch: int | None = None,
                       step: int | None = None) -> list[dict[str, Any]]:
    """Broadcast `tensors` to the workers at `system_urls` (already paused) and return each
    worker's update response. Raises TransferError when the group cannot be formed.
    `epoch`: the refresh's fleet epoch (X-Fleet-Epoch); `step`: the policy's fleet step."""
    port = port or free_port(host)
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    if epoch is not None:
        headers[EPOCH_HEADER] = str(epoch)
    group = TrainerGroup(host, port, 1 + len(system_urls), backend, timeout)
    async with httpx.AsyncClient() as http:
        joins = [_post(http, f"{u}/engine/init_weights_update_group",
                       {"master_address": host, "master_port": port, "rank_offset": i + 1,
                        "world_size": 1 + len(system_urls), "backend": backend,
                        "timeout": timeout}, timeout + 15, headers)
                 for i, u in enumerate(system_urls)]
        connected, *inits = await asyncio.gather(asyncio.to_thread(group.connect), *joins,
                                                 return_exceptions=True)
        try:
            if isinstance(connected, BaseException) or not all(_ok(r) for r in inits):
                raise TransferError(f"weight update group not formed: {connected!r}", inits)
            meta = {"names": [n for n, _ in tensors], "dtypes": [dtype_name(t) for _, t in tensors],
                    "shapes": [list(t.shape) for _, t in tensors], "weight_version": version,
                    **({"step": step} if step is not None else {})}
            updates = [asyncio.create_task(
                _post(http, f"{u}/engine/update_weights_from_distributed", meta,
                      timeout * (len(tensors) + 2), headers)) for u in system_urls]
            try:
                await asyncio.to_thread(group.send, tensors)
            except Exception as e:  # the workers report their side below
                for t in updates:
                    t.cancel()
                raise TransferError(f"broadcast failed: {e!r}", []) from e
            return list(await asyncio.gather(*updates))
        finally:
            group.close()
            await asyncio.gather(*(_post(http, f"{u}/engine/destroy_weights_update_group", {}, 30,
                                         headers) for u in system_urls))
