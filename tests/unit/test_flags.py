"""Command-line flags declared as rows (runtime/flags.py) and the parsers built from them."""

from __future__ import annotations

import argparse

import pytest

from rlfleet.cli import build_parser
from rlfleet.frontend.__main__ import parse_args as frontend_args
from rlfleet.mocker.engine import DEFAULTS, KNOBS, add_mock_args
from rlfleet.runtime.flags import Flag, add_flags


def _parser(*flags: Flag) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_flags(p, flags)
    return p


def test_the_type_follows_the_default():
    p = _parser(Flag("--n", 3), Flag("--s", 0.5), Flag("--name", "x"), Flag("--on", False),
                Flag("--each", []), Flag("--k", None, type=int), Flag("--free", None))
    a = p.parse_args(["--n", "7", "--s", "2", "--name", "y", "--on", "--each", "a",
                      "--each", "b", "--k", "4", "--free", "z"])
    assert (a.n, a.s, a.name, a.on, a.each, a.k, a.free) == (7, 2.0, "y", True, ["a", "b"], 4, "z")
    assert isinstance(a.s, float)
    d = p.parse_args([])
    assert (d.n, d.s, d.name, d.on, d.each, d.k, d.free) == (3, 0.5, "x", False, [], None, None)
    with pytest.raises(argparse.ArgumentError, match="invalid int value"):
        p.parse_args(["--n", "1.5"])


def test_a_list_default_is_not_shared_between_parses():
    p = _parser(Flag("--each", []))
    p.parse_args(["--each", "a"])
    assert p.parse_args([]).each == []


def test_choices_required_metavar_and_the_default_in_help():
    p = _parser(Flag("--mode", "a", "pick (default %(default)s)", choices=["a", "b"]),
                Flag("--v", None, "the version", required=True, metavar="NAME"))
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        p.parse_args(["--mode", "c", "--v", "1"])
    help_text = p.format_help()
    assert "pick (default a)" in help_text and "--v NAME" in help_text
    with pytest.raises((SystemExit, argparse.ArgumentError)):  # --v missing
        p.parse_args([])


def test_dest_is_the_name_with_underscores():
    assert Flag("--kv-events-config").dest == "kv_events_config"
    assert {k.dest for k in KNOBS} <= set(DEFAULTS)


def test_the_parsers_built_from_tables_keep_their_types():
    a = frontend_args(["--stall-timeout", "1.5", "--max-connections", "9", "--enable-rl",
                       "--read-timeout", "0"])
    assert (a.stall_timeout, a.max_connections, a.enable_rl, a.read_timeout) == (1.5, 9, True, 0.0)
    r = build_parser().parse_args(["refresh", "--version", "v2", "--step", "3", "--sglang-worker",
                                   "a,b", "--sglang-worker", "c,d", "--phase-timeout", "2.5"])
    assert (r.version, r.step, r.sglang_worker, r.phase_timeout) == ("v2", 3, ["a,b", "c,d"], 2.5)
    # `rlfleet refresh` stages first (issue 41); `rlfleet recover` reloads from disk
    assert r.path == "vllm-staged" and r.probe_from_checkpoint is False
    assert build_parser().parse_args(["recover"]).path == "vllm-disk"
    m = argparse.ArgumentParser()
    add_mock_args(m)
    k = m.parse_args(["--token-delay", "0.25", "--max-batch", "2", "--routed-experts", "2x8x2"])
    assert (k.token_delay, k.max_batch, k.routed_experts, k.seed) == (0.25, 2, "2x8x2", 0)
