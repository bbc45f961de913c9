"""The admin contract's bases (rlfleet.protocol.admin): the errors a route's body can raise,
the request and reply Structs every dialect's schema builds on (vLLM-style `Reply`, SGLang-style
`SglangReply`, `Identified` for a reply that reports the policy), and the field rules more
than one dialect shares."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
from msgspec import UNSET, UnsetType

from rlfleet.protocol.identity import PolicyIdentity


class AdminRequestError(ValueError):
    """The request body is not acceptable; the message says what to send instead."""


class UnsupportedRequest(AdminRequestError):
    """A body the real server takes, asking for what an rlfleet worker does not do (an
    `engine_rpc` it does not run): HTTP 400 `{"error", "message"}` naming it, on every
    route (not the route's own 200 failure)."""

    status = 400


class ErrorBody(msgspec.Struct, kw_only=True):
    """The body of every non-200 answer but 409 (400, 401, 404, 405, 499, 500)."""

    error: str
    message: str


class StaleEpochError(ErrorBody, kw_only=True):
    """HTTP 409: a call from an older fleet epoch than the newest the worker has seen."""

    fleet_epoch: int
    newest_fleet_epoch: int

# ---------------------------------------------------------------- bases


class Request(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True,
              omit_defaults=True):
    """A route's body. `MESSAGES`: what to tell a caller who left a field out or sent it
    with the wrong type (else a message that names the field and the type).
    `ENGINE_RPCS`: for a route whose real server takes Dynamo's `engine_rpc` (the engine
    method to run), the ones this worker runs; any other is refused by name before the rest
    of the body is read (UnsupportedRequest). None: the route takes no `engine_rpc`."""

    MESSAGES: ClassVar[dict[str, str]] = {}
    ENGINE_RPCS: ClassVar[tuple[str, ...] | None] = None
    #: string fields that may not be empty (the refusal is the field's MESSAGES entry)
    NON_EMPTY: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in self.NON_EMPTY:
            if not getattr(self, name):
                raise AdminRequestError(self.MESSAGES[name])


class NoFields(Request, kw_only=True, frozen=True, forbid_unknown_fields=True,
               omit_defaults=True):
    """A route that reads no field (an empty body, or `{}`)."""


class Reply(msgspec.Struct, kw_only=True):
    """A vLLM-style reply: `status` "ok" or "error" (with `message`)."""

    status: str = "ok"
    message: str | UnsetType = UNSET

    @classmethod
    def failed(cls, message: str, **fields: Any) -> Any:
        """The failure the route expects: HTTP 200 with status "error"."""
        return cls(status="error", message=message, **fields)


class SglangReply(msgspec.Struct, kw_only=True):
    """An SGLang-style reply: `success` and `message`."""

    success: bool = True
    message: str = ""

    @classmethod
    def failed(cls, message: str, **fields: Any) -> Any:
        return cls(success=False, message=message, **fields)


class Identified:
    """A reply that carries the policy identity (the contract's `version`, `weight_digest`,
    `step`: PolicyIdentity.reply_fields)."""

    __slots__ = ()

    def policy(self) -> PolicyIdentity:
        """The identity reported. An install without a declared version reports "unknown"
        (the version is null then)."""
        fields = {k: None if v is UNSET else v for k, v in
                  ((f, getattr(self, f, None)) for f in PolicyIdentity().reply_fields())}
        ident = PolicyIdentity.from_reply(fields)
        if ident.version == "unknown" and getattr(self, "version_declared", None) is False:
            ident = msgspec.structs.replace(ident, version=None)
        return ident


# ---------------------------------------------------------------- rules the dialects share

STEP_RULE = "step must be a non-negative integer (the policy's fleet step)"
VERSION_RULE = "weight_version must be a string"
MODEL_PATH_RULE = "model_path is required (a checkpoint directory on this worker's disk)"


def check_step(step: int | None) -> None:
    if step is not None and step < 0:
        raise AdminRequestError(f"{STEP_RULE}, not {step!r}")
