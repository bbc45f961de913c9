"""The servers' programs the test harness runs (etcd, SeaweedFS's weed): the one the set-up
installed next to the running interpreter (the venv), else the one on PATH."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def venv_binary(name: str, install: str) -> str:
    """The path of program `name`; RuntimeError saying how to `install` it where there is
    none."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} binary not found ({install})")
    return found
