"""How the fleet control service's routes read their requests: the JSON body as the route's
shape (rlfleet.protocol.fleet_control), a query flag; every way they can be wrong is a
BadRequest that says how. `Handler` is what each dialect's route module binds a route to."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from rlfleet.protocol.fleet_control import Body
from rlfleet.refresh.fleet_control.service import BadRequest, FleetControl
from rlfleet.runtime.http import bad_json_message

Handler = Callable[["FleetControl", Request], Awaitable[Response]]
B = TypeVar("B", bound=Body)
T = TypeVar("T")


async def read_body(request: Request, shape: type[B] | None = None) -> Any:
    """The request's JSON body as `shape` (rlfleet.protocol.fleet_control: the fields the
    route reads; without one, a JSON object as a dict); an empty body is all defaults. Every
    way a body can be wrong is a BadRequest that says how: not JSON, nested past what is
    decoded, not an object, a field of the wrong type (named). Every route reads its body
    here."""
    raw = await request.body()
    if not raw.strip():
        return shape() if shape is not None else {}
    try:
        return msgspec.json.decode(raw, type=shape or dict[str, Any])
    except RecursionError as e:
        raise BadRequest(f"the body is not JSON rlfleet can read: {bad_json_message(e)}") \
            from None
    except msgspec.ValidationError as e:
        raise BadRequest(f"the body does not fit {request.url.path}: {_named(e)}") from None
    except (msgspec.DecodeError, UnicodeError) as e:
        raise BadRequest(f"the body is not JSON: {bad_json_message(e, raw)}") from None


def _named(e: msgspec.ValidationError) -> str:
    """msgspec's "Expected `str`, got `object` - at `$.mode`" as "field mode: expected str,
    got object"."""
    text = str(e).replace("`", "")
    what, _, where = text.partition(" - at $.")
    if not where:
        return f"the body must be a JSON object ({text[0].lower()}{text[1:]})"
    return f"field {where}: {what[0].lower()}{what[1:]}"


def flag(value: str | None, name: str, default: bool) -> bool:
    if value is None:
        return default
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise BadRequest(f"{name} must be true or false, not {value!r}")


def required(value: T | None, message: str) -> T:
    """`value`, which the route needs: BadRequest `message` when the body left it out."""
    if value is None:
        raise BadRequest(message)
    return value


class Handlers(dict[tuple[str, str], Handler]):
    """A dialect module's routes, (dialect, path) -> handler, filled by its `route`
    decorator."""

    def route(self, dialect: str, *paths: str) -> Callable[[Handler], Handler]:
        def bind(handler: Handler) -> Handler:
            for path in paths:
                self[dialect, path] = handler
            return handler
        return bind
