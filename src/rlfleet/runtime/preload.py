"""A fork server for rlfleet's own processes: one process imports once what a worker or a
frontend imports (vLLM, torch, transformers, FastAPI, rlfleet), and each `python -m
rlfleet.<module> ...` that `spawn` starts is forked from it instead of importing all of it
again (multiprocessing's forkserver with preloaded modules, for processes that are not
multiprocessing's). A tiny vLLM worker spends ~14 of its ~25 CPU-s of start in imports; a
process that starts dozens of them (the test suite) sets `rlfleet.runtime.launch.PRELOADED`
to a server's socket (rlfleet.runtime.launch.preload_server).

A forked process is the same program with the same arguments, environment, working
directory, process group of its own and output file as an exec'd one: only what is decided
while importing comes from the server. So the server forks only where that is the same:
the same interpreter, a module it preloaded, the same namespaces (a test's network host is
not the server's), and the same values for every variable read at import (IMPORT_TIME: the
allocator, OpenMP, torch, vLLM's logging, rlfleet's own constants);
it refuses anything else by name, and `spawn` then starts the process as usual.

The protocol, one Unix-socket connection per process: the client sends one JSON line
(FIELDS: the process's `argv`, `env`, `cwd`, `log`, and what it would inherit from the
thread that starts it: `cpus`, `nofile`, `namespaces`); the server answers `{"pid": N}` (or
`{"refused": why}`) and, when the process ends, `{"code": C}` (Popen's returncode: negative
for a signal)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import random
import resource
import runpy
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

#: the modules a server forks (the processes a fleet is made of)
MODULES = ("rlfleet.vllm", "rlfleet.mocker", "rlfleet.frontend", "rlfleet.cli")
#: what the server imports: the slow imports of those modules' start-up
PRELOAD = ("rlfleet.vllm.args", "rlfleet.vllm.engine", "rlfleet.worker.admin",
           "rlfleet.worker.native_rl", "rlfleet.worker.serve", "rlfleet.mocker.__main__",
           "rlfleet.frontend.__main__", "rlfleet.cli", "rlfleet.refresh.fleet_control.service",
           "vllm.v1.engine.async_llm")
#: environment variables (by prefix) read while importing those: a process whose values
#: differ from the server's is not forked
IMPORT_TIME = ("LD_", "PYTHON", "MALLOC_CONF", "OMP_", "KMP_", "MKL_", "TORCH", "VLLM_LOGGING",
               "VLLM_CONFIGURE_LOGGING", "VLLM_TARGET_DEVICE", "VLLM_PLUGINS", "HF_",
               "HUGGINGFACE", "TRANSFORMERS_", "TOKENIZERS_", "CUDA_", "TRITON", "OTEL_", "RAY_",
               # rlfleet's own constants (tests/unit/test_preload_refusal.py finds them all)
               "RLFLEET_KEPT_WINDOW", "RLFLEET_LIVENESS_TIMEOUT", "RLFLEET_GROUP_TIMEOUT",
               "RLFLEET_SELF_CHECK_TIMEOUT", "RLFLEET_STAGE_TIMEOUT", "RLFLEET_FANOUT_CHUNK_BYTES",
               "RLFLEET_LOAD_TIMEOUT", "RLFLEET_STAGE_SERVING_SHARE", "RLFLEET_STAGE_BUILD_THREADS",
               "RLFLEET_STAGE_KEEP_PAGES")
#: ... except these, read later: breakpoint()'s hook (Ray's driver sets it), and what a
#: worker's own engine start sets (vLLM's CPU platform): a process that started an engine or
#: a Ray driver in-process passes them on, and a fresh worker, like the server, imported
#: without them
LATER = ("PYTHONBREAKPOINT", "TORCHINDUCTOR_CPP_DYNAMIC_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")
#: the namespaces a child inherits from the thread that starts it: a thread inside another
#: network namespace (a test's host, rlfleet.testing.netns) is not the server's
NAMESPACES = ("net", "mnt", "uts", "ipc", "pid", "user", "cgroup")
CONNECT_TIMEOUT = 5.0
#: in the server: its environment before it imported anything, and what importing set in it
#: (torch and vLLM set variables of their own, which a forked process gets as an exec'd one
#: would)
_BEFORE: dict[str, str] = {}
_SET_BY_IMPORTS: dict[str, str] = {}


# ------------------------------------------------------------------------------ the server


def refusal(request: dict, before: dict[str, str] | None = None,
            imported: dict[str, str] | None = None) -> str | None:
    """Why `request` cannot be forked from this process (None: it can): `before`, the
    server's environment before it imported anything, and `imported`, what the imports set
    in it (defaults: this server's)."""
    from rlfleet.runtime.logs import engine_logging_env, requested_format

    before = _BEFORE if before is None else before
    imported = _SET_BY_IMPORTS if imported is None else imported
    argv = request["argv"]
    other = sorted(k for k, v in request["namespaces"].items() if namespaces().get(k) != v)
    if other:
        return f"started from other namespaces: {', '.join(other)}"
    if (len(argv) < 3 or argv[1] != "-m" or argv[2] not in MODULES
            or os.path.realpath(argv[0]) != os.path.realpath(sys.executable)):
        return f"not `{sys.executable} -m` one of {', '.join(MODULES)}"
    env, keys = request["env"], tuple(k for k in IMPORT_TIME if not k.startswith("VLLM_"))
    if argv[2] == "rlfleet.vllm":  # (the others do not log through vLLM)
        if requested_format(argv[3:]) == "json":
            return "vLLM's logging in json format is decided before it is imported"
        env, keys = {**engine_logging_env(argv[3:], env), **env}, IMPORT_TIME

    def same(key: str) -> bool:  # (a value the imports set is what they would set again)
        return env.get(key) == before.get(key) or (key in imported
                                                   and env[key] == imported[key])
    differ = sorted(k for k in set(env) | set(before)
                    if k.startswith(keys) and k not in LATER and not same(k))
    if differ:
        here = {**before, **imported}
        return "variables read at import differ: " + ", ".join(
            f"{k} ({env.get(k)!r}, the server's {here.get(k)!r})" for k in differ)
    return None


def namespaces() -> dict[str, str]:
    """The calling thread's namespaces (what `readlink /proc/thread-self/ns/X` says)."""
    out = {}
    for name in NAMESPACES:
        with contextlib.suppress(OSError):
            out[name] = os.readlink(f"/proc/thread-self/ns/{name}")
    return out


def serve(path: str) -> dict | None:
    """Preload, then fork a process per request on the socket at `path`, forever. Returns
    the request in a forked child (which then runs it), never in the server."""
    from rlfleet.runtime.logs import quiet_engine_logging

    quiet_engine_logging([])  # what a worker decides before vLLM is imported, by default
    _BEFORE.update(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    _SET_BY_IMPORTS.update({k: v for k, v in os.environ.items() if _BEFORE.get(k) != v})
    gc.freeze()  # what every child shares: no collection of it touches (and copies) its pages
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd: (pid, its client)
    while True:
        for key, _ in sel.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                request = _read_request(conn)
                if request is None:  # (wait_ready's probe, or a client that went away)
                    conn.close()
                    continue
                why = refusal(request)
                if why is not None:
                    print(f"refused {' '.join(request['argv'][2:3])}: {why}", flush=True)
                    _send(conn, {"refused": why})
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    conn.close()
                    for fd, (_, other) in children.items():
                        os.close(fd)
                        other.close()
                    return request
                print(f"{pid} forked: {' '.join(request['argv'][2:])[:200]}", flush=True)
                fd = os.pidfd_open(pid)
                children[fd] = (pid, conn)
                sel.register(fd, selectors.EVENT_READ)
                _send(conn, {"pid": pid})
            else:  # a child ended
                fd = key.fd
                sel.unregister(fd)
                os.close(fd)
                pid, conn = children.pop(fd)
                _, status, usage = os.wait4(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                print(f"{pid} ended {code} after {usage.ru_utime + usage.ru_stime:.2f} CPU-s",
                      flush=True)
                _send(conn, {"code": code})
                conn.close()


FIELDS = {"argv", "env", "cwd", "log", "cpus", "nofile", "namespaces"}


def _read_request(conn: socket.socket) -> dict | None:
    conn.settimeout(CONNECT_TIMEOUT)
    data = b""
    with contextlib.suppress(OSError):
        while not data.endswith(b"\n"):
            chunk = conn.recv(1 << 16)
            if not chunk:
                return None
            data += chunk
        request = json.loads(data)
        if isinstance(request, dict) and FIELDS <= set(request):
            return request
    return None


def _send(conn: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(message).encode() + b"\n")


def become(request: dict) -> None:
    """In the forked child: the process `request` asks for, then run its module as
    `python -m` would, and exit with its code (never returns)."""
    os.setsid()
    # the CPUs of the process that asked, as an exec'd child inherits them (Intel OpenMP,
    # which the CPU engine preloads, pins a forked child to the first CPU of its mask)
    os.sched_setaffinity(0, request["cpus"])
    resource.setrlimit(resource.RLIMIT_NOFILE, tuple(request["nofile"]))
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    cwd = request["cwd"]
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in _SET_BY_IMPORTS.items():  # what its own imports would have set
        os.environ.setdefault(key, value)
    argv = request["argv"]
    sys.argv = [argv[2], *argv[3:]]
    sys.path[0] = cwd  # where `python -m` looks first
    random.seed()  # (also done at fork; numpy's and torch's are not)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    for name in (argv[2], f"{argv[2]}.__main__"):  # preloaded by name: run afresh as __main__
        if not hasattr(sys.modules.get(name), "__path__"):  # (a package stays)
            sys.modules.pop(name, None)
    code = 0
    try:
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    # what the interpreter does at exit, less finalizing every module and object: that
    # touches all the server imported, which copies the pages shared with it (~3.5 CPU-s)
    import atexit
    import logging
    threading._shutdown()  # the interpreter's: its exit hooks (executors'), then the joins
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    request = serve(sys.argv[1])
    if request is not None:
        become(request)


# ------------------------------------------------------------------------------ the client


def wait_ready(path: str, timeout: float) -> bool:
    """Whether the server at `path` accepts connections within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
                return True
            except OSError:
                time.sleep(0.5)
    return False


class Forked:
    """A process a server forked for this one, with the part of subprocess.Popen's
    interface that rlfleet.runtime.launch.Proc uses (`pid`, `args`, `returncode`, `poll`,
    `wait`)."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._ended = threading.Event()
        threading.Thread(target=self._watch, args=(conn,), name=f"forked-{pid}",
                         daemon=True).start()

    def _watch(self, conn: socket.socket) -> None:
        """The server's word of the end; if the server is gone first, the process's."""
        conn.settimeout(None)
        data = b""
        with contextlib.suppress(OSError):
            while not data.endswith(b"\n"):
                chunk = conn.recv(256)
                if not chunk:
                    break
                data += chunk
        conn.close()
        if data.endswith(b"\n"):
            self.returncode = json.loads(data)["code"]
        else:  # the server died: wait for the process itself (its code is not known)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                while True:
                    os.kill(self.pid, 0)
                    time.sleep(0.2)
            self.returncode = -1
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode


def fork(path: str, argv: list[str], env: dict[str, str], cwd: Path | None,
         log: Path) -> Forked | None:
    """`argv` forked by the server at `path`; None when the server is not there (yet) or
    refuses it (start it as usual then)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(CONNECT_TIMEOUT)
    try:
        conn.connect(path)
        request = {"argv": argv, "env": env, "cwd": str(cwd or os.getcwd()), "log": str(log),
                   "cpus": sorted(os.sched_getaffinity(0)), "namespaces": namespaces(),
                   "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)}
        conn.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(256)
            if not chunk:
                raise ConnectionError("the preload server closed the connection")
            data += chunk
    except OSError:
        conn.close()
        return None
    reply = json.loads(data)
    if "pid" not in reply:
        conn.close()
        return None
    return Forked(conn, reply["pid"], argv)


if __name__ == "__main__":
    main()
