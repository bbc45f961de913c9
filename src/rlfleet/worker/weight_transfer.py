"""vLLM's weight-transfer steps on one worker (init, start, update, finish, shutdown), written
once for the two places a client reaches them: vLLM's native routes at the worker's
admin_base_url (rlfleet.worker.native_rl, which answers in vLLM's shapes) and Dynamo 1.7's
`/engine/update/*` routes (`routes` here, which answer in the contract's: `{"status": "ok",
"message"}`, or `{"status": "error", "message"}` for a step refused or failed).

Where a step runs: on a GPU build, in vLLM's engine (its backend: nccl, ipc, ...); on vLLM's
CPU build, a worker started with `--weight-transfer-config '{"backend": "modelexpress"}'`
runs that backend itself (rlfleet.worker.modelexpress); any other engine refuses every step
(`TransferUnavailable`: the CPU build's GPU backends, the mocker)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from rlfleet.protocol import admin, modelexpress
from rlfleet.protocol.admin import (
    MessageReply,
    NoFields,
    TransferFinishRequest,
    TransferInitRequest,
    TransferUpdateRequest,
)
from rlfleet.protocol.vllm_rl import TRANSFER_MESSAGES
from rlfleet.worker.modelexpress import ModelExpressTransfer, TransferError, TransferHost
from rlfleet.worker.system_server import Route

if TYPE_CHECKING:
    from rlfleet.worker.admission import Admission

log = logging.getLogger("rlfleet.weight_transfer")


class TransferOwner(TransferHost, Protocol):
    """What the steps use of the worker's admin beyond a backend's needs: its admission hold
    and the check that follows a transfer."""

    admission: Admission

    async def weights_transferred(self, version: str | None) -> str | None: ...


class TransferUnavailable(TransferError):
    """This engine cannot run vLLM's weight-transfer steps at all (the message says why and
    what to use instead): HTTP 400 on the native routes."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 400)


class WeightTransfer:
    """The steps over one worker's EngineAdmin (which owns this: `EngineAdmin.transfer`)."""

    def __init__(self, engine_admin: TransferOwner) -> None:
        self.admin = engine_admin
        self.engine = engine_admin.engine
        #: the backend the worker runs itself (vLLM's CPU build), if any
        self.modelexpress = ModelExpressTransfer(engine_admin) \
            if self.engine.own_transfer_backend() == modelexpress.BACKEND else None
        self._updating = False  # an engine's own backend: a start succeeded, no finish yet

    @property
    def available(self) -> bool:
        """Whether this worker can run the steps at all (else each is refused: 400)."""
        return self.modelexpress is not None or self.engine.weight_transfer_refusal() is None

    @property
    def updating(self) -> bool:
        """Whether a weight update is open (started, not finished): what vLLM's RL state
        machine orders the steps by (rlfleet.protocol.vllm_rl.out_of_order)."""
        if self.modelexpress is not None:
            return self.modelexpress.updating
        return self._updating

    async def run(self, step: str, payload: Any = None,
                  weight_version: str | None = None) -> str | None:
        """One step (rlfleet.protocol.vllm_rl.TRANSFER_STEPS) with its `init_info` or
        `update_info` (`payload`) or, for finish, the label of the weights transferred.
        Returns why the weights a finish installed fail the worker's self-check (it holds
        itself closed then), else None. Raises AdminRequestError for a payload that does not
        fit (vLLM's 400), TransferUnavailable, or TransferError (a step refused or failed)."""
        if self.modelexpress is not None:
            await self.modelexpress.run(step, payload, weight_version)
            return None
        why = self.engine.weight_transfer_refusal()
        if why:
            raise TransferUnavailable(why)
        await self.engine.transfer_weights(step, payload)
        if step in ("start", "finish"):
            self._updating = step == "start"
        if step != "finish":
            return None
        failed = await self.admin.weights_transferred(weight_version)
        if failed:
            log.warning("%s", failed)
        return failed

    # ---------------------------------------------------------------- Dynamo 1.7's routes

    def routes(self) -> list[Route]:
        """`/engine/update/*`: the steps a Dynamo 1.7 client drives (vLLM's bodies)."""
        async def init(req: TransferInitRequest) -> MessageReply:
            return await self.answer("init", req.init_info)

        async def start(req: NoFields) -> MessageReply:
            return await self.answer("start")

        async def update(req: TransferUpdateRequest) -> MessageReply:
            return await self.answer("update", req.update_info)

        async def finish(req: TransferFinishRequest) -> MessageReply:
            return await self.answer("finish", weight_version=req.weight_version)
        return [Route(admin.UPDATE_INIT_WEIGHT_TRANSFER_ENGINE, init),
                Route(admin.UPDATE_START_WEIGHT_UPDATE, start),
                Route(admin.UPDATE_UPDATE_WEIGHTS, update),
                Route(admin.UPDATE_FINISH_WEIGHT_UPDATE, finish)]

    async def answer(self, step: str, payload: Any = None,
                     weight_version: str | None = None) -> MessageReply:
        """`run`, in the contract's reply: a refusal is the route's expected failure (a
        payload that does not fit too: the system server answers AdminRequestError so)."""
        try:
            failed = await self.run(step, payload, weight_version)
        except TransferError as e:
            return MessageReply.failed(str(e))
        if failed:
            return MessageReply.failed(
                f"the weight update finished, but {failed}; this worker holds itself closed "
                "to rollouts until weights that pass are installed",
                weights_uncertain=self.admin.admission.hold_reason)
        return MessageReply(message=TRANSFER_MESSAGES[step])
