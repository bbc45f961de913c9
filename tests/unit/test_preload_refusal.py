"""The fork server (rlfleet.runtime.preload): what it refuses to fork, by name (a process
whose start would differ from an exec'd one's). tests/integration/test_preload_server.py runs one."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from rlfleet.runtime import preload

PY = sys.executable
BASE = {"LD_PRELOAD": "libx.so", "OMP_NUM_THREADS": "1", "RLFLEET_LOAD_TIMEOUT": "600",
        "PATH": "/bin"}
# the server's, before it imported vLLM: what a worker sets by default before importing it
SERVER = {**BASE, "VLLM_LOGGING_LEVEL": "WARNING"}


# what importing torch set in the server's environment
IMPORTED = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"}


def ask(argv, namespaces=None, **env) -> str | None:
    return preload.refusal({"argv": argv, "env": {**BASE, **env}, "cwd": "/", "log": "x",
                            "namespaces": namespaces or preload.namespaces()}, SERVER, IMPORTED)


def test_what_is_forked_and_what_is_refused_by_name():
    assert ask([PY, "-m", "rlfleet.mocker", "--port", "0"]) is None
    assert ask([PY, "-m", "rlfleet.frontend"], PATH="/usr/bin", DYN_X="1") is None  # read later
    assert ask([PY, "-m", "rlfleet.cli", "control", "--port", "0"]) is None
    assert "one of rlfleet.vllm" in ask([PY, "-m", "rlfleet.demo"])
    assert "one of rlfleet.vllm" in ask(["/usr/bin/python3", "-m", "rlfleet.mocker"])
    assert "one of rlfleet.vllm" in ask([PY, "-c", "print(1)"])
    # named with both values: what the caller has, what the server has
    assert "OMP_NUM_THREADS ('2', the server's '1')" in ask([PY, "-m", "rlfleet.mocker"],
                                                             OMP_NUM_THREADS="2")
    assert "RLFLEET_LOAD_TIMEOUT" in ask([PY, "-m", "rlfleet.vllm"], RLFLEET_LOAD_TIMEOUT="9")
    assert ask([PY, "-m", "rlfleet.vllm"], RLFLEET_ADMIN_TOKEN="t") is None  # read later
    # set by vLLM's CPU platform at an engine's start, in a process that ran one
    assert ask([PY, "-m", "rlfleet.vllm"], TORCHINDUCTOR_CPP_DYNAMIC_THREADS="1") is None
    assert ask([PY, "-m", "rlfleet.mocker"], PYTHONBREAKPOINT="ray.util.rpdb.set_trace") is None
    assert "PYTHONHASHSEED" in ask([PY, "-m", "rlfleet.mocker"], PYTHONHASHSEED="1")
    assert "KMP_BLOCKTIME" in ask([PY, "-m", "rlfleet.vllm"], KMP_BLOCKTIME="0")
    # a variable the imports set: the same value (a client that imported torch too) is theirs
    assert ask([PY, "-m", "rlfleet.vllm"], TORCHINDUCTOR_CACHE_DIR="/tmp/inductor") is None
    assert "TORCHINDUCTOR_CACHE_DIR" in ask([PY, "-m", "rlfleet.vllm"],
                                            TORCHINDUCTOR_CACHE_DIR="/elsewhere")
    # vLLM's logging is decided before vLLM is imported: the level the arguments ask for
    assert ask([PY, "-m", "rlfleet.vllm", "--model", "m"]) is None
    assert "VLLM_LOGGING_LEVEL ('DEBUG', the server's 'WARNING')" in ask(
        [PY, "-m", "rlfleet.vllm", "--log-level", "debug"])
    # a library the client imported set it (TRL: ERROR): its workers would log otherwise
    assert "VLLM_LOGGING_LEVEL ('ERROR'" in ask([PY, "-m", "rlfleet.vllm"],
                                                VLLM_LOGGING_LEVEL="ERROR")
    assert "json" in ask([PY, "-m", "rlfleet.vllm", "--log-format", "json"])
    # a thread inside another network namespace (a test's host) starts its process there
    there = {**preload.namespaces(), "net": "net:[1]"}
    assert "namespaces: net" in ask([PY, "-m", "rlfleet.mocker"], namespaces=there)
    # the mocker and the frontend do not log through vLLM: its settings are not theirs
    assert ask([PY, "-m", "rlfleet.mocker", "--log-format", "json"]) is None
    assert ask([PY, "-m", "rlfleet.frontend"], VLLM_CONFIGURE_LOGGING="0") is None


def test_every_rlfleet_variable_read_at_import_is_listed():
    """A module-level constant read from an RLFLEET_ variable is decided at import: the
    server must refuse a process whose value differs."""
    found = set()
    for path in (Path(preload.__file__).parents[1]).rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                for sub in ast.walk(node):  # os.environ.get("RLFLEET_…"), os.getenv(…)
                    if (isinstance(sub, ast.Call) and sub.args
                            and ast.unparse(sub.func) in ("os.environ.get", "os.getenv")
                            and isinstance(sub.args[0], ast.Constant)
                            and str(sub.args[0].value).startswith("RLFLEET_")):
                        found.add(sub.args[0].value)
    assert found and found <= set(preload.IMPORT_TIME), found - set(preload.IMPORT_TIME)
