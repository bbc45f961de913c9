# The two commands: `make demo` and `make test`. Each does all set-up on a fresh machine.
# RLFLEET_ENGINE=gpu selects the official vllm package instead of the CPU build.
VENV ?= .venv
PY := $(VENV)/bin/python
ENVFILE := $(VENV)/rlfleet.env
RUN := set -a; . ./$(ENVFILE); set +a;
# the suite runs in this many processes (pytest-xdist), a whole module in one (its fleet starts
# once), and every module on the session vLLM fleet in one (tests/conftest.py's scheduler);
# three on two cores: while one waits (a lease, a stopped worker, a server starting), the
# others run (BENCHMARKS.md, "The test suite")
TEST_PROCESSES ?= 3

.PHONY: setup demo demo-async test test-python lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

demo: setup
	$(RUN) $(PY) -m rlfleet.cli demo

demo-async: setup
	$(RUN) $(PY) -m rlfleet.cli demo --async

test: setup
	$(RUN) $(PY) -m pytest -q -ra --durations=30 -n $(TEST_PROCESSES) --dist loadfile \
		--no-loadscope-reorder tests

# rlfleet's own unit tests on Python 3.12 and 3.13, in venvs of their own without the engine
# (which has wheels for 3.11 only): PYTHONS="3.12" make test-python for one
PYTHONS ?= 3.12 3.13
test-python:
	bash scripts/test-python.sh $(PYTHONS)

lint: setup
	$(VENV)/bin/ruff check src tests bench

bench: setup
	$(RUN) $(PY) bench/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache rlfleet-demo
