"""rlfleet.protocol holds wire structs only: every module of it imports nothing but the
standard library, its struct libraries (msgspec, pydantic) and rlfleet.protocol itself,
and reads no environment variable (codecs, hashes and switches live on the floors that
use them)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import rlfleet.protocol

PROTOCOL = Path(rlfleet.protocol.__file__).parent
ALLOWED = {"msgspec", "pydantic"}
MODULES = sorted(PROTOCOL.rglob("*.py"))


def _imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # a relative import stays inside the package
                out.append("rlfleet.protocol")
            else:
                out.append(node.module or "")
    return out


def _allowed(name: str) -> bool:
    top = name.split(".")[0]
    return (top in sys.stdlib_module_names or top in ALLOWED or name == "rlfleet.protocol"
            or name.startswith("rlfleet.protocol."))


def test_the_walk_sees_every_module() -> None:
    assert len(MODULES) > 20 and PROTOCOL / "admin.py" in MODULES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_protocol_imports_only_the_standard_library_and_its_struct_libraries(path: Path
                                                                            ) -> None:
    tree = ast.parse(path.read_text(), str(path))
    bad = [name for name in _imports(tree) if not _allowed(name)]
    assert not bad, f"rlfleet/protocol/{path.name} imports {bad}: move that code to the " \
                    "floor that uses it"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_protocol_reads_no_environment(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    reads = [f"line {n.lineno}" for n in ast.walk(tree)
             if (isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv", "environb"))
             or (isinstance(n, ast.Name) and n.id in ("environ", "getenv"))]
    assert not reads, f"rlfleet/protocol/{path.name} reads the environment at {reads}"


def test_the_check_refuses_what_it_should() -> None:
    """The rule itself: a third-party import, an import from a higher floor, an
    environment read are each caught."""
    for code in ("import numpy", "from blake3 import blake3", "from rlfleet.runtime import x"):
        assert not all(_allowed(n) for n in _imports(ast.parse(code)))
    assert all(_allowed(n) for n in _imports(ast.parse(
        "import os, re\nimport msgspec\nfrom pydantic import BaseModel\n"
        "from rlfleet.protocol.identity import PolicyIdentity")))
