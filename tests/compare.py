"""How the differential tests compare rlfleet's answers with the real server's."""

import os

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
    its `vllm_url` fixture and the session vLLM fleet, or RLFLEET_DIFF_URLS="REF_URL,RLFLEET_URL"
    for servers already running (to iterate on a failure without restarts)."""
    given = os.environ.get("RLFLEET_DIFF_URLS")
    if given:
        ref, got = given.split(",")
        return ref, got
    return request.getfixturevalue("vllm_url"), request.getfixturevalue("vllm_fleet").url
