"""`rlfleet up` with `control:` in its fleet config starts the fleet control service beside
the frontend and workers, points the frontend's --fleet-control at it, and `rlfleet down`
stops it with the rest. Mocker workers (the declared simulator): the point is what `up`
starts and wires, not an engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from rlfleet.journal import SqliteJournal
from tests.fleets import wait_for_workers

MODEL = "mock-up-control"


def rlfleet(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfleet.cli", *argv], capture_output=True,
                          text=True, timeout=180)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def worker_paused(member: dict) -> bool:
    r = httpx.get(f"{member['ready']['system_url']}/engine/is_paused", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["is_paused"]


def test_up_starts_the_control_service_the_frontend_forwards_to_and_down_stops_it(
        tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    config = tmp_path / "fleet.yaml"
    config.write_text(yaml.safe_dump({
        "frontend": {"http-port": 0, "rl-port": 0},  # free ports (no enable-rl: control adds it)
        "control": {"port": 0, "journal": str(journal), "model": MODEL},
        "workers": [{"kind": "mocker", "count": 2,
                     "args": {"served-model-name": MODEL, "enable-rl": True, "system-port": 0,
                              "token-delay": 0.001}}]}))
    state = tmp_path / "state"
    up = rlfleet("up", "--config", str(config), "--state", str(state))
    members: list[dict] = []
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        members = json.loads((state / "fleet.json").read_text())["members"]
        by_name = {m["name"]: m for m in members}
        assert sorted(by_name) == ["control", "frontend", "worker-0", "worker-1"]
        control_url = by_name["control"]["ready"]["url"]
        assert f"fleet control: {control_url}" in up.stdout, up.stdout
        assert by_name["control"]["ready"]["journal"] == str(journal)
        workers = [by_name["worker-0"], by_name["worker-1"]]
        url = by_name["frontend"]["ready"]["url"]
        wait_for_workers(url, MODEL, 2)

        # the single-server routes at the frontend's URL act on the whole fleet
        assert httpx.get(f"{url}/get_world_size", timeout=10).json() == {"world_size": 2}
        assert httpx.get(f"{url}/is_paused", timeout=10).json() == {"is_paused": False}
        assert not any(worker_paused(w) for w in workers)
        r = httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=60)
        assert r.json() == {"status": "paused"}, r.text
        assert httpx.get(f"{url}/is_paused", timeout=10).json() == {"is_paused": True}
        assert all(worker_paused(w) for w in workers)
        r = httpx.post(f"{url}/resume", timeout=60)
        assert r.json() == {"status": "resumed"}, r.text
        assert httpx.get(f"{url}/is_paused", timeout=10).json() == {"is_paused": False}
        assert not any(worker_paused(w) for w in workers)
        with SqliteJournal(journal) as j:  # the service's journal is the config's
            rec = j.recent(1)[0]
        assert (rec["kind"], rec["state"]) == ("control", "reopened")
        out = httpx.post(f"{url}/v1/completions", timeout=60,
                         json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4})
        assert out.status_code == 200, out.text

        status = rlfleet("status", "--state", str(state), "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        assert {m["name"]: m["alive"] for m in json.loads(status.stdout)["members"]} == {
            "frontend": True, "worker-0": True, "worker-1": True, "control": True}
    finally:
        down = rlfleet("down", "--state", str(state))
        assert down.returncode == 0, down.stdout + down.stderr
    assert "4 member(s) stopped" in down.stdout, down.stdout
    assert not [m["name"] for m in members if alive(m["pid"])]
    with httpx.Client(timeout=2) as c:  # nothing answers at the service's URL any more
        try:
            c.get(f"{control_url}/is_paused")
            raise AssertionError(f"the control service at {control_url} still answers")
        except httpx.TransportError:
            pass


def test_up_refuses_control_flags_it_sets_itself(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text("control: {rl-url: 'http://127.0.0.1:9'}\n")
    bad = rlfleet("up", "--config", str(config), "--kind", "mocker",
                  "--state", str(tmp_path / "state"))
    assert bad.returncode != 0 and "set by `rlfleet up`" in bad.stderr, bad.stdout + bad.stderr
    assert not (tmp_path / "state" / "fleet.json").exists()


def test_the_documented_control_section_makes_a_service_the_frontend_forwards_to(
        tmp_path: Path) -> None:
    """docs/one-url.md's fleet.yaml: every `control:` key is a flag of `rlfleet control`, the
    frontend forwards to the service's port, and the admin token stays off command lines."""
    import re

    from rlfleet.cli import build_parser
    from rlfleet.runtime.launch import FleetSpec

    docs = (Path(__file__).resolve().parents[2] / "docs" / "one-url.md").read_text()
    example = next(d for d in (yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```",
                                                                     docs, re.S))
                   if isinstance(d, dict) and "control" in d)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    spec = FleetSpec.load(example, state_dir=tmp_path, admin_token_file=str(token))
    assert spec.control is not None and spec.control_url == "http://127.0.0.1:8002"
    args = build_parser().parse_args([*spec.control.args, "--rl-url", "http://127.0.0.1:8001"])
    assert (args.port, args.host, args.journal, args.on_failure) == (
        8002, "127.0.0.1", "/var/lib/rlfleet/journal.sqlite", "rollback")
    fe = spec.frontend.args
    assert fe[fe.index("--fleet-control") + 1] == spec.control_url and "--enable-rl" in fe
    assert spec.control.env == {"RLFLEET_ADMIN_TOKEN": "s3cret"}
    assert not any("s3cret" in a for m in [spec.frontend, spec.control, *spec.workers]
                   for a in m.args)
    free = FleetSpec.load({"control": {"port": 0}, "workers": [{"kind": "mocker"}]},
                          state_dir=tmp_path).control_url
    assert free is not None and not free.endswith(":0")  # settled before the frontend starts
