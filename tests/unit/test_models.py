"""Deterministic offline test models: files, tokenizer, parameter names."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rlfleet.models import make_model
from rlfleet.models.make import model_config, parameter_shapes
from rlfleet.models.tokenizer import TOKENIZER_SIZE, VOCAB_SIZE

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
ALL_FILES = ("config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES)


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "model", size="tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny)


def test_files_written(tiny: Path) -> None:
    assert sorted(p.name for p in tiny.iterdir()) == sorted(ALL_FILES)


def test_same_seed_same_bytes(tiny: Path, tmp_path: Path) -> None:
    again = make_model(tmp_path / "again", size="tiny", seed=0)
    assert _hashes(again) == _hashes(tiny)


def test_overwrite_in_place_is_identical(tiny: Path, tmp_path: Path) -> None:
    out = make_model(tmp_path / "m", seed=3)
    (out / "model-00002-of-00002.safetensors").write_bytes(b"stale")
    make_model(out, seed=0)
    assert _hashes(out) == _hashes(tiny)


def test_different_seed_different_weights_same_tokenizer(tiny: Path, tmp_path: Path) -> None:
    other = make_model(tmp_path / "other", size="tiny", seed=1)
    a, b = _hashes(tiny), _hashes(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    for name in (*TOKENIZER_FILES, "config.json", "generation_config.json"):
        assert a[name] == b[name], name
    with (
        safe_open(tiny / "model.safetensors", "pt") as fa,
        safe_open(other / "model.safetensors", "pt") as fb,
    ):
        name = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(fa.get_tensor(name), fb.get_tensor(name))
        norm = "model.norm.weight"
        assert torch.equal(fa.get_tensor(norm), fb.get_tensor(norm))


def test_config(tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["vocab_size"] == VOCAB_SIZE == 151936
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (151643, 151645)
    assert cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 2
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 32)
    assert cfg["intermediate_size"] == 128 and cfg["max_position_embeddings"] == 4096
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 1e6
    assert cfg["torch_dtype"] == "float32"
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}


def test_weights(tiny: Path) -> None:
    with safe_open(tiny / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        emb = f.get_tensor("model.embed_tokens.weight")
        assert emb.shape == (VOCAB_SIZE, 64) and emb.dtype == torch.float32
        assert abs(emb.std().item() - 0.02) < 1e-3
        assert torch.equal(f.get_tensor("model.norm.weight"), torch.ones(64))
        names = f.keys()
        assert "lm_head.weight" not in names


@pytest.mark.parametrize("size", ["tiny", "small", "medium"])
def test_parameter_names_match_transformers(size: str) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = model_config(size)
    config = transformers.Qwen3Config(
        **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    )
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert expected.pop("lm_head.weight") == (VOCAB_SIZE, cfg["hidden_size"])
    assert parameter_shapes(size) == expected


def test_written_names_and_shapes(tiny: Path) -> None:
    with safe_open(tiny / "model.safetensors", "pt") as f:
        names = f.keys()
        written = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    assert written == parameter_shapes("tiny")


def test_transformers_loads_and_runs(tiny: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tiny, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[151644, 8948, 198]])).logits
    assert logits.shape == (1, 3, VOCAB_SIZE) and torch.isfinite(logits).all()


def test_bfloat16(tmp_path: Path) -> None:
    out = make_model(tmp_path / "bf16", dtype="bfloat16", seed=0)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as f:
        names = f.keys()
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    again = make_model(tmp_path / "bf16b", dtype="bfloat16", seed=0)
    assert _hashes(out) == _hashes(again)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="size"):
        make_model(tmp_path / "x", size="huge")
    with pytest.raises(ValueError, match="dtype"):
        make_model(tmp_path / "x", dtype="float16")


def test_tokenizer_loads_fast(tiny: Path, tokenizer) -> None:
    """The fast (Rust) tokenizer is read straight from tokenizer.json: no slow tokenizer
    and no conversion (which would need vocab/merges files the model does not ship)."""
    tokenizers = pytest.importorskip("tokenizers")
    assert tokenizer.is_fast
    assert isinstance(tokenizer.backend_tokenizer, tokenizers.Tokenizer)
    assert not (tiny / "vocab.json").exists() and not (tiny / "merges.txt").exists()
    assert len(tokenizer) == TOKENIZER_SIZE == 151669


def test_special_token_ids(tokenizer) -> None:
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [151643, 151644, 151645]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 151645
    assert tokenizer.pad_token_id == 151643
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[0] == 151644
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[-1] == 151645
    assert tokenizer.convert_tokens_to_ids("</think>") == 151668


def test_round_trip(tokenizer) -> None:
    for text in ("Hello world 123", "The answer is 42.\n", "  tabs\tand ünïcödé ✓ 漢字"):
        ids = tokenizer.encode(text)
        assert all(i < 151643 for i in ids)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("123") == [tokenizer.convert_tokens_to_ids(c) for c in "123"]


def test_every_id_decodes(tokenizer) -> None:
    texts = tokenizer.batch_decode([[i] for i in range(VOCAB_SIZE)])
    assert len(texts) == VOCAB_SIZE
    assert texts[151645] == "<|im_end|>"
    assert all(t == "" for t in texts[TOKENIZER_SIZE:])
    assert all(t != "" for t in texts[:TOKENIZER_SIZE])


def test_chat_template(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert (
        tokenizer.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nHi<|im_end|>\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    assert ids[0] == 151644 and ids.count(151645) == 2
    assert tokenizer.decode(ids) == text


def test_qwen3_moe_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = make_model(tmp_path / "moe", arch="qwen3-moe")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts_per_tok"] == 2
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        res = model(torch.tensor([[151644, 8948, 198]]), output_router_logits=True)
    # one router per layer, over the 8 experts, every token
    assert len(res.router_logits) == cfg["num_hidden_layers"]
    assert res.router_logits[0].shape == (3, cfg["num_experts"])
    with pytest.raises(ValueError, match="unknown architecture"):
        parameter_shapes(arch="mixtral")
