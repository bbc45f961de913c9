"""A checkpoint directory named in a control call (`model_path`), resolved on this machine:
inside the allowed weights roots when any are set, with no symlink under it that leads
outside them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlfleet.protocol.admin_base import AdminRequestError


def weights_path(raw: Any, roots: list[Path]) -> Path:
    """`model_path` resolved (symlinks too), inside the allowed roots when any are set, and
    an existing directory none of whose entries (what a loader may read) leads outside them
    either, through a symlink."""
    if not isinstance(raw, str) or not raw:
        raise AdminRequestError("model_path is required (a checkpoint directory on this "
                                "worker's disk)")
    if "\0" in raw:
        raise AdminRequestError("model_path contains a null byte: send a plain directory path")
    try:
        path = Path(raw).resolve()
        inside = not roots or _within(path, roots)
        if inside and not path.is_dir():
            raise AdminRequestError(f"model_path {raw} does not exist or is not a directory")
        escapes = _escaping_links(path, roots) if inside and roots else []
    except (OSError, RuntimeError) as e:  # too long, unreadable, a symlink loop
        raise AdminRequestError(f"model_path {raw} cannot be read: {e}") from e
    if not inside:
        raise AdminRequestError(f"model_path {raw} is outside the allowed weights roots "
                                f"({', '.join(map(str, roots))})")
    if escapes:
        raise AdminRequestError(f"model_path {raw} holds symlinks that lead outside the allowed "
                                f"weights roots: {', '.join(sorted(escapes)[:5])}; copy the "
                                "files in instead")
    return path


def _within(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def _escaping_links(path: Path, roots: list[Path]) -> list[str]:
    """Symlinks anywhere under `path` whose targets are outside the roots (relative names)."""
    out = []
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = Path(top) / name
            if entry.is_symlink() and not _within(entry.resolve(), roots):
                out.append(str(entry.relative_to(path)))
    return out
