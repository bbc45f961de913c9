"""Start and stop fleet processes (frontend, workers) for `rlfleet up`, the demo,
benchmarks and tests: local processes here, Ray actors in rlfleet.runtime.placement. Every
process gets the engine environment written by setup (`<venv>/rlfleet.env`), its own
process group, and a log file (`spawn`), or its output relayed through a supervisor
(`spawn_relayed`: the frontend's `--processes`); one readiness wait (`Proc.wait_ready`) and
one stop (`Proc.stop`, `stop_all`) for all of them. The harness that tests, benchmarks and
the demo start fleets with (`LocalFleet`, vLLM's own server `vllm_serve`) is in
rlfleet.testing.fleet."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rlfleet.runtime import preload
from rlfleet.runtime.auth import settle_admin_token
from rlfleet.runtime.discovery import default_discovery_url
from rlfleet.runtime.logs import READY_PREFIX, parse_ready


def engine_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for engine processes: os.environ plus <venv>/rlfleet.env (the CPU or
    GPU engine settings chosen at setup time)."""
    env = dict(os.environ if base is None else base)
    envfile = Path(sys.prefix) / "rlfleet.env"
    if envfile.exists():
        for line in envfile.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() and key.strip() not in env:
                env[key.strip()] = value.strip()
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


#: the socket of a preload server (rlfleet.runtime.preload) that `spawn` forks rlfleet's own
#: processes from: set by a process that starts dozens of them (the test suite)
PRELOADED: str | None = None


@dataclass
class Proc:
    """A started process: `ready` holds the fields of its ready line once it printed one
    (rlfleet.runtime.logs.parse_ready); its output is in `log_path` (None: relayed, see
    spawn_relayed)."""

    name: str
    popen: subprocess.Popen | preload.Forked
    log_path: Path | None
    ready: dict[str, str] = field(default_factory=dict)
    _ready_event: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def saw(self, line: str, marker: str = READY_PREFIX) -> bool:
        """Whether `line` of its output is its ready line (its fields are then `ready`)."""
        fields = parse_ready(line, marker)
        if fields is None:
            return False
        self.ready = fields
        self._ready_event.set()
        return True

    def wait_ready(self, timeout: float, probe: Callable[[], bool] | None = None
                   ) -> dict[str, str]:
        """Its ready fields, once it is ready (its ready line; or, with `probe`, for a
        process that prints none, once `probe()` is true); RuntimeError if it exits first,
        TimeoutError after `timeout` seconds (both name its log and end with its tail)."""
        deadline = time.monotonic() + timeout
        while not self._is_ready(probe):
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.popen.returncode} before it "
                                   f"was ready{self._where()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s{self._where()}")
        return self.ready

    def _is_ready(self, probe: Callable[[], bool] | None) -> bool:
        if probe is None:
            return self._ready_event.wait(0.2)
        if probe():
            return True
        time.sleep(0.5)
        return False

    def _where(self) -> str:
        return "" if self.log_path is None else f"; log: {self.log_path}\n{self.tail()}"

    def tail(self, n: int = 30) -> str:
        if self.log_path is None:
            return ""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code. Whatever the process
        left behind in its group (an engine-core child, say) is killed too."""
        self.signal(signal.SIGTERM)
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            code = self.popen.wait(5)
        deadline = time.monotonic() + 5.0
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
            while time.monotonic() < deadline:  # until the kernel has removed them all
                os.killpg(self.popen.pid, 0)
                time.sleep(0.05)
        except (ProcessLookupError, PermissionError):
            pass
        return code


def stop_all(procs: list[Proc], timeout: float = 15.0) -> None:
    """SIGTERM every process's group at once, then `Proc.stop` each in turn (each given
    `timeout` seconds before SIGKILL)."""
    for p in procs:
        p.signal(signal.SIGTERM)
    for p in procs:
        p.stop(timeout)


def die_when_parent_dies() -> None:
    """In the child before exec: SIGKILL when the thread that started it dies (a Ray actor
    killed by Ray takes its worker with it)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


#: vLLM's variable for the cores a CPU engine's OpenMP threads run on: a list ("0-3,6"),
#: one per rank of a parallel engine ("0-1|2-3"), "auto" or "nobind"
CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_shares(count: int, cpus: Iterable[int] | None = None) -> list[str]:
    """The cores of this host (the CPUs this process may use) split among `count` CPU-engine
    workers, as CPU_BIND lists: each worker its own contiguous block, or one core each in
    turn when there are more workers than cores. Two engines whose OpenMP teams each span
    every core stall each other at their barriers (docs/engine-notes.md: a 4 s stall in
    a refresh where a pinned pair's longest gap is 0.5 s)."""
    cores = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if count < 1 or not cores:
        return []
    if count >= len(cores):
        return [str(cores[i % len(cores)]) for i in range(count)]
    per, extra = divmod(len(cores), count)
    out, at = [], 0
    for i in range(count):
        n = per + (i < extra)
        out.append(",".join(map(str, cores[at:at + n])))
        at += n
    return out


def pinned_env(cores: str) -> dict[str, str]:
    """The environment of a CPU-engine worker pinned to `cores` (a CPU_BIND list of single
    CPUs and ranges), as vLLM sets it for each rank it binds: an OpenMP team as wide as the
    list, and Intel OpenMP's threads asleep 5 ms after a parallel region instead of spinning
    200 ms (a spinning thread held the core the shadow's builder shares with it: builds 2-3x
    as long). In the environment the process starts with: the OpenMP runtime reads it once."""
    n = 0
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return {CPU_BIND: cores, "OMP_NUM_THREADS": str(n), "KMP_BLOCKTIME": "5", "KMP_TPAUSE": "0"}


_KEEP_CPUS: set[int] | None = None  # the CPUs a forked child is given back


def keep_cpus_in_forked_children() -> None:
    """A child this process forks from now on runs on the CPUs this process may use now.
    Intel OpenMP (preloaded by the CPU engine) pins a forked child to the first CPU of its
    mask, whatever the settings: two workers' forked engine cores took turns on one core
    while the other stayed idle."""
    global _KEEP_CPUS
    if _KEEP_CPUS is None and hasattr(os, "sched_setaffinity"):
        _KEEP_CPUS = os.sched_getaffinity(0)
        os.register_at_fork(after_in_child=lambda: os.sched_setaffinity(0, _KEEP_CPUS))


# exec'd by multiprocessing instead of the interpreter: `setpriv --pdeathsig KILL` then python
CHILD_WRAPPER = Path(__file__).with_name("die_with_parent.sh")
_children_die: bool | None = None  # set once per process


def children_die_with_this_process() -> bool:
    """Every process this one starts from now on through multiprocessing (vLLM's engine core,
    whatever that starts in turn with `fork`) gets SIGKILL when this process dies, even by
    SIGKILL: nothing of a worker outlives it, and a GPU's memory is freed with it.

    `spawn` children are exec'd through CHILD_WRAPPER (vLLM wraps its children the same way
    for numactl); `fork` children set the signal themselves. Multiprocessing's resource
    tracker is started first, unwrapped: it exits on its own once the last process that
    holds its pipe is gone, after cleaning up what they leaked. False (and nothing changed
    for `spawn` children) when `setpriv` (util-linux) is missing."""
    import multiprocessing
    import shutil
    from multiprocessing import resource_tracker, spawn

    global _children_die
    if _children_die is not None:
        return _children_die
    os.register_at_fork(after_in_child=die_when_parent_dies)
    _children_die = shutil.which("setpriv") is not None and os.access(CHILD_WRAPPER, os.X_OK)
    if not _children_die:
        return False
    resource_tracker.ensure_running()
    os.environ["RLFLEET_CHILD_PYTHON"] = os.fsdecode(spawn.get_executable())
    multiprocessing.set_executable(str(CHILD_WRAPPER))
    return True


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None,
          ready_marker: str | None = READY_PREFIX, cwd: Path | None = None,
          die_with_parent: bool = False) -> Proc:
    """Start `argv` in its own process group; its output goes straight to
    <log_dir>/<name>.log (no pipe: a busy parent never blocks the child's writes), and the
    first ready line (rlfleet.runtime.logs.parse_ready, text or json) whose marker starts
    with `ready_marker` marks it ready; its fields are `Proc.ready` (`ready_marker` None:
    it prints none; wait for it with a probe, see Proc.wait_ready)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    full_env = engine_env(env)
    with open(log_path, "wb") as out:
        popen = (preload.fork(PRELOADED, argv, full_env, cwd, log_path)
                 if PRELOADED and not die_with_parent else None)
        if popen is None:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=full_env,
                                     start_new_session=True, cwd=cwd,
                                     preexec_fn=die_when_parent_dies if die_with_parent else None)
    proc = Proc(name, popen, log_path)

    def watch() -> None:
        """Read the log as it grows until the ready line (or the process ends)."""
        with open(log_path, "rb") as f:
            pending = b""
            while True:
                chunk = f.readline()
                if not chunk:
                    if popen.poll() is not None:
                        return
                    time.sleep(0.05)
                    continue
                pending += chunk
                if not pending.endswith(b"\n"):
                    continue
                line, pending = pending.decode(errors="replace"), b""
                if proc.saw(line, ready_marker):
                    return

    if ready_marker is not None:
        threading.Thread(target=watch, name=f"ready-{name}", daemon=True).start()
    return proc


def spawn_relayed(name: str, argv: list[str], env: dict[str, str], out: IO[bytes] | None = None,
                  ready_marker: str = READY_PREFIX) -> Proc:
    """Start `argv` (with `env` as it is) in its own process group, to die with the thread
    that starts it; its output is relayed line by line to `out` (default: this process's
    stdout) except its first ready line, which marks it ready (`Proc.ready`), as `spawn`'s
    log does. For a supervisor whose children's output is its own (the frontend's
    `--processes`)."""
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=None, stdin=subprocess.DEVNULL,
                             env=env, start_new_session=True, preexec_fn=die_when_parent_dies)
    proc = Proc(name, popen, None)

    def relay() -> None:
        sink = out if out is not None else sys.stdout.buffer
        waiting = True
        for line in popen.stdout:  # type: ignore[union-attr]
            if waiting and proc.saw(line.decode(errors="replace"), ready_marker):
                waiting = False
                continue
            sink.write(line)
            sink.flush()

    threading.Thread(target=relay, name=f"relay-{name}", daemon=True).start()
    return proc


@contextlib.contextmanager
def preload_server(run_dir: Path) -> Iterator[str]:
    """A preload server (rlfleet.runtime.preload) for this process: it dies with the thread
    that starts it and is stopped on exit. Yields its socket's path at once; `spawn` forks
    from it once the socket answers (the server imports for ~15 CPU-s first), and starts
    processes as usual until then. Its output, what it refused and each child's CPU, is
    <run_dir>/preload.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = str(run_dir / "preload.sock")
    with open(run_dir / "preload.log", "wb") as out:
        popen = subprocess.Popen([sys.executable, "-m", "rlfleet.runtime.preload", path],
                                 stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=engine_env(), start_new_session=True,
                                 preexec_fn=die_when_parent_dies)
    try:
        yield path
    finally:
        popen.kill()
        popen.wait(10)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a process that takes its port on its command line)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------ `rlfleet up`: a fleet spec


WORKER_MODULES = {"vllm": "rlfleet.vllm", "mocker": "rlfleet.mocker"}


def to_flags(args: dict[str, Any] | list[str] | None) -> list[str]:
    """YAML arguments → command-line flags: `{"tensor-parallel-size": 2, "enable-rl": true,
    "allowed-weights-root": [a, b]}` → `--tensor-parallel-size 2 --enable-rl
    --allowed-weights-root a --allowed-weights-root b`; false and null are left out. A list
    is taken as flags already."""
    if args is None:
        return []
    if isinstance(args, list):
        return [str(a) for a in args]
    if not isinstance(args, dict):
        raise ValueError(f"arguments must be a mapping of flag: value, not {args!r}")
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + str(key).removeprefix("--").replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            for v in value:
                out += [flag, str(v)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _flag_value(flags: list[str], *names: str) -> str | None:
    value = None
    for i, f in enumerate(flags):
        for n in names:
            if f == n and i + 1 < len(flags):
                value = flags[i + 1]
            elif f.startswith(n + "="):
                value = f.split("=", 1)[1]
    return value


@dataclass
class Member:
    """One process of a fleet: the frontend or a worker."""

    name: str  # frontend | worker-<i>
    module: str  # python -m <module>
    args: list[str]
    gpus: int = 0  # GPUs it holds (a worker: tensor × pipeline parallel size)
    cpus: float = 1.0
    env: dict[str, str] = field(default_factory=dict)  # beside this process's environment
    pin_cores: bool = False  # a single-rank vLLM worker: given its share of a CPU host's cores

    @property
    def is_worker(self) -> bool:
        return self.name.startswith("worker-")


#: what `rlfleet up` sets on the fleet control service itself (`control:` may not)
CONTROL_SET_BY_UP = ("rl-url", "admin-token", "admin-token-file")
CONTROL_DEFAULT_PORT = 8002  # `rlfleet control`'s


def control_member(cfg: Any, admin_token: str | None) -> tuple[Member, str]:
    """The fleet control service `rlfleet up` starts for a fleet config's `control:` (true,
    or a mapping of `rlfleet control` flags: port, host, journal, on-failure, ...), and the
    URL every frontend process forwards control calls to. Port 0 is settled to a free port
    here (the frontend is told it before the service starts); its `--rl-url` is added when
    the frontend is ready; the admin token goes in its environment, never its command line."""
    if cfg is True:
        cfg = {}
    if not isinstance(cfg, dict):
        raise ValueError(f"fleet config: control is true or a mapping of `rlfleet control` "
                         f"flags (port, host, journal, ...), not {cfg!r}")
    keys = {str(k).removeprefix("--").replace("_", "-") for k in cfg}
    if taken := sorted(keys & set(CONTROL_SET_BY_UP)):
        raise ValueError(f"fleet config: control: {taken} are set by `rlfleet up` (the RL "
                         "listener is the frontend's; the admin token comes from "
                         "--admin-token-file or $RLFLEET_ADMIN_TOKEN)")
    flags = to_flags(cfg)
    host = _flag_value(flags, "--host") or "127.0.0.1"
    port = _flag_value(flags, "--port") or str(CONTROL_DEFAULT_PORT)
    try:
        port_no = int(port)
    except ValueError:
        raise ValueError(f"fleet config: control: port must be a number, not {port!r}") from None
    reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if port_no == 0:  # the frontend needs the service's URL before it starts
        port_no = free_port(reach)
    env = {"RLFLEET_ADMIN_TOKEN": admin_token} if admin_token else {}
    member = Member("control", "rlfleet.cli", ["control", *flags, "--port", str(port_no)],
                    cpus=0.5, env=env)
    return member, f"http://{reach}:{port_no}"


@dataclass
class FleetSpec:
    """What `rlfleet up` starts: a frontend and its workers, sharing one discovery store."""

    frontend: Member
    workers: list[Member]
    discovery: str
    namespace: str = "dynamo"
    control: Member | None = None  # the fleet control service (config `control:`)
    control_url: str | None = None  # where every frontend process forwards control calls

    @classmethod
    def load(cls, config: dict[str, Any] | None = None, *, state_dir: Path,
             discovery: str | None = None, kind: str | None = None, count: int | None = None,
             worker_args: list[str] | None = None,
             admin_token_file: str | None = None,
             frontend_processes: int | None = None) -> FleetSpec:
        """From a fleet.yaml mapping (see the README), with the command line's overrides.
        `admin_token_file`: every member reads the fleet's admin token from it (checked
        here: readable and not empty; never on a command line). `frontend_processes`: the
        frontend serves its port from this many processes (its `--processes`)."""
        cfg = dict(config or {})
        unknown = set(cfg) - {"discovery", "namespace", "frontend", "workers", "control"}
        if unknown:
            raise ValueError(f"fleet config: unknown keys {sorted(unknown)} (use discovery, "
                             "namespace, frontend, workers, control)")
        disc = (discovery or cfg.get("discovery") or default_discovery_url()
                or (Path(state_dir).absolute() / "discovery").as_uri())
        namespace = str(cfg.get("namespace") or os.environ.get("DYN_NAMESPACE", "dynamo"))
        common = ["--discovery", disc, "--namespace", namespace]
        token = None
        if admin_token_file:
            path = str(Path(admin_token_file).absolute())
            settled = argparse.Namespace(admin_token=None, admin_token_file=path)
            settle_admin_token(settled)
            token = settled.admin_token
            common += ["--admin-token-file", path]
        fe = to_flags(cfg.get("frontend"))
        control, control_url = None, None
        if cfg.get("control") not in (None, False):
            if _flag_value(fe, "--fleet-control") is not None:
                raise ValueError("fleet config: frontend: fleet-control is set by `control:` "
                                 "(leave it out, or leave out control: to name a service "
                                 "started elsewhere)")
            control, control_url = control_member(cfg["control"], token)
            fe += ["--enable-rl", "--fleet-control", control_url]  # the service needs the RL listener
        if frontend_processes is not None:
            if frontend_processes < 1:
                raise ValueError(f"--processes must be at least 1, got {frontend_processes}")
            fe += ["--processes", str(frontend_processes)]  # the last one wins
        frontend = Member("frontend", "rlfleet.frontend", [*common, *fe], cpus=0.5)
        groups = cfg.get("workers") or [{}]
        if not isinstance(groups, list):
            raise ValueError("fleet config: workers must be a list of worker groups")
        if kind or count is not None or worker_args:
            if len(groups) > 1:
                raise ValueError("--kind/--workers/worker flags apply to a single worker group")
            g = dict(groups[0])
            g["kind"] = kind or g.get("kind")
            g["count"] = count if count is not None else g.get("count")
            g["args"] = to_flags(g.get("args")) + list(worker_args or [])
            groups = [g]
        workers: list[Member] = []
        for g in groups:
            if not isinstance(g, dict):
                raise ValueError(f"fleet config: a worker group is a mapping, not {g!r}")
            k = g.get("kind") or "vllm"
            if k not in WORKER_MODULES:
                raise ValueError(f"fleet config: worker kind {k!r}; use one of {sorted(WORKER_MODULES)}")
            n = int(g.get("count", 1) if g.get("count") is not None else 1)
            flags = to_flags(g.get("args"))
            if k == "vllm" and _flag_value(flags, "--model") is None:
                raise ValueError("a vllm worker needs --model (args: {model: ...})")
            tp = int(_flag_value(flags, "--tensor-parallel-size", "-tp") or 1)
            pp = int(_flag_value(flags, "--pipeline-parallel-size", "-pp") or 1)
            gpus = int(g.get("gpus", tp * pp if k == "vllm" and _gpu_engine() else 0))
            pin = g.get("pin_cores", True)
            if not isinstance(pin, bool):
                raise ValueError(f"fleet config: pin_cores is true or false, not {pin!r}")
            for _ in range(n):
                workers.append(Member(f"worker-{len(workers)}", WORKER_MODULES[k],
                                      [*common, *flags], gpus=gpus,
                                      cpus=float(g.get("cpus", 1.0)),
                                      pin_cores=pin and k == "vllm" and tp * pp == 1))
        return cls(frontend, workers, disc, namespace, control, control_url)


def pin_cores(workers: list[Member]) -> None:
    """Each single-rank vLLM worker started on this host its share of the cores
    (`worker_cores`; `pin_cores: false` in its group leaves it out): `up_local`'s, not Ray's
    (each actor's node is its own)."""
    pinned = [m for m in workers if m.pin_cores]
    for m, share in zip(pinned, worker_cores(len(pinned)), strict=True):
        if share is not None:
            m.env.update(pinned_env(share))


def worker_cores(count: int) -> list[str | None]:
    """The CPU_BIND list of each of `count` single-rank vLLM workers started on this host:
    on a CPU engine their shares of its cores (`cpu_shares`); None for each on a GPU engine,
    or where the environment names the cores already."""
    if _gpu_engine() or engine_env().get(CPU_BIND, "nobind") not in ("auto", "nobind"):
        return [None] * count
    return list(cpu_shares(count))


def _gpu_engine() -> bool:
    """Whether workers hold GPUs: the engine set up for this venv (RLFLEET_ENGINE)."""
    return engine_env().get("RLFLEET_ENGINE", "gpu") != "cpu"


def default_state_dir() -> Path:
    base = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state"))
    return Path(os.environ.get("RLFLEET_STATE", base / "rlfleet" / "fleet"))


def write_state(state_dir: Path, state: dict[str, Any]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / ".fleet.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, state_dir / "fleet.json")


def read_state(state_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((state_dir / "fleet.json").read_text())
    except FileNotFoundError:
        return None


def up_local(spec: FleetSpec, state_dir: Path, timeout: float = 600) -> dict[str, Any]:
    """Start the fleet as local processes that outlive this call; stop them all if any
    fails to start."""
    if (old := read_state(state_dir)) is not None:
        raise ValueError(f"a fleet is already up from {state_dir} ({old['mode']}): "
                         "`rlfleet down` first")
    procs: list[tuple[Member, Proc]] = []
    pin_cores(spec.workers)

    def start(m: Member, *extra: str) -> None:
        argv = [sys.executable, "-m", m.module, *m.args, *extra]
        procs.append((m, spawn(m.name, argv, state_dir / "logs",
                               env={**os.environ, **m.env} if m.env else None)))

    try:
        for m in [spec.frontend, *spec.workers]:
            start(m)
        members = []

        def wait(m: Member, p: Proc) -> dict[str, str]:
            ready = p.wait_ready(timeout)
            members.append({"name": m.name, "pid": p.pid, "ready": ready,
                            "log": str(p.log_path)})
            return ready

        for m, p in list(procs):
            wait(m, p)
        if spec.control is not None:
            # started once the RL listener answers and the workers are up: at start the
            # service recovers the fleet's unfinished transactions from its journal
            rl_url = members[0]["ready"].get("rl_url")
            if not rl_url:
                raise RuntimeError("the frontend named no RL listener (rl_url) in its ready "
                                   f"line; the fleet control service needs it: {members[0]}")
            start(spec.control, "--rl-url", rl_url)
            wait(*procs[-1])
    except BaseException:
        for _, p in reversed(procs):
            p.stop()
        raise
    state = {"mode": "local", "discovery": spec.discovery, "namespace": spec.namespace,
             "members": members}
    write_state(state_dir, state)
    return state


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def status_local(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**m, "alive": _alive(m["pid"])} for m in state["members"]]


def down_local(state: dict[str, Any], timeout: float = 15.0) -> None:
    """SIGTERM every member's process group (workers first), SIGKILL what is left."""
    members = list(reversed(state["members"]))
    for m in members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(m["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for m in members:
        while _alive(m["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(m["pid"], signal.SIGKILL)
