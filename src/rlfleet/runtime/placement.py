"""`rlfleet up --ray`: the fleet on a Ray cluster. Each member (the frontend, every worker)
is a detached, named Ray actor in a placement group of its own, sized by what it holds (a
worker: tensor × pipeline parallel size GPUs on one node). The actor runs the member's
process and dies with it, so Ray restarts the actor, and with it the process, when either
dies; a restarted worker starts gated (`--start-gated`) and serves rollouts only after a
coordinator verified it on the current policy (`PolicyRefresh.admit_new_workers()`).

Actors and placement groups live in the Ray namespace given to `up` (default "rlfleet");
`status` and `down` find them there by name.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rlfleet.runtime.launch import FleetSpec, Member, Proc, spawn

RAY_NAMESPACE = "rlfleet"
# passed to every actor: where rlfleet's code and settings come from on the driver
_FORWARDED_ENV = ("PYTHONPATH", "RLFLEET_DISCOVERY", "ETCD_ENDPOINTS", "DYN_NAMESPACE",
                  "RLFLEET_LOG_LEVEL", "RLFLEET_ADMIN_TOKEN", "HF_HOME", "HF_HUB_OFFLINE")


class FleetMember:
    """A Ray actor around one fleet process (python -m rlfleet.frontend|vllm|mocker)."""

    def __init__(self, member: dict[str, Any], log_dir: str, ready_timeout: float) -> None:
        import ray

        self.member = Member(**member)
        self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        args = list(self.member.args)
        if self.restarted and self.member.is_worker and "--start-gated" not in args:
            args.append("--start-gated")  # a replacement serves only once verified
        self.argv = [sys.executable, "-m", self.member.module, *args]
        self.log_dir = Path(log_dir)
        self.ready_timeout = ready_timeout
        self.proc: Proc | None = None
        self._stopping = False
        self._started = threading.Event()
        # the process is started and awaited by one thread that lives as long as it does:
        # its death signal (PR_SET_PDEATHSIG) then fires only when this actor dies
        threading.Thread(target=self._run, name="fleet-member", daemon=True).start()
        self._started.wait()

    def _run(self) -> None:
        suffix = f"-{int(time.time())}" if self.restarted else ""
        self.proc = spawn(self.member.name + suffix, self.argv, self.log_dir,
                          env=dict(os.environ), die_with_parent=True)
        self._started.set()
        code = self.proc.popen.wait()
        if not self._stopping:  # the process died: so does the actor, and Ray restarts it
            print(f"rlfleet: {self.member.name} exited with {code}; ending the actor",
                  file=sys.stderr, flush=True)
            os._exit(1)

    def ready(self) -> dict[str, Any]:
        """The process's ready line (url=..., instance_id=...), once it is ready."""
        assert self.proc is not None
        return {**self.proc.wait_ready(self.ready_timeout), **self.info()}

    def info(self) -> dict[str, Any]:
        assert self.proc is not None
        return {"name": self.member.name, "pid": self.proc.pid, "ready": self.proc.ready,
                "alive": self.proc.popen.poll() is None, "restarted": self.restarted,
                "node": socket.gethostname(), "log": str(self.proc.log_path)}

    def stop(self) -> int | None:
        """Stop the process cleanly (it deregisters); the caller then kills the actor."""
        self._stopping = True
        assert self.proc is not None
        return self.proc.stop()


def _connect(address: str, namespace: str) -> None:
    import ray

    host, sep, port = address.rpartition(":")
    if sep and port.isdigit() and "://" not in address:  # a GCS address: is it there?
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except OSError as e:
            raise RuntimeError(f"no Ray cluster answers at {address}: {e}") from None
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, log_to_driver=False,
                 logging_level="WARNING")


def _pg_name(namespace: str, member: str) -> str:
    return f"{namespace}-{member}"


def up_ray(spec: FleetSpec, address: str, state_dir: Path, *, namespace: str = RAY_NAMESPACE,
           max_restarts: int = 20, timeout: float = 600) -> dict[str, Any]:
    """Start the fleet as Ray actors and wait until every member is ready; on failure,
    everything started here is removed again."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    _connect(address, namespace)
    taken = [m.name for m in [spec.frontend, *spec.workers] if _actor(m.name) is not None]
    if taken:
        raise ValueError(f"Ray namespace {namespace!r} already has fleet members {taken}: "
                         "`rlfleet down` first, or use another --ray-namespace")
    env = {k: os.environ[k] for k in _FORWARDED_ENV if os.environ.get(k)}
    log_dir = str(Path(state_dir).absolute() / "logs")
    actors = []
    try:
        for m in [spec.frontend, *spec.workers]:
            bundle = {"CPU": m.cpus, **({"GPU": m.gpus} if m.gpus else {})}
            pg = placement_group([bundle], strategy="STRICT_PACK",
                                 name=_pg_name(namespace, m.name), lifetime="detached")
            if not pg.wait(timeout_seconds=min(timeout, 120)):
                ray.util.remove_placement_group(pg)
                raise RuntimeError(f"{m.name} needs {bundle} on one node; the cluster has "
                                   f"{ray.available_resources()} free")
            actor = ray.remote(FleetMember).options(
                name=m.name, namespace=namespace, lifetime="detached",
                max_restarts=max_restarts, max_task_retries=0, num_cpus=m.cpus,
                num_gpus=m.gpus, runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0),
            ).remote(vars(m), log_dir, timeout)
            actors.append((m, actor))
        members = [ray.get(a.ready.remote(), timeout=timeout) for _, a in actors]
    except BaseException:
        down_ray({"namespace": namespace, "members": [{"name": m.name} for m, _ in actors]
                  or [{"name": spec.frontend.name}]}, address)
        raise
    return {"mode": "ray", "address": address, "namespace": namespace,
            "discovery": spec.discovery, "members": members}


def _actor(name: str):
    import ray

    try:
        return ray.get_actor(name)
    except ValueError:
        return None


def status_ray(state: dict[str, Any], address: str) -> list[dict[str, Any]]:
    import ray

    _connect(address, state["namespace"])
    out = []
    for m in state["members"]:
        a = _actor(m["name"])
        if a is None:
            out.append({"name": m["name"], "alive": False, "actor": "gone"})
            continue
        try:
            out.append({**ray.get(a.info.remote(), timeout=10), "actor": "alive"})
        except Exception as e:  # restarting, or its node is gone
            out.append({"name": m["name"], "alive": False, "actor": f"unavailable: {e!r}"[:200]})
    return out


def down_ray(state: dict[str, Any], address: str, timeout: float = 60) -> None:
    """Stop every member's process cleanly, kill its actor for good, remove its placement
    group; returns once no actor of the fleet is left."""
    import ray
    from ray.util import get_placement_group, remove_placement_group

    namespace = state["namespace"]
    _connect(address, namespace)
    names = [m["name"] for m in reversed(state["members"])]
    handles = {n: a for n in names if (a := _actor(n)) is not None}
    stops = {n: a.stop.remote() for n, a in handles.items()}
    for n, ref in stops.items():
        try:
            ray.get(ref, timeout=30)
        except Exception:  # noqa: BLE001 - it is killed below anyway
            pass
        ray.kill(handles[n], no_restart=True)
    for n in names:
        try:
            remove_placement_group(get_placement_group(_pg_name(namespace, n)))
        except ValueError:
            pass
    deadline = time.monotonic() + timeout
    while any(_actor(n) is not None for n in names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"actors still alive after {timeout:.0f}s: "
                               f"{[n for n in names if _actor(n) is not None]}")
        time.sleep(0.2)
