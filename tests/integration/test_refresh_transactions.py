"""Refreshes as epoch-fenced fleet transactions, on mocker fleets, with the journal (and the
fleet's epochs) in SQLite and in a real etcd: coordinators killed at each step of the
lifecycle and recovered by the next one, two coordinators at once, a coordinator stopped
while another takes the fleet over. Interrupted coordinators are `rlfleet refresh`
processes stopped at a named step by a test-only hooks object (tests/refresh_hooked.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from rlfleet.journal import open_journal
from rlfleet.mocker.engine import write_mock_checkpoint
from rlfleet.refresh.coordinator import PolicyRefresh
from tests.fleets import RL_MOCK_MODEL as MODEL
from tests.fleets import RL_PROBE_ENV, fault, local_fleet, mock_args, routed

SEEDS = {"A": 1, "B": 2, "C": 3}
#: `rlfleet refresh` with a coordinator that kills or stops itself at a named point
HOOKED = Path(__file__).resolve().parents[1] / "refresh_hooked.py"
# the state each hook point leaves in the journal
STATE_AT = {"gated": "resolved", "paused": "paused", "apply_half": "paused",
            "verified": "verified", "before_reopen": "probed"}


@pytest.fixture(scope="module", params=["sqlite", "etcd"])
def txf(request, tmp_path_factory):
    """A fleet of two mocker workers and the store of its journal."""
    tmp = tmp_path_factory.mktemp(f"tx-{request.param}")
    root = tmp / "weights"
    ckpts = {name: write_mock_checkpoint(root / name, seed) for name, seed in SEEDS.items()}
    journal = (str(tmp / "journal.sqlite") if request.param == "sqlite" else
               f"{request.getfixturevalue('etcd_url')}/{uuid.uuid4().hex[:8]}")
    # not start_module_fleet: each store's fleet stops before the next one starts
    with local_fleet(tmp / "fleet", [mock_args(root)] * 2, model=MODEL, enable_rl=True,
                     frontend_env=RL_PROBE_ENV) as fleet:
        fleet.ckpts, fleet.journal, fleet.tmp = ckpts, journal, tmp
        yield fleet


@contextlib.contextmanager
def coordinator(f, **kw):
    r = PolicyRefresh(f.rl_url, model=MODEL, journal=f.journal, timeout=15, **kw)
    try:
        yield r
    finally:
        r.journal.close()


def policy(f) -> dict[int, tuple]:
    """(version, digest, step) of every worker, from the worker itself."""
    out = {}
    for p in f.workers:
        v = httpx.post(f"{p.ready['system_url']}/engine/get_weight_version", timeout=5).json()
        out[int(p.ready["instance_id"])] = (v["version"], v["weight_digest"], v["step"])
    return out


def settle_on_a(f) -> int:
    """Bring the fleet to A (a fresh step), verified and open; the step."""
    with coordinator(f) as r:
        res = asyncio.run(r.refresh(f.ckpts["A"], "A", digest="mock:1"))
    assert res.ok and res.fleet_moved, res.reason
    assert {v[:2] for v in policy(f).values()} == {("A", "mock:1")}
    return res.policy.step


def cli_refresh(f, name: str, hook: str | None = None) -> subprocess.Popen:
    """`rlfleet refresh` to `name` in a process of its own; with `hook` ("POINT=kill" or
    "POINT=stop"), one that kills or stops itself at that point (tests/refresh_hooked.py)."""
    args = ["refresh", "--checkpoint", str(f.ckpts[name]), "--version", name, "--digest",
            f"mock:{SEEDS[name]}", "--rl-url", f.rl_url, "--model", MODEL, "--journal",
            f.journal]
    argv = ([sys.executable, str(HOOKED), hook, *args[1:]] if hook else
            [sys.executable, "-m", "rlfleet.cli", *args])
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(p: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        raise AssertionError(f"coordinator still running after {timeout}s:\n{out}\n{err}") \
            from None
    return p.returncode, out, err


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] == "T"


def journal_of(f):
    return contextlib.closing(open_journal(f.journal))


@pytest.mark.parametrize("point", list(STATE_AT))
def test_a_coordinator_killed_at_each_step_is_recovered(txf, point):
    """SIGKILL at a named step leaves the fleet gated and the transaction unfinished; the
    next coordinator recovers it: forward to B when every worker holds B (after verify,
    before reopen), else back to A; the fleet reopens on one verified policy and the
    journal says what happened."""
    f = txf
    step_a = settle_on_a(f)
    code, out, err = finish(cli_refresh(f, "B", f"{point}=kill"))
    assert code == -signal.SIGKILL, out + err
    assert f"RLFLEET_TEST_HOOK {point} kill" in out
    with journal_of(f) as j:
        [left] = j.unfinished(f.rl_url, MODEL, 1 << 62)
    assert left["state"] == STATE_AT[point] and left["target_version"] == "B"
    assert routed(f, 0) == set()  # the fleet stays gated: nobody reopened it
    if point == "apply_half":
        assert sorted(v[0] for v in policy(f).values()) == ["A", "B"]  # a mixed fleet

    forward = point in ("verified", "before_reopen")
    with coordinator(f) as r:
        res = asyncio.run(r.recover())
        assert asyncio.run(r.recover()) is None  # nothing left to recover
    assert res is not None and res.ok and res.kind == "recovery", res and res.reason
    want = ("B", "mock:2", step_a + 1) if forward else ("A", "mock:1", step_a)
    assert set(policy(f).values()) == {want}
    assert len(routed(f, 2)) == 2
    assert res.epoch > left["fleet_epoch"]
    with journal_of(f) as j:
        old, rec = j.get(left["id"]), j.get(res.refresh_id)
        assert j.last_served(f.rl_url, MODEL)["id"] == res.refresh_id
    how = "rolled forward: every worker holds it" if forward else "rolled back to A"
    assert old["decision"] == "recovered" and old["ended_at"] is not None
    assert old["reason"].startswith(f"interrupted after state {STATE_AT[point]}; recovered by "
                                    f"refresh {res.refresh_id}"), old["reason"]
    assert how in old["reason"] and how in rec["reason"]
    assert rec["kind"] == "recovery" and rec["recovery_of"] == left["id"]
    assert (rec["decision"], rec["served_version"], rec["served_step"]) == \
        ("reopened", want[0], want[2])
    applied = [c for w in rec["workers"].values() for c in w["calls"]
               if c["route"] == "update_weights_from_disk"]
    assert len(applied) == (1 if point == "apply_half" else 0)  # only what differed


def test_two_coordinators_at_once_one_commits_the_other_is_fenced(txf):
    """Two `rlfleet refresh` processes on one fleet and journal at the same moment (each
    worker's first install slowed so that they overlap): the newer epoch wins, the other
    stops with a fencing error, and every worker ends on the winner's policy."""
    f = txf
    settle_on_a(f)
    for p in f.workers:
        fault(p, "update_weights_from_disk", "delay", hang_seconds=6)
    procs = {name: cli_refresh(f, name) for name in ("B", "C")}
    results = {name: finish(p) for name, p in procs.items()}
    codes = sorted(code for code, _, _ in results.values())
    assert codes == [0, 3], "\n\n".join(f"{n}: {c}\n{o}\n{e}" for n, (c, o, e) in results.items())
    [winner] = [n for n, (code, _, _) in results.items() if code == 0]
    [loser] = [n for n, (code, _, _) in results.items() if code == 3]
    _, out, err = results[loser]
    assert "this coordinator was fenced" in err and "decision: fenced" in out
    assert "is older than epoch" in out or "was taken over" in out, out
    assert {v[:2] for v in policy(f).values()} == {(winner, f"mock:{SEEDS[winner]}")}
    assert len(routed(f, 2)) == 2
    with journal_of(f) as j:
        rows = [r for r in j.recent(10) if r["target_version"] in ("B", "C")
                and r["kind"] == "refresh"]
        assert [r["target_version"] for r in rows if r["decision"] == "reopened"] == [winner]
        assert all(r["ended_at"] is not None for r in rows)
        assert j.last_served(f.rl_url, MODEL)["served_version"] == winner
    for p in f.workers:  # disarm what the fenced one did not consume
        fault(p, "update_weights_from_disk", "delay", times=0)


def test_a_stopped_coordinator_is_refused_after_another_took_over(txf):
    """A coordinator stopped (SIGSTOP) with the fleet paused; another one recovers the
    fleet and refreshes it to C; the first, continued, is refused by every worker it calls
    (its epoch is older) and stops with a clear error, changing nothing."""
    f = txf
    settle_on_a(f)
    first = cli_refresh(f, "B", "paused=stop")
    deadline = time.monotonic() + 60
    while not stopped(first.pid):
        assert first.poll() is None and time.monotonic() < deadline, finish(first)
        time.sleep(0.05)
    with journal_of(f) as j:
        [left] = j.unfinished(f.rl_url, MODEL, 1 << 62)
    with coordinator(f) as second:
        res = asyncio.run(second.refresh(f.ckpts["C"], "C", digest="mock:3"))
    assert res.ok and res.fleet_moved, res.reason
    moved = policy(f)
    assert {v[:2] for v in moved.values()} == {("C", "mock:3")}
    os.kill(first.pid, signal.SIGCONT)
    code, out, err = finish(first)
    assert code == 3, out + err
    assert "decision: fenced" in out and "this coordinator was fenced" in err
    assert f"fleet epoch {left['fleet_epoch']} was fenced" in out
    # its first call after SIGCONT (the transfer) was refused by the workers' fence
    assert "refused update_weights_from_disk" in out and "is older than epoch" in out, out
    assert policy(f) == moved and len(routed(f, 2)) == 2  # nothing changed by the first
    epochs = {httpx.get(f"{p.ready['system_url']}/health", timeout=5).json()["fleet_epoch"]
              for p in f.workers}
    assert epochs == {res.epoch}
    with journal_of(f) as j:
        old = j.get(left["id"])
    assert old["decision"] == "recovered" and "interrupted after state paused" in old["reason"]


def test_a_call_from_an_old_epoch_is_refused_by_the_worker(txf):
    """The fence itself, as a worker answers it: the newest epoch is in get_weight_version,
    /health and discovery, and an older one is refused with both epochs named."""
    f = txf
    settle_on_a(f)
    w = f.workers[0]
    version = httpx.post(f"{w.ready['system_url']}/engine/get_weight_version", timeout=5).json()
    newest = version["fleet_epoch"]
    assert newest >= 1 and version["step"] is not None
    listed = httpx.get(f"{f.rl_url}/v1/rl/workers", timeout=10).json()["workers"]
    mine = next(e for e in listed if e["instance_id"] == int(w.ready["instance_id"]))
    assert (mine["fleet_epoch"], mine["weight_step"], mine["weight_version"]) == \
        (newest, version["step"], "A")
    r = httpx.post(f"{w.ready['system_url']}/engine/pause_generation", json={},
                   headers={"X-Fleet-Epoch": str(newest - 1)}, timeout=5)
    assert r.status_code == 409
    assert (r.json()["fleet_epoch"], r.json()["newest_fleet_epoch"]) == (newest - 1, newest)


def test_steps_only_increase(txf):
    f = txf
    step = settle_on_a(f)
    with coordinator(f) as r:
        with pytest.raises(ValueError, match="fleet steps only increase"):
            asyncio.run(r.refresh(f.ckpts["B"], "B", digest="mock:2", step=step))
        res = asyncio.run(r.refresh(f.ckpts["B"], "B", digest="mock:2", step=step + 5))
    assert res.ok and set(policy(f).values()) == {("B", "mock:2", step + 5)}

