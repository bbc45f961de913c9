"""Every rlfleet command in the README, and every key of its fleet/worker YAML examples, is
checked against the real `--help` of the program it runs: a flag the code does not have
fails here, not in a user's first hour."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

README = Path(__file__).resolve().parents[2] / "README.md"
PROGRAMS = {"rlfleet.frontend", "rlfleet.vllm", "rlfleet.mocker"}
SEPARATORS = {"&&", "||", ";", "|", "&"}


@functools.cache
def help_text(program: str, sub: str | None = None) -> str:
    """`python -m <program> [sub] --help`, as a user would run it."""
    module = "rlfleet.cli" if program == "rlfleet" else program
    argv = [sys.executable, "-m", module, *([sub] if sub else []), "--help"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(argv)}: {r.stderr[-2000:]}"
    return r.stdout


def has_flag(text: str, flag: str) -> bool:
    return re.search(rf"(^|[\s,\[]){re.escape(flag)}([\s,=\]]|$)", text, re.M) is not None


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def commands() -> list[tuple[str, str | None, list[str]]]:
    """(program, subcommand, tokens after it) for each rlfleet command in bash blocks."""
    found = []
    for block in blocks("bash"):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending += line + "\n"
            try:
                tokens = shlex.split(pending, comments=True)
            except ValueError:  # a quotation that goes on over the next line
                continue
            pending = ""
            cmd: list[str] = []
            for tok in [*tokens, "&&"]:
                if tok in SEPARATORS:
                    if cmd:
                        found += _program(cmd)
                    cmd = []
                else:
                    cmd.append(tok)
    return found


def _program(cmd: list[str]) -> list[tuple[str, str | None, list[str]]]:
    while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", cmd[0]):  # VAR=value prefixes
        cmd = cmd[1:]
    if len(cmd) >= 3 and cmd[0].startswith("python") and cmd[1] == "-m" and cmd[2] in PROGRAMS:
        return [(cmd[2], None, cmd[3:])]
    if cmd and cmd[0] == "rlfleet" and len(cmd) > 1:
        return [("rlfleet", cmd[1], cmd[2:])]
    return []


def flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--") and t != "--"]


CMDS = commands()


def test_the_readme_names_the_commands_it_should() -> None:
    named = {(p, s) for p, s, _ in CMDS}
    assert {("rlfleet.frontend", None), ("rlfleet.vllm", None), ("rlfleet", "up"),
            ("rlfleet", "status"), ("rlfleet", "down"), ("rlfleet", "refresh")} <= named


@pytest.mark.parametrize("program, sub, tokens", CMDS,
                         ids=[f"{p} {s or ''} {' '.join(t)[:40]}" for p, s, t in CMDS])
def test_every_flag_exists(program: str, sub: str | None, tokens: list[str]) -> None:
    if program == "rlfleet" and sub == "up" and "--" in tokens:  # worker flags after `--`
        tokens, worker = tokens[:tokens.index("--")], tokens[tokens.index("--") + 1:]
        kind = tokens[tokens.index("--kind") + 1] if "--kind" in tokens else "vllm"
        missing = [f for f in flags(worker) if not has_flag(help_text(f"rlfleet.{kind}"), f)]
        assert not missing, f"worker flags not in python -m rlfleet.{kind} --help: {missing}"
    text = help_text(program, sub)
    missing = [f for f in flags(tokens) if not has_flag(text, f)]
    assert not missing, f"not in `{program} {sub or ''} --help`: {missing}"


def _yaml_examples() -> list[dict]:
    return [d for d in (yaml.safe_load(b) for b in blocks("yaml")) if isinstance(d, dict)]


def test_yaml_examples_use_real_flags() -> None:
    examples = _yaml_examples()
    fleets = [d for d in examples if "workers" in d]
    workers = [d for d in examples if "workers" not in d]
    assert fleets and workers, "the README shows a fleet.yaml and a worker --config YAML"
    for w in workers:  # python -m rlfleet.vllm --config: keys are its flags
        missing = [k for k in w if not has_flag(help_text("rlfleet.vllm"), f"--{k}")]
        assert not missing, f"worker YAML keys that are not flags: {missing}"
    for fleet in fleets:
        assert set(fleet) <= {"discovery", "namespace", "frontend", "workers"}
        missing = [k for k in fleet.get("frontend", {})
                   if not has_flag(help_text("rlfleet.frontend"), f"--{k}")]
        assert not missing, f"frontend keys that are not flags: {missing}"
        for group in fleet["workers"]:
            program = f"rlfleet.{group.get('kind', 'vllm')}"
            missing = [k for k in group.get("args", {}) if not has_flag(help_text(program), f"--{k}")]
            assert not missing, f"{program} keys that are not flags: {missing}"


def test_the_check_catches_a_wrong_flag() -> None:
    """The checker itself: a flag that does not exist is reported."""
    assert not has_flag(help_text("rlfleet.frontend"), "--no-such-flag")
    assert has_flag(help_text("rlfleet.frontend"), "--http-host")
