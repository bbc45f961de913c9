"""vLLM's weight checker (`POST /weight_checker`, vllm/entrypoints/serve/dev/rlhf/), as rlfleet
answers it: checksum reports are maps of rank-qualified keys (`dp:pp:pcp:tp:ep:` then a
name) to digests; comparing reports says whether every key has one digest in every report,
which keys do not, and which rank prefixes the reports covered. An rlfleet worker reports
one key per engine rank, `...:weights`, whose digest is the content digest of the weights it
serves (rlfleet.weights.digest: over every tensor handed to the loader, which vLLM's CPU
build repacks, so live tensors cannot be hashed there); the fleet's report at one URL is its
workers' reports merged, each worker's keys under its own data-parallel rank."""

from __future__ import annotations

from typing import Any

#: what a worker's report names its weights (after the rank prefix)
WEIGHTS_KEY = "weights"
#: why `{"action": "reset"}` is refused (HTTP 400)
RESET_REFUSED = ("action 'reset' overwrites the served weights with random values, and an "
                 "rlfleet worker serves only weights it vouches for: to check a transfer, "
                 "take a checksum, transfer, and compare the new checksum with the one the "
                 "trainer expects (the content digest of its checkpoint: rlfleet digest)")


def rank_prefix(dp: int = 0, pp: int = 0, pcp: int = 0, tp: int = 0, ep: int = 0) -> str:
    return f"dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:ep{ep}:"


def split_key(key: str) -> tuple[str, str]:
    """(rank prefix, name) of a rank-qualified key; ("", key) when it has no prefix."""
    parts = key.split(":", 5)
    if len(parts) != 6:
        return "", key
    return ":".join(parts[:5]) + ":", parts[5]


def under_dp(report: dict[str, str], dp: int) -> dict[str, str]:
    """One server's report as data-parallel rank `dp` of a larger one (its keys' `dp` field
    replaced; a key without a rank prefix gets one)."""
    out = {}
    for key, digest in report.items():
        prefix, name = split_key(key)
        rest = prefix.split(":", 1)[1] if prefix else "pp0:pcp0:tp0:ep0:"
        out[f"dp{dp}:{rest}{name}"] = digest
    return out


def merge(reports: list[dict[str, str]]) -> dict[str, str]:
    """Several reports of disjoint ranks as one; ValueError names a key two of them hold."""
    out: dict[str, str] = {}
    for report in reports:
        twice = sorted(out.keys() & report.keys())
        if twice:
            raise ValueError(f"duplicate weight checksum keys: {', '.join(twice)}")
        out.update(report)
    return out


def compare(reports: list[dict[str, str]]) -> tuple[bool, list[str], list[str]]:
    """Whether every key has the same digest in every report, the keys that do not (or that
    some reports lack), and the rank prefixes covered."""
    seen: dict[str, dict[int, str]] = {}
    for i, report in enumerate(reports):
        for key, digest in report.items():
            seen.setdefault(key, {})[i] = digest
    mismatches = sorted(k for k, by in seen.items()
                        if len(by) != len(reports) or len(set(by.values())) > 1)
    return not mismatches, mismatches, sorted({split_key(k)[0] for k in seen})


def read_reports(body: dict[str, Any]) -> tuple[str, dict[str, str] | None, list[dict[str, str]]]:
    """(action, baseline, other reports) of a request body; ValueError says what is wrong, as
    vLLM's checks say it (HTTP 400)."""
    action = body.get("action")
    if action not in ("checksum", "reset", "compare"):
        raise ValueError(f"action must be one of checksum|reset|compare, got {action!r}")
    if action != "compare":
        return action, None, []
    baseline = body.get("baseline")
    if not isinstance(baseline, dict):
        raise ValueError("action='compare' requires a 'baseline' object")
    others = body.get("checksums")
    if others is None:
        others = []
    if not isinstance(others, list) or not all(isinstance(r, dict) for r in others):
        raise ValueError("'checksums' must be a list of checksum response objects")
    return action, baseline, others
