"""Every rlfleet command in the README and in the guides under docs/, and every key of their
fleet/worker YAML examples, is checked against the real `--help` of the program it runs: a
flag the code does not have fails here, not in a user's first hour."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# the README first, then every guide that exists (a guide not written yet is simply not here)
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = {"rlfleet.frontend", "rlfleet.vllm", "rlfleet.mocker"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
# rlfleet commands whose subcommands have subcommands of their own (`rlfleet weights gc`)
NESTED = {"weights"}
FLEET_KEYS = {"discovery", "namespace", "frontend", "workers", "control"}


@functools.cache
def help_text(program: str, sub: str | None = None) -> str:
    """`python -m <program> [sub] --help`, as a user would run it (`sub` may name a
    subcommand of a subcommand: "weights gc")."""
    module = "rlfleet.cli" if program == "rlfleet" else program
    argv = [sys.executable, "-m", module, *(sub.split() if sub else []), "--help"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(argv)}: {r.stderr[-2000:]}"
    return r.stdout


def has_flag(text: str, flag: str) -> bool:
    return re.search(rf"(^|[\s,\[]){re.escape(flag)}([\s,=\]]|$)", text, re.M) is not None


def name(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def blocks(doc: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", doc.read_text(), re.S)


def commands(doc: Path) -> list[tuple[str, str | None, list[str]]]:
    """(program, subcommand, tokens after it) for each rlfleet command in doc's bash blocks."""
    found = []
    for block in blocks(doc, "bash"):
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
        if cmd[1] in NESTED and len(cmd) > 2 and not cmd[2].startswith("-"):
            return [("rlfleet", f"{cmd[1]} {cmd[2]}", cmd[3:])]
        return [("rlfleet", cmd[1], cmd[2:])]
    return []


def flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--") and t != "--"]


CMDS = [(name(doc), *cmd) for doc in DOCUMENTS for cmd in commands(doc)]


def test_the_readme_names_the_commands_it_should() -> None:
    named = {(p, s) for doc, p, s, _ in CMDS if doc == "README.md"}
    assert {("rlfleet.frontend", None), ("rlfleet.vllm", None), ("rlfleet", "up"),
            ("rlfleet", "status"), ("rlfleet", "down"), ("rlfleet", "refresh")} <= named


def test_the_readme_starts_with_the_two_commands() -> None:
    """`make demo` and `make test` are the first thing a newcomer runs."""
    first = blocks(README, "bash")[0].splitlines()
    assert [line.split("#")[0].strip() for line in first[:2]] == ["make demo", "make test"]


def test_no_document_points_outside_the_repository() -> None:
    outside = [f"{name(doc)}: {m}" for doc in DOCUMENTS
               for m in re.findall(r"[\w./-]*\.\./shared/[\w./-]*", doc.read_text())]
    assert not outside, outside


@pytest.mark.parametrize("doc, program, sub, tokens", CMDS,
                         ids=[f"{d}: {p} {s or ''} {' '.join(t)[:40]}" for d, p, s, t in CMDS])
def test_every_flag_exists(doc: str, program: str, sub: str | None, tokens: list[str]) -> None:
    if program == "rlfleet" and sub == "up" and "--" in tokens:  # worker flags after `--`
        tokens, worker = tokens[:tokens.index("--")], tokens[tokens.index("--") + 1:]
        kind = tokens[tokens.index("--kind") + 1] if "--kind" in tokens else "vllm"
        missing = [f for f in flags(worker) if not has_flag(help_text(f"rlfleet.{kind}"), f)]
        assert not missing, f"{doc}: worker flags not in python -m rlfleet.{kind} --help: {missing}"
    text = help_text(program, sub)
    missing = [f for f in flags(tokens) if not has_flag(text, f)]
    assert not missing, f"{doc}: not in `{program} {sub or ''} --help`: {missing}"


def _yaml_examples(doc: Path) -> list[tuple[str, dict]]:
    """(the block's text, its mapping) for each YAML block of doc that is a mapping."""
    found = []
    for block in blocks(doc, "yaml"):
        data = yaml.safe_load(block)
        if isinstance(data, dict):
            found.append((block, data))
    return found


def _check_worker(doc: str, worker: dict) -> None:  # python -m rlfleet.vllm --config: keys are its flags
    missing = [k for k in worker if not has_flag(help_text("rlfleet.vllm"), f"--{k}")]
    assert not missing, f"{doc}: worker YAML keys that are not flags: {missing}"


def _check_fleet(doc: str, fleet: dict) -> None:
    assert set(fleet) <= FLEET_KEYS, f"{doc}: fleet.yaml keys rlfleet up does not read: " \
                                     f"{sorted(set(fleet) - FLEET_KEYS)}"
    missing = [k for k in fleet.get("frontend") or {}
               if not has_flag(help_text("rlfleet.frontend"), f"--{k}")]
    assert not missing, f"{doc}: frontend keys that are not flags: {missing}"
    if isinstance(fleet.get("control"), dict):
        missing = [k for k in fleet["control"] if not has_flag(help_text("rlfleet", "control"), f"--{k}")]
        assert not missing, f"{doc}: control keys that are not `rlfleet control` flags: {missing}"
    for group in fleet["workers"]:
        program = f"rlfleet.{group.get('kind', 'vllm')}"
        missing = [k for k in group.get("args", {}) if not has_flag(help_text(program), f"--{k}")]
        assert not missing, f"{doc}: {program} keys that are not flags: {missing}"


def test_readme_yaml_examples_use_real_flags() -> None:
    examples = [data for _, data in _yaml_examples(README)]
    fleets = [d for d in examples if "workers" in d]
    workers = [d for d in examples if "workers" not in d]
    assert fleets and workers, "the README shows a fleet.yaml and a worker --config YAML"
    for w in workers:
        _check_worker("README.md", w)
    for fleet in fleets:
        _check_fleet("README.md", fleet)


@pytest.mark.parametrize("doc", DOCUMENTS[1:], ids=[name(d) for d in DOCUMENTS[1:]])
def test_guides_yaml_examples_use_real_flags(doc: Path) -> None:
    """A guide's fleet.yaml (a mapping with `workers`) and worker YAML (a block that says it
    is `rlfleet.vllm --config`'s); other YAML a guide shows is not a flag file."""
    for block, data in _yaml_examples(doc):
        if "workers" in data:
            _check_fleet(name(doc), data)
        elif "--config" in block.split("\n", 1)[0] or block.startswith("# worker"):
            _check_worker(name(doc), data)


def test_the_check_catches_a_wrong_flag() -> None:
    """The checker itself: a flag that does not exist is reported."""
    assert not has_flag(help_text("rlfleet.frontend"), "--no-such-flag")
    assert has_flag(help_text("rlfleet.frontend"), "--http-host")
    assert not _program(["rlfleet"]) and _program(["X=1", "rlfleet", "up", "--workers", "2"])
