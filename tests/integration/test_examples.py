"""The integration blocks of the README and the guides (docs/trainer.md) are the code of the
examples they point to (so running an example runs the block as written), and the generic
recipe runs against a mocker fleet (the TRL example runs in test_trl_grpo.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlfleet.runtime.launch import engine_env

ROOT = Path(__file__).resolve().parents[2]


def readme_blocks() -> list[str]:
    """Every python block of README.md and of docs/*.md."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [b for doc in docs for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)]


def example_block(example: str, name: str) -> str:
    """The part of an example between its `# --- README: <name> (begin/end) ---` markers."""
    src = (ROOT / "examples" / example).read_text()
    m = re.search(rf"# --- README: {re.escape(name)} \(begin\) ---\n(.*?)\n\s*# --- README: "
                  rf"{re.escape(name)} \(end\) ---", src, re.S)
    assert m, f"no README block {name!r} in {example}"
    return textwrap.dedent(m.group(1)).strip()


@pytest.mark.parametrize("example,name", [("trl_grpo.py", "TRL integration"),
                                          ("openai_url_recipe.py", "generic recipe"),
                                          ("trl_async_grpo.py", "TRL async")])
def test_readme_blocks_are_the_examples_code(example, name):
    assert example_block(example, name) in [b.strip() for b in readme_blocks()]


def test_the_generic_recipe_runs_against_a_mocker_fleet():
    env = engine_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_url_recipe.py"),
                          "--steps", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary == {"steps": 2, "requests": 8, "refreshes_verified": 2,
                       "policies": ["step-0", "step-1"]}
