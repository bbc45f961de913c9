"""SMG's data-plane headers on the frontend's generation routes (rlfleet.protocol.smg): the
request's `x-smg-version-policy` as its staleness bound, and `x-smg-weight-version` /
`x-smg-mixed-version` on the answer."""

from __future__ import annotations

from collections.abc import Mapping

from rlfleet.frontend.result import Result
from rlfleet.protocol import smg
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.runtime.http import HttpError


def _invalid(raw: str, why: str) -> HttpError:
    return HttpError(400, f"invalid version policy `{raw}`: {why}",
                     body=smg.error(smg.INVALID_VERSION_POLICY,
                                    f"invalid version policy `{raw}`: {why}"))


def policy_bound(raw: str) -> PolicyBound | None:
    """The staleness bound a header value names (None: `any`); HttpError 400 in SMG's shape
    for a value outside its grammar. rlfleet orders weights by fleet step: `latest-only` is
    no lag behind the newest step served, `max-staleness:<k>` a lag of at most k steps,
    `min-version:<v>` step v or newer (an integer)."""
    text = raw.strip()
    if text == "any":
        return None
    if text == "latest-only":
        return PolicyBound(max_lag=0)
    if text.startswith("max-staleness:"):
        k = text.removeprefix("max-staleness:")
        if not k.isdigit():
            raise _invalid(raw, "max-staleness needs a decimal integer")
        return PolicyBound(max_lag=int(k))
    if text.startswith("min-version:"):
        v = text.removeprefix("min-version:")
        if not v or any(c.isspace() for c in v):
            raise _invalid(raw, "min-version needs a version with no whitespace")
        if not v.isdigit():
            raise _invalid(raw, "rlfleet orders weights by fleet step: min-version takes a "
                                "step (a non-negative integer)")
        return PolicyBound(min_step=int(v))
    raise _invalid(raw, f"expected {smg.POLICIES}")


def request_bound(headers: Mapping[str, str], bound: PolicyBound | None) -> PolicyBound | None:
    """The request's bound: `nvext.policy` (`bound`), else its SMG header's; both: HttpError
    400 (send one)."""
    raw = headers.get(smg.VERSION_POLICY_HEADER)
    if raw is None:
        return bound
    header = policy_bound(raw)
    if bound is not None and header is not None:
        raise HttpError(400, f"the request has both nvext.policy and {smg.VERSION_POLICY_HEADER}:"
                             " send one staleness bound", param="nvext.policy")
    return bound if header is None else header


def response_headers(results: list[Result], whole: bool) -> dict[str, str]:
    """`x-smg-weight-version` (the weights the first token came from, when versioned) and,
    for a whole answer (`whole`), `x-smg-mixed-version: true` when its tokens came from
    more than one version."""
    if not results:
        return {}
    out = {}
    version = results[0].policy.version
    if version is not None and version not in smg.UNVERSIONED:
        out[smg.WEIGHT_VERSION_HEADER] = version
    if whole:
        seen = {s.version for r in results for c in r.choices if c.count for s in r.spans(c)}
        if len(seen) > 1:
            out[smg.MIXED_VERSION_HEADER] = "true"
    return out
