"""How the differential tests compare rlfleet's answers with the real server's."""

import os

import pytest

from tests.fleets import unit_server, vllm_serve

TOL = 1e-4  # logprobs from the same engine agree to this much (the float32 tiny model)


def close(a, b, path: str = "") -> None:
    """Equal, with floats within TOL (both may be null), keys of dicts equal."""
    if isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None and abs(a - b) <= TOL, (path, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, a, b)
        for k in a:
            close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            close(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def reference_and_fleet(request) -> tuple[str, str]:
    """(the real server's URL, rlfleet's frontend's URL) for a module's `servers` fixture:
    the `vllm_reference` server and the session vLLM fleet, or RLFLEET_DIFF_URLS="REF_URL,RLFLEET_URL"
    for servers already running (to iterate on a failure without restarts)."""
    given = os.environ.get("RLFLEET_DIFF_URLS")
    if given:
        ref, got = given.split(",")
        return ref, got
    return request.getfixturevalue("vllm_reference"), request.getfixturevalue("vllm_fleet").url


@pytest.fixture(scope="session")
def vllm_reference(request, tiny_model, tmp_path_factory) -> str:
    """vLLM's own server, one for both differential modules, with the engine arguments
    rlfleet's workers run with (the fleet's flags, plus the two defaults rlfleet.vllm.args
    sets) and its scale-out routes (/inference/v1/generate): its URL. tests/conftest.py
    imports it; it stops with the session fleet's other servers (tests.fleets.UNIT_SERVERS)."""
    return unit_server(request, vllm_serve(
        tiny_model, tmp_path_factory.mktemp("vllm-serve"), "--logprobs-mode",
        "processed_logprobs", "--max-logprobs", "20", "--enable-scale-out"))
