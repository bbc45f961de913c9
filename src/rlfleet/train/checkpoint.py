"""Write the trainer's policy as an HF-format checkpoint the workers can load: one
`model.safetensors` with exactly the base checkpoint's tensor names (tied embeddings: no
`lm_head.weight`), plus the base's config and tokenizer files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlfleet.weights.digest import checkpoint_signature


def save_checkpoint(state: dict[str, torch.Tensor], base: Path, out: Path) -> Path:
    """Write `state` (a model's state_dict) into `out` as a checkpoint shaped like `base`.
    The directory appears complete or not at all (written aside, then renamed); an older
    `out` is replaced."""
    base, out = Path(base), Path(out)
    signature = checkpoint_signature(base)
    missing = sorted(signature.keys() - state.keys())
    if missing:
        raise ValueError(f"the model has no tensors named {missing[:3]} (base: {base})")
    tensors = {}
    for name, (_, shape) in signature.items():
        t = state[name].detach().to("cpu").contiguous().clone()
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"tensor {name} has shape {list(t.shape)}, the base {list(shape)}")
        tensors[name] = t
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and \
                    f.name != "model.safetensors.index.json" and not f.name.startswith("."):
                shutil.copy2(f, tmp / f.name)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
