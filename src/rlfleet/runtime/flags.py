"""Command-line flags as data: a table of `Flag` rows, added to a parser by one loop.

A row says what differs between flags (name, default, help) and nothing else: the argparse
type follows from the default (an int default takes ints, a float one floats, a bool one is a
switch, a list one is given once per value), so only a flag whose default is None names its
type. Help texts may say `%(default)s`, so a default is written once."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    name: str  # "--http-port"
    default: Any = None
    help: str | None = None
    type: Callable[[str], Any] | None = None  # needed only when the default is None
    choices: Sequence[str] | None = None
    metavar: str | None = None
    required: bool = False

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def add_to(self, p: argparse.ArgumentParser) -> None:
        kw: dict[str, Any] = {"default": self.default, "help": self.help}
        if isinstance(self.default, bool):
            kw["action"] = "store_true"
        elif isinstance(self.default, list):
            kw["action"] = "append"
        elif self.type is not None or isinstance(self.default, (int, float)):
            kw["type"] = self.type or type(self.default)
        for key in ("choices", "metavar"):
            if getattr(self, key) is not None:
                kw[key] = getattr(self, key)
        if self.required:
            kw["required"] = True
        p.add_argument(self.name, **kw)


def add_flags(p: argparse.ArgumentParser, flags: Iterable[Flag]) -> None:
    for flag in flags:
        flag.add_to(p)
