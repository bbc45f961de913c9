"""docs/architecture.md's folder table names every module of src/rlfleet exactly once, in
the row of its room (the folder it lives in under rlfleet/), and names no module that does
not exist. A package's `__init__.py` that holds only its docstring need not be named."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import rlfleet

ROOT = Path(rlfleet.__file__).parent
DOC = Path(__file__).parents[2] / "docs" / "architecture.md"
HEADER = "| folder | owns |"


def table_rows(text: str) -> list[tuple[str, str]]:
    """(folder, owns) of each row of the folder table."""
    start = text.index(HEADER)
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0].strip("`"), cells[1]))
    return rows


def named_modules(text: str) -> list[str]:
    """Every module the table names, as a path under src/ (`rlfleet/x/y.py`)."""
    out = []
    for folder, owns in table_rows(text):
        assert re.fullmatch(r"rlfleet/([a-z_]+/)?", folder), f"not a room: {folder!r}"
        out += [folder + name for name in re.findall(r"`([\w/]+\.py)`", owns)]
    return out


def _only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def modules() -> set[str]:
    return {str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
            if not (p.name == "__init__.py" and _only_a_docstring(p))}


def room(module: str) -> str:
    parts = module.split("/")
    return "/".join(parts[:2]) + "/" if len(parts) > 2 else "rlfleet/"


def test_every_module_is_in_the_table_once_in_its_rooms_row() -> None:
    text = DOC.read_text()
    named = named_modules(text)
    twice = [m for m, n in Counter(named).items() if n > 1]
    assert not twice, f"named more than once in docs/architecture.md's folder table: {twice}"
    missing = sorted(modules() - set(named))
    assert not missing, f"missing from docs/architecture.md's folder table: {missing}"
    unknown = sorted(set(named) - {str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")})
    assert not unknown, f"docs/architecture.md's folder table names no such module: {unknown}"
    for folder, owns in table_rows(text):
        for name in re.findall(r"`([\w/]+\.py)`", owns):
            assert room(folder + name) == folder, f"{name} is listed under {folder}"


def test_the_check_catches_drift() -> None:
    """A module left out, one named twice, one that does not exist: each is found."""
    text = DOC.read_text()
    named = named_modules(text)
    assert "rlfleet/frontend/processes.py" in named
    dropped = text.replace("`processes.py` (K processes on one port)", "(K processes)")
    assert "rlfleet/frontend/processes.py" in modules() - set(named_modules(dropped))
    doubled = text.replace("`kv.py` prefix-aware", "`kv.py` and `kv.py` prefix-aware")
    assert Counter(named_modules(doubled))["rlfleet/frontend/kv.py"] == 2
    assert room("rlfleet/frontend/openai/routes.py") == "rlfleet/frontend/"
    assert room("rlfleet/cli.py") == "rlfleet/"
