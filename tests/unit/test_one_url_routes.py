"""The one-URL route table (rlfleet.protocol.fleet_control): every dialect route has a handler
in the fleet control service, none is listed twice, every operation is reached, and no
frontend route of its own shadows a control route the frontend forwards."""

from __future__ import annotations

import pytest

from rlfleet.frontend.fleet_control import ControlForward, control_routes
from rlfleet.frontend.openai import routes as openai_routes
from rlfleet.frontend.sglang import routes as sglang
from rlfleet.frontend.vllm_native import routes as vllm_native
from rlfleet.protocol.fleet_control import FORWARDED, ROUTES, SGLANG_PAUSE_MODES, Op
from rlfleet.refresh.fleet_control.app import HANDLERS


def test_every_route_has_a_handler_and_every_handler_a_route():
    keys = [(r.dialect, r.path) for r in ROUTES]
    assert len(keys) == len(set(keys))
    assert set(keys) == set(HANDLERS)


def test_every_operation_is_reached_by_some_route():
    assert {r.op for r in ROUTES} == set(Op)


def test_no_path_is_served_twice_with_one_method():
    seen = [(m, r.path) for r in ROUTES for m in r.methods]
    assert len(seen) == len(set(seen))


def test_reads_are_quick_and_changes_may_take_long():
    for r in ROUTES:
        assert r.deadline < 60 if not r.mutating else r.deadline >= 600


def test_sglang_pause_modes_map_onto_the_fleets():
    assert set(SGLANG_PAUSE_MODES.values()) <= {"abort", "keep", "wait"}


def test_the_frontends_own_routes_do_not_shadow_a_forwarded_one():
    own = {(m, route.path) for router in (openai_routes.router, sglang.router, vllm_native.router)
           for route in router.routes for m in (getattr(route, "methods", None) or ())}
    forwarded = {(m, r.path) for r in FORWARDED for m in r.methods}
    assert not own & forwarded
    assert [r.path for r in control_routes("http://127.0.0.1:1")] == [r.path for r in FORWARDED]
    # what is not forwarded, the frontend answers itself
    kept = {(m, r.path) for r in ROUTES if not r.forwarded for m in r.methods}
    assert kept <= own


def test_the_service_url_must_be_http():
    with pytest.raises(ValueError, match="http"):
        ControlForward("127.0.0.1:8002")
