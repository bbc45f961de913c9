#!/usr/bin/env bash
# rlfleet's own unit tests on another Python, in a venv of its own without the engine:
#   scripts/test-python.sh 3.12 3.13        (default: both)
# The engine (vLLM's CPU build and the torch 2.13.0 CPU wheel it pins) has wheels for
# Python 3.11 only (scripts/setup.sh), so a module or test that needs vllm or torch is
# reported skipped (tests/engine_free.py); everything else must pass. The venvs are kept in
# ${PYVENVS:-/tmp/rlfleet-py} and reused. An interpreter not found is said and skipped
# (PYTHON_<major><minor>=path names one: PYTHON_312=/usr/bin/python3.12); a candidate that
# does not run (a pyenv shim of a version not selected) is passed over.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${PYVENVS:-/tmp/rlfleet-py}
status=0
for v in "${@:-3.12 3.13}"; do
  for version in $v; do
    var="PYTHON_${version/./}"
    # the first candidate that runs: a pyenv shim is on PATH even where its version is not
    # selected, and then fails ("pyenv: python3.12: command not found")
    py=
    for c in ${!var:-} "$(command -v "python$version" || true)" \
        "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/python; do
      if [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import venv' >/dev/null 2>&1; then
        py=$c
        break
      fi
    done
    if [ -z "$py" ]; then
      echo "python $version: no interpreter found (set $var=PATH); skipped"
      continue
    fi
    venv="$ROOT/$version"
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    if [ ! -e "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ]; then
      "$venv/bin/python" -m pip install -q -e . pytest pytest-asyncio hypothesis
      touch "$venv/.installed"
    fi
    echo "python $version ($("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])')): unit tests without the engine"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider --noconftest -p tests.engine_free \
      tests/unit || status=1
  done
done
exit $status
