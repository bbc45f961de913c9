"""The admin route table (rlfleet.protocol.admin) as a contract: every route has a request
and a reply Struct; a body is refused by name when it carries a field the route does not
take (a typo such as `"chain": true` beside `source` instead of inside it); the typed
client (rlfleet.runtime.admin_client) reads typed replies. In-process, over the mocker's
simulated engine."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from rlfleet.mocker.admin import MockAdmin
from rlfleet.mocker.engine import MockEngine
from rlfleet.protocol import admin
from rlfleet.protocol.admin import AdminRequestError, AnyBody, read_request
from rlfleet.protocol.identity import PolicyIdentity
from rlfleet.runtime.admin_client import AdminClient
from rlfleet.worker.system_server import FaultInjector, system_app

ALL = [*admin.ROUTES.values(), *admin.NATIVE_METHODS.values()]
STRICT = [r for r in ALL if r.request is not AnyBody]
NATIVE = "pause_generation continue_generation flush_cache get_weight_version"


@pytest.mark.parametrize("route", ALL, ids=lambda r: r.name)
def test_every_route_has_request_and_reply_structs(route: admin.AdminRoute) -> None:
    assert issubclass(route.request, msgspec.Struct) and issubclass(route.reply, msgspec.Struct)
    assert route.name == route.name.strip("/") and route.name


def test_only_the_routes_the_mocker_does_not_support_take_any_body() -> None:
    assert {r.name for r in ALL if r.request is AnyBody} == {
        "control/update_weights_from_distributed", "control/update_weights_from_tensor",
        "control/update_weights_from_ipc"}


@pytest.mark.parametrize("route", STRICT, ids=lambda r: r.name)
def test_an_unknown_field_is_refused_by_name(route: admin.AdminRoute) -> None:
    with pytest.raises(AdminRequestError) as e:
        read_request(route, {"chain": True})
    assert "unknown field 'chain'" in str(e.value) and route.name in str(e.value)
    for field in route.request.__struct_fields__:
        assert field in str(e.value)  # what the route does take


def test_a_chain_flag_beside_the_source_of_stage_weights_is_refused() -> None:
    body = {"version": "v2", "source": {"kind": "peer", "chain": True}}
    assert read_request(admin.STAGE_WEIGHTS, body).source == {"kind": "peer", "chain": True}
    with pytest.raises(AdminRequestError, match="unknown field 'chain'.*stage_weights takes "
                                                "version, source, digest"):
        read_request(admin.STAGE_WEIGHTS, {"version": "v2", "source": {"kind": "peer"},
                                           "chain": True})


@pytest.mark.parametrize(("route", "body", "words"), [
    (admin.PAUSE_GENERATION, {"mode": 3}, "mode must be str, not int (pause_generation)"),
    (admin.INIT_WEIGHTS_UPDATE_GROUP,
     {"master_address": "h", "master_port": 1, "world_size": 2, "group_name": 5},
     "group_name must be str | null, not int"),
    (admin.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
     {"names": ["w"], "dtypes": ["f"], "shapes": [["x"]]}, "shapes[0][0] must be int"),
    (admin.SET_ADMISSION, {}, "open (boolean) is required"),
    (admin.SET_WEIGHT_VERSION, {"weight_version": "v", "step": True},
     "step must be a non-negative integer"),
    (admin.INIT_WEIGHTS_UPDATE_GROUP,
     {"master_address": "h", "master_port": 1, "world_size": 2, "rank_offset": 2},
     "rank_offset must be an integer in [1, world_size); got 2"),
    (admin.UPDATE_WEIGHTS_FROM_DISTRIBUTED,
     {"names": ["w"], "dtypes": ["f"], "shapes": [[1]], "allow_unpaused": True},
     "allow_unpaused cannot be combined with reset_prefix_cache"),
    (admin.COLLECTIVE_RPC, {}, "Missing 'method' in request body"),
    (admin.COLLECTIVE_RPC, {"method": "sleep"},
     "collective_rpc for 'reload_weights' only (a reload from disk, with "
     "update_weights_from_disk's checks), not 'sleep'"),
    (admin.COLLECTIVE_RPC, {"method": "reload_weights", "args": ["/w"]},
     "reload_weights takes kwargs weights_path, is_checkpoint_format only"),
    (admin.COLLECTIVE_RPC, {"method": "reload_weights", "kwargs": {"turbo": 1}},
     "unknown kwargs ['turbo']"),
    (admin.COLLECTIVE_RPC,
     {"method": "reload_weights", "kwargs": {"is_checkpoint_format": False}},
     "checkpoint-format files only"),
    (admin.COLLECTIVE_RPC, {"method": "reload_weights", "timeout": "soon"},
     "timeout must be a number of seconds"),
    (admin.UPDATE_INIT_WEIGHT_TRANSFER_ENGINE, {}, "init_info is required: an object"),
    (admin.UPDATE_INIT_WEIGHT_TRANSFER_ENGINE, {"init_info": "nccl"}, "init_info is required"),
    (admin.UPDATE_UPDATE_WEIGHTS, {"update_info": 3}, "update_info is required: an object, "
     "or one per rank"),
    (admin.UPDATE_FINISH_WEIGHT_UPDATE, {"weight_version": 3},
     "weight_version must be a string, or null"),
    (admin.UPDATE_START_WEIGHT_UPDATE, {"update_info": {}},
     "unknown field 'update_info': update/start_weight_update takes no fields"),
])
def test_a_wrong_body_names_the_field(route: admin.AdminRoute, body: dict, words: str) -> None:
    with pytest.raises(AdminRequestError) as e:
        read_request(route, body)
    assert words in str(e.value)


def test_collective_rpc_takes_vllms_body_for_reload_weights() -> None:
    """Dynamo 1.7's client body (prime-rl's): method, timeout, args, kwargs.weights_path."""
    body = {"method": "reload_weights", "timeout": 30.0, "args": [],
            "kwargs": {"weights_path": "/ckpt/step-7"}}
    req = read_request(admin.COLLECTIVE_RPC, body)
    assert req.weights_path == "/ckpt/step-7" and req.timeout == 30.0
    assert read_request(admin.COLLECTIVE_RPC, {"method": "reload_weights"}).weights_path is None
    assert admin.COLLECTIVE_RPC in admin.DYNAMO_17 and admin.COLLECTIVE_RPC.mutating
    assert admin.COLLECTIVE_RPC.serialized and admin.COLLECTIVE_RPC.fenced
    assert msgspec.json.decode(msgspec.json.encode(admin.CollectiveRpcReply(
        results=[None]))) == {"status": "ok", "results": [None]}


def test_the_weight_transfer_steps_take_vllms_bodies() -> None:
    """Dynamo 1.7's update/* bodies, as prime-rl's client sends them: vLLM's, embedded."""
    init = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
            "world_size": 2}
    assert read_request(admin.UPDATE_INIT_WEIGHT_TRANSFER_ENGINE,
                        {"init_info": init}).init_info == init
    chunk = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
    for info in (chunk, [chunk, chunk]):  # one, or one per rank
        assert read_request(admin.UPDATE_UPDATE_WEIGHTS, {"update_info": info}).update_info == info
    finish = admin.UPDATE_FINISH_WEIGHT_UPDATE
    assert read_request(finish, {"weight_version": "3"}).weight_version == "3"
    assert read_request(finish, {}).weight_version is None
    for route in admin.DYNAMO_17_TRANSFER:
        assert route in admin.DYNAMO_17 and admin.ROUTES[route.name] is route
        assert route.mutating and route.serialized and route.fenced and not route.native
        assert route.reply is admin.MessageReply


def test_requests_encode_only_what_the_caller_set() -> None:
    assert msgspec.json.encode(admin.PauseRequest(mode="wait")) == b'{"mode":"wait"}'
    assert msgspec.json.encode(admin.NativePauseRequest()) == b"{}"
    assert msgspec.json.decode(msgspec.json.encode(admin.SetVersionRequest(
        weight_version=None))) == {"weight_version": None}  # an explicit null is a declaration


def test_install_replies_carry_the_policy_identity() -> None:
    ident = PolicyIdentity(version="v3", digest="blake3:ab", step=3)
    reply = admin.InstallReply(**ident.reply_fields(), version_declared=True)
    assert msgspec.json.decode(msgspec.json.encode(reply)) == {
        "status": "ok", "version": "v3", "weight_digest": "blake3:ab", "step": 3,
        "version_declared": True} and reply.policy() == ident
    unknown = admin.InstallReply(version="unknown", version_declared=False, weight_digest="d")
    assert unknown.policy() == PolicyIdentity(digest="d")


def mock_client(schema: str = "vllm") -> tuple[MockAdmin, httpx.AsyncClient]:
    engine = MockEngine(seed=4)
    mock = MockAdmin(engine, schema=schema, engine_routes=NATIVE if schema == "sglang" else None)
    app = system_app(mock.routes(), faults=FaultInjector(), fence=mock.fence)
    return mock, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w")


@pytest.mark.parametrize("schema", ["vllm", "sglang"])
async def test_every_served_route_refuses_an_unknown_field_in_its_own_shape(schema: str) -> None:
    mock, http = mock_client(schema)
    async with http:
        served = (await http.get("/engine")).json()["routes"] + ["fault_injection"]
        for name in served:
            fixed = schema == "vllm" or name.startswith("control/") or name == "fault_injection"
            route = admin.ROUTES[name] if fixed else admin.NATIVE_METHODS[name]
            resp = await http.post(f"/engine/{name}", json={"chain": True})
            if route.request is AnyBody:
                assert resp.json()["success"] is False, name
            elif route.native:  # a bad argument of a native method: 400 (issue 43; was 500)
                assert resp.status_code == 400 and "unknown field 'chain'" in \
                    resp.json()["message"], name
            else:
                body = resp.json()
                assert resp.status_code == 200 and "unknown field 'chain'" in body["message"]
                assert body.get("status") == "error" or body.get("success") is False, name


async def test_the_client_reads_typed_replies() -> None:
    mock, http = mock_client()
    async with http:
        client = AdminClient(http, timeout=5)
        res = await client.call("http://w", admin.GET_WEIGHT_VERSION)
        assert res.ok and res.http_status == 200
        assert isinstance(res.reply, admin.VersionReply)
        assert res.reply.policy() == PolicyIdentity(digest="mock:4") and res.reply.fleet_epoch == 0
        paused = await client.call("http://w", admin.PAUSE_GENERATION,
                                   admin.PauseRequest(mode="wait"))
        assert paused.ok and (paused.reply.mode, paused.reply.clear_cache) == ("wait", False)
        await client.call("http://w", admin.RESUME_GENERATION)
        refused = await client.call("http://w", admin.ABORT_REQUEST)
        assert not refused.ok and refused.http_status == 200
        assert refused.message.startswith("request_id is required")
        # a call from an older fleet epoch: HTTP 409, seen as such
        fenced = AdminClient(http, timeout=5, epoch=7)
        assert (await fenced.call("http://w", admin.FLUSH_CACHE)).ok
        stale = await AdminClient(http, timeout=5, epoch=6).call("http://w", admin.FLUSH_CACHE)
        assert stale.stale_epoch and stale.http_status == 409 and not stale.ok
    async with httpx.AsyncClient() as direct:  # nothing listens on port 9 (discard)
        gone = await AdminClient(direct, timeout=5).call("http://127.0.0.1:9",
                                                         admin.LIVENESS_PROBE)
    assert gone.unreachable and not gone.ok and gone.body == {"error": gone.error}
