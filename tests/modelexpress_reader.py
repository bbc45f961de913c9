"""ModelExpress's own code (`modelexpress` 0.7.0 from PyPI), the independent reader and writer
of the weight-artifact tests. scripts/setup.sh installs it with --no-deps into
<venv>/modelexpress-reader, outside site-packages: its vLLM plugin entry point must not be
loaded by the workers. Import this module to put it on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

READER_DIR = Path(sys.prefix) / "modelexpress-reader"
if not (READER_DIR / "modelexpress_rl").is_dir():
    raise RuntimeError(f"ModelExpress is not installed in {READER_DIR}: run scripts/setup.sh "
                       "(pip install --no-deps --target <venv>/modelexpress-reader "
                       "modelexpress==0.7.0)")
if str(READER_DIR) not in sys.path:
    sys.path.append(str(READER_DIR))

from modelexpress_rl.utils import (  # noqa: E402
    Adler32Checksum,
    compress_delta,
    compute_delta,
    read_safetensors_header,
)

__all__ = ["Adler32Checksum", "compress_delta", "compute_delta", "read_safetensors_header"]
