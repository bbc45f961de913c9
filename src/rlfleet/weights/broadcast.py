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

from rlfleet.protocol import admin
from rlfleet.protocol.admin_vllm import DistributedRequest, GroupRequest
from rlfleet.runtime.admin_client import AdminClient, CallResult


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
    def __init__(self, message: str, results: list[CallResult[Any]]) -> None:
        super().__init__(message)
        self.results = results  # the workers' answers to joining the group, when they came


async def push_weights(system_urls: Sequence[str], tensors: Sequence[tuple[str, torch.Tensor]],
                       version: str | None, *, host: str = "127.0.0.1", port: int | None = None,
                       backend: str = "gloo", timeout: float = 60.0,
                       client: AdminClient | None = None, step: int | None = None
                       ) -> list[CallResult[Any]]:
    """Broadcast `tensors` to the workers at `system_urls` (already paused) and return each
    worker's answer to update_weights_from_distributed. Raises TransferError when the group
    cannot be formed. `client`: the caller's admin client (its token and fleet epoch;
    default: none); `step`: the policy's fleet step."""
    if client is None:
        async with httpx.AsyncClient() as http:
            return await _push(AdminClient(http, timeout), system_urls, tensors, version,
                               host, port or free_port(host), backend, timeout, step)
    return await _push(client, system_urls, tensors, version, host, port or free_port(host),
                       backend, timeout, step)


async def _push(client: AdminClient, system_urls: Sequence[str],
                tensors: Sequence[tuple[str, torch.Tensor]], version: str | None, host: str,
                port: int, backend: str, timeout: float, step: int | None
                ) -> list[CallResult[Any]]:
    world = 1 + len(system_urls)
    group = TrainerGroup(host, port, world, backend, timeout)
    joins = [client.call(u, admin.INIT_WEIGHTS_UPDATE_GROUP,
                         GroupRequest(master_address=host, master_port=port, rank_offset=i + 1,
                                      world_size=world, backend=backend, timeout=timeout),
                         timeout + 15)
             for i, u in enumerate(system_urls)]
    connected, *inits = await asyncio.gather(asyncio.to_thread(group.connect), *joins,
                                             return_exceptions=True)
    try:
        if isinstance(connected, BaseException) or not all(r.ok for r in inits):
            raise TransferError(f"weight update group not formed: {connected!r}", inits)
        meta = DistributedRequest(names=[n for n, _ in tensors],
                                  dtypes=[dtype_name(t) for _, t in tensors],
                                  shapes=[list(t.shape) for _, t in tensors],
                                  weight_version=version, step=step)
        updates = [asyncio.create_task(
            client.call(u, admin.UPDATE_WEIGHTS_FROM_DISTRIBUTED, meta,
                        timeout * (len(tensors) + 2))) for u in system_urls]
        try:
            await asyncio.to_thread(group.send, tensors)
        except Exception as e:  # the workers report their side below
            for t in updates:
                t.cancel()
            raise TransferError(f"broadcast failed: {e!r}", []) from e
        return list(await asyncio.gather(*updates))
    finally:
        group.close()
        await asyncio.gather(*(client.call(u, admin.DESTROY_WEIGHTS_UPDATE_GROUP, None, 30)
                               for u in system_urls))
