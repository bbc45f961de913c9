"""ModelExpress's own code (`modelexpress` 0.7.0 from PyPI), the independent reader and writer
of the weight-artifact tests. scripts/setup.sh installs it with --no-deps into
<venv>/modelexpress-reader, outside site-packages: its vLLM plugin entry point must not be
found by vLLM (in workers, or in a test process that runs an engine). So the directory is on
sys.path only while ModelExpress modules are imported: `with on_path(): import ...`; the
modules imported stay usable afterwards."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

READER_DIR = Path(sys.prefix) / "modelexpress-reader"


@contextlib.contextmanager
def on_path() -> Iterator[None]:
    if not (READER_DIR / "modelexpress_rl").is_dir():
        raise RuntimeError(f"ModelExpress is not installed in {READER_DIR}: run scripts/setup.sh "
                           "(pip install --no-deps --target <venv>/modelexpress-reader "
                           "modelexpress==0.7.0)")
    sys.path.append(str(READER_DIR))
    try:
        yield
    finally:
        sys.path.remove(str(READER_DIR))


with on_path():
    from modelexpress_rl.utils import (
        Adler32Checksum,
        compress_delta,
        compute_delta,
        read_safetensors_header,
    )

__all__ = ["Adler32Checksum", "compress_delta", "compute_delta", "on_path",
           "read_safetensors_header"]
