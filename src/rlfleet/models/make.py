"""Write deterministic random Qwen3-architecture checkpoints for offline tests.

The state dict is generated directly (no transformers model is instantiated) and
streamed into a single `model.safetensors`, chunk by chunk, so the 0.6B geometry
needs little memory.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from rlfleet.models.tokenizer import ENDOFTEXT_ID, IM_END_ID, VOCAB_SIZE, tokenizer_files

INIT_STD = 0.02
#: Elements generated per random draw (fixed: the values depend on it).
_CHUNK_ELEMENTS = 1 << 22

_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "F32"),
    "bfloat16": (torch.bfloat16, "BF16"),
}


@dataclass(frozen=True)
class Geometry:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True


SIZES: dict[str, Geometry] = {
    # vLLM's CPU attention supports head sizes 32, 64, 80, ... (16 fails at run time).
    "tiny": Geometry(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, intermediate_size=128),
    # Qwen3-0.6B geometry.
    "small": Geometry(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, intermediate_size=3072),
    # Qwen3-1.7B geometry.
    "medium": Geometry(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=6144),
}


def _geometry(size: str) -> Geometry:
    try:
        return SIZES[size]
    except KeyError:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}") from None


#: Architectures make_model writes: dense Qwen3, or Qwen3-MoE (every layer's MLP a
#: mixture of MOE_EXPERTS experts, MOE_TOP_K routed per token, of MOE_INTERMEDIATE each).
ARCHES = ("qwen3", "qwen3-moe")
MOE_EXPERTS, MOE_TOP_K, MOE_INTERMEDIATE = 8, 2, 64


def _arch(arch: str) -> str:
    if arch not in ARCHES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {list(ARCHES)}")
    return arch


def _moe_config() -> dict[str, Any]:
    """The Qwen3-MoE fields of config.json (every layer sparse)."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
            "moe_intermediate_size": MOE_INTERMEDIATE, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "norm_topk_prob": True, "output_router_logits": False,
            "router_aux_loss_coef": 0.001}


def _dtype(dtype: str) -> tuple[torch.dtype, str]:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}") from None


def model_config(size: str = "tiny", dtype: str = "float32", arch: str = "qwen3"
                 ) -> dict[str, Any]:
    """Contents of `config.json` for a Qwen3ForCausalLM (or Qwen3MoeForCausalLM) of the
    given size."""
    g = _geometry(size)
    _dtype(dtype)
    moe = _moe_config() if _arch(arch) == "qwen3-moe" else {}
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "head_dim": g.head_dim,
        "hidden_act": "silu",
        "hidden_size": g.hidden_size,
        "initializer_range": INIT_STD,
        "intermediate_size": g.intermediate_size,
        "max_position_embeddings": g.max_position_embeddings,
        "max_window_layers": g.num_hidden_layers,
        "num_attention_heads": g.num_attention_heads,
        "num_hidden_layers": g.num_hidden_layers,
        "num_key_value_heads": g.num_key_value_heads,
        "rms_norm_eps": g.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": g.rope_theta,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": g.tie_word_embeddings,
        "torch_dtype": dtype,
        "dtype": dtype,
        "transformers_version": "4.51.0",  # Qwen3-era config format (legacy rope_theta)
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
        **moe,
    }


def generation_config() -> dict[str, Any]:
    """Contents of `generation_config.json`: token IDs only, no sampling defaults."""
    return {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": IM_END_ID, "pad_token_id": ENDOFTEXT_ID}


def _moe_shapes(p: str, h: int) -> dict[str, tuple[int, ...]]:
    """One sparse layer's MLP: the router (`mlp.gate`) and each expert's projections."""
    shapes: dict[str, tuple[int, ...]] = {p + "mlp.gate.weight": (MOE_EXPERTS, h)}
    for j in range(MOE_EXPERTS):
        e = f"{p}mlp.experts.{j}."
        shapes.update({e + "gate_proj.weight": (MOE_INTERMEDIATE, h),
                       e + "up_proj.weight": (MOE_INTERMEDIATE, h),
                       e + "down_proj.weight": (h, MOE_INTERMEDIATE)})
    return shapes


def parameter_shapes(size: str = "tiny", arch: str = "qwen3") -> dict[str, tuple[int, ...]]:
    """Qwen3ForCausalLM (or Qwen3MoeForCausalLM) parameter name -> shape (no
    `lm_head.weight` when tied)."""
    g = _geometry(size)
    moe = _arch(arch) == "qwen3-moe"
    h, hd, inter = g.hidden_size, g.head_dim, g.intermediate_size
    q, kv = g.num_attention_heads * hd, g.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB_SIZE, h)}
    for i in range(g.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
            }
        )
        shapes.update(_moe_shapes(p, h) if moe else {
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)})
    shapes["model.norm.weight"] = (h,)
    if not g.tie_word_embeddings:
        shapes["lm_head.weight"] = (VOCAB_SIZE, h)
    return shapes


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _tensor_chunks(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> Iterator[torch.Tensor]:
    """The tensor's values, in row-major order, as flat chunks."""
    numel = 1
    for d in shape:
        numel *= d
    if _is_norm(name):
        yield torch.ones(numel, dtype=dtype)
        return
    for start in range(0, numel, _CHUNK_ELEMENTS):
        n = min(_CHUNK_ELEMENTS, numel - start)
        chunk = torch.empty(n, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)
        yield chunk.to(dtype)


def _write_safetensors(
    f: BinaryIO, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, st_dtype: str, seed: int
) -> None:
    """Stream a safetensors file: header first, then each tensor's bytes in name order."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    names = sorted(shapes)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        numel = 1
        for d in shapes[name]:
            numel *= d
        header[name] = {
            "dtype": st_dtype,
            "shape": list(shapes[name]),
            "data_offsets": [offset, offset + numel * itemsize],
        }
        offset += numel * itemsize
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    gen = torch.Generator().manual_seed(seed)
    for name in names:
        chunks = _tensor_chunks(name, shapes[name], dtype, gen)
        f.writelines(memoryview(chunk.view(torch.uint8).numpy()) for chunk in chunks)


def _replace(out: Path, name: str, write: Callable[[BinaryIO], object]) -> None:
    """Write `out/name` through a temporary file and an atomic rename."""
    tmp = out / f".{name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, out / name)
    finally:
        tmp.unlink(missing_ok=True)


def _json_bytes(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def make_model(out: Path, size: str = "tiny", seed: int = 0, dtype: str = "float32",
               arch: str = "qwen3") -> Path:
    """Write a random Qwen3ForCausalLM checkpoint (HF format) into `out`; return `out`
    (arch "qwen3-moe": a Qwen3MoeForCausalLM of the same size, see MOE_EXPERTS).

    The same (size, seed, dtype) always gives byte-identical files; the tokenizer
    files do not depend on the seed. Existing files of the same names are replaced;
    other `*.safetensors` files and a shard index in `out` are removed so that the
    directory holds exactly this checkpoint.
    """
    out = Path(out)
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    torch_dtype, st_dtype = _dtype(dtype)
    shapes = parameter_shapes(size, arch)
    files: dict[str, bytes] = {
        "config.json": _json_bytes(model_config(size, dtype, arch)),
        "generation_config.json": _json_bytes(generation_config()),
        **tokenizer_files(),
    }
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        if stale.name != "model.safetensors" and stale.is_file():
            stale.unlink()
    _replace(
        out,
        "model.safetensors",
        lambda f: _write_safetensors(f, shapes, torch_dtype, st_dtype, seed),
    )
    for name, data in files.items():
        _replace(out, name, lambda f, data=data: f.write(data))
    return out


#: the layers a test adapter adapts (peft's names for Qwen3's projections)
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(out: Path, size: str = "tiny", rank: int = 8, seed: int = 0,
                 dtype: str = "float32", alpha: int | None = None, std: float = 0.05) -> Path:
    """Write a random LoRA adapter for `make_model(size=size)`'s architecture into `out`, in
    peft's format (adapter_config.json, adapter_model.safetensors), every projection adapted
    at `rank`; return `out`. Both A and B are random (peft starts B at zero, which would
    change nothing), so the adapter changes the model's outputs."""
    out = Path(out)
    if rank < 1:
        raise ValueError(f"rank must be at least 1, got {rank}")
    torch_dtype, _ = _dtype(dtype)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in parameter_shapes(size).items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in ADAPTER_TARGETS:
            continue
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, shape[1], generator=gen) * std
                                              ).to(torch_dtype)
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(shape[0], rank, generator=gen) * std
                                              ).to(torch_dtype)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
              "lora_alpha": alpha if alpha is not None else 2 * rank, "lora_dropout": 0.0,
              "bias": "none", "target_modules": list(ADAPTER_TARGETS), "fan_in_fan_out": False,
              "base_model_name_or_path": f"rlfleet-{size}", "inference_mode": True,
              "modules_to_save": None, "use_rslora": False, "use_dora": False}
    out.mkdir(parents=True, exist_ok=True)
    _replace(out, "adapter_model.safetensors",
             lambda f: f.write(_safetensors_bytes(tensors)))
    _replace(out, "adapter_config.json", lambda f: f.write(_json_bytes(config)))
    return out


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata={"format": "pt"})
