"""scripts/setup.sh checks the interpreter before pip runs: on a Python the engine has no
wheels for, it stops with one line saying which versions work and why, and makes nothing."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).parents[2] / "scripts" / "setup.sh"


def supported(engine: str) -> list[str]:
    [found] = re.findall(rf'^{engine.upper()}_PYTHONS="([^"]*)"', SETUP.read_text(), re.M)
    return found.split()


@pytest.mark.parametrize(("python", "engine"), [("python3.10", "cpu"), ("python3.12", "cpu"),
                                                ("python3.13", "cpu"), ("python3.9", "gpu")])
def test_an_interpreter_the_engine_has_no_wheels_for_stops_before_pip(
        tmp_path: Path, python: str, engine: str) -> None:
    """By the interpreter's name (a pyenv shim that cannot run counts so too): one line, no
    venv made."""
    venv = tmp_path / "venv"
    out = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": python, "VENV": str(venv),
                              "RLFLEET_ENGINE": engine})
    assert out.returncode == 2 and not venv.exists()
    [line] = out.stderr.splitlines()
    v = python.removeprefix("python")
    assert line.startswith(f"setup: Python {v} cannot install the {engine} engine")
    assert f"PYTHON=python{supported(engine)[0]} make setup" in line
