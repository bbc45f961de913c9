"""A pytest plugin for running the unit tests on an interpreter that has no engine
(`scripts/test-python.sh`: Python 3.12 and 3.13, where vLLM's CPU build and the CPU build of
torch it pins have no wheels here): a test module whose import, or a test whose run, fails
only because `vllm` or `torch` cannot be imported is reported as skipped, with that reason;
every other outcome stands. Used with `--noconftest` (tests/conftest.py imports the engine's
fixtures): `python -m pytest --noconftest -p tests.engine_free tests/unit`."""

from __future__ import annotations

import pytest

#: the packages scripts/setup.sh installs with the engine
ENGINE_PACKAGES = ("vllm", "torch")


def _engine_missing(error: BaseException | None) -> str | None:
    """The engine package `error` says is missing, or None."""
    while error is not None:
        if isinstance(error, ModuleNotFoundError) and \
                (error.name or "").split(".")[0] in ENGINE_PACKAGES:
            return error.name
        error = error.__cause__ or error.__context__
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    if report.failed and isinstance(collector, pytest.Module):
        text = str(report.longrepr)
        missing = next((m for m in ENGINE_PACKAGES if f"No module named '{m}" in text), None)
        if missing is not None:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), 0, f"Skipped: imports {missing} (the engine)")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    missing = _engine_missing(call.excinfo.value) if call.excinfo is not None else None
    if report.failed and missing is not None:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           f"Skipped: needs {missing} (the engine)")
    return report
