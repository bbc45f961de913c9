"""A deterministic, offline byte-level BPE tokenizer with Qwen3's vocabulary layout.

The BPE merges are trained with the `tokenizers` trainer on a small corpus embedded
below; the vocabulary is then padded with plain (unreachable) entries up to Qwen3's
special-token IDs, so that token IDs of a Qwen3-sized vocabulary (151,936 logits)
all decode. Special tokens sit *inside* the BPE vocabulary at their Qwen3 IDs and are
also declared as added tokens: `tokenizers` ignores the `id` of added tokens on load,
and plain vocabulary entries are much faster to load than added tokens.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

#: Number of logits (rows of the embedding) of Qwen3 models.
VOCAB_SIZE = 151936
ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645

#: Tokens after the plain vocabulary, in Qwen3's order (IDs from ENDOFTEXT_ID on): the
#: special ones (151643-151656), then those the tokenizer treats as text (151657-151668).
QWEN3_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
QWEN3_TEXT_TOKENS = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>")
#: (text, special) of each, in order
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    *((t, True) for t in QWEN3_SPECIAL_TOKENS), *((t, False) for t in QWEN3_TEXT_TOKENS))
#: Number of entries in the tokenizer (IDs 0..151668); IDs up to VOCAB_SIZE - 1 decode to "".
TOKENIZER_SIZE = ENDOFTEXT_ID + len(QWEN3_ADDED_TOKENS)

#: Qwen2/Qwen3 pre-tokenization pattern (single digits, words with a leading mark).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Merges the trainer may learn at most (it stops earlier when pairs run out).
TRAINED_VOCAB_SIZE = 2048

#: Qwen-style ChatML; string content or a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still learn the shape of text.
Once upon a time, in a village by the sea, there lived an old fisherman and his daughter.
Every morning they walked to the harbour before sunrise, checked the nets, and talked about
the weather. "Will it rain today?" she asked. "Maybe," he said, "but the wind is from the west."
Reinforcement learning trains a policy by sampling actions, observing rewards, and updating
the parameters so that good actions become more likely. The policy is a language model; the
actions are tokens; the reward comes from a verifier that checks the final answer.
Hello world! Hello, World. HELLO WORLD? hello there, how are you doing this fine evening?
I'm fine, thanks. You're welcome. We'll see. They've gone home. She'd like some tea. It's late.
Question: What is the capital of France? Answer: Paris is the capital of France.
Question: How many legs does a spider have? Answer: A spider has eight legs.
Question: Which planet is closest to the sun? Answer: Mercury is the closest planet to the sun.
The system prompt says: you are a helpful assistant. The user asks a question and the
assistant answers it step by step, then gives the final answer on its own line.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week.
January February March April May June July August September October November December.
Red, orange, yellow, green, blue, indigo and violet are the colours of the rainbow.
Water boils at 100 degrees Celsius and freezes at 0 degrees Celsius at sea level.
The train leaves at 09:45 and arrives at 13:20; the journey takes 3 hours and 35 minutes.
Please compute the sum of the numbers below and show your work before the final answer.
2 + 2 = 4. 3 + 5 = 8. 7 + 6 = 13. 12 + 30 = 42. 99 + 1 = 100. 250 + 750 = 1000.
10 - 3 = 7. 45 - 17 = 28. 100 - 58 = 42. 1000 - 1 = 999. 64 - 32 = 32. 81 - 9 = 72.
6 * 7 = 42. 9 * 9 = 81. 12 * 12 = 144. 25 * 4 = 100. 8 * 125 = 1000. 11 * 11 = 121.
84 / 2 = 42. 81 / 9 = 9. 144 / 12 = 12. 1000 / 8 = 125. 7 / 2 = 3.5. 1 / 4 = 0.25.
(3 + 4) * 5 = 35. 2 ** 10 = 1024. 3.14159 is close to pi. The square root of 2 is 1.41421.
x = 5; y = x * 2 + 1; print(y)  # prints 11
def add(a, b):
    return a + b

for i in range(10):
    total = total + i * i
if total > 100 and not done:
    print("large", total)
{"name": "calculator", "arguments": {"expression": "17 * 23"}} -> 391
The answer is 42. The answer is 17. The final answer is 391. The final answer is \\boxed{12}.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 100 1000 2024.
Phone 555-0123, room 4B, version 1.2.3, ratio 3:2, 50% off, $19.99, 7 kg, 12 km/h, 3rd place.
A scientist measures the length of a shadow at noon and the height of a pole; with a little
geometry she estimates the size of the Earth. Careful measurement and simple arithmetic go far.
The library opens at nine o'clock. Students read books about history, chemistry, music, and art.
Some people prefer coffee in the morning while others drink tea; a few drink only water.
When the computer finished the job it wrote the results to a file and sent a short message.
Servers, workers, queues and caches: a fleet of machines answers many requests at once.
"""


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _train_base() -> dict[str, Any]:
    """Train byte-level BPE on the embedded corpus; returns the tokenizer's JSON object."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=TRAINED_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return json.loads(tok.to_str())


def _padding_token(i: int) -> str:
    """Text of the plain vocabulary entry that fills ID `i` (never produced by encoding)."""
    return f"<|reserved_{i}|>"


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """The serialized `tokenizer.json`, identical on every call and in every process."""
    obj = _train_base()
    model = obj["model"]
    vocab: dict[str, int] = model["vocab"]
    trained = len(vocab)
    if sorted(vocab.values()) != list(range(trained)):
        raise RuntimeError("trained BPE vocabulary is not contiguous")
    if trained >= ENDOFTEXT_ID:
        raise RuntimeError(f"trained BPE vocabulary too large: {trained}")
    for i in range(trained, ENDOFTEXT_ID):
        vocab[_padding_token(i)] = i
    for offset, (text, _special) in enumerate(QWEN3_ADDED_TOKENS):
        if text in vocab:
            raise RuntimeError(f"special token {text!r} already in the trained vocabulary")
        vocab[text] = ENDOFTEXT_ID + offset
    if len(vocab) != TOKENIZER_SIZE:
        raise RuntimeError("padding produced duplicate vocabulary entries")
    model["unk_token"] = None
    model["dropout"] = None
    model["fuse_unk"] = False
    model["byte_fallback"] = False
    obj["added_tokens"] = [
        {
            "id": ENDOFTEXT_ID + offset,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for offset, (text, special) in enumerate(QWEN3_ADDED_TOKENS)
    ]
    # Round-trip through the library: validates the file and gives its canonical form.
    tok = Tokenizer.from_str(json.dumps(obj, ensure_ascii=False))
    if tok.token_to_id("<|im_end|>") != IM_END_ID or tok.get_vocab_size() != TOKENIZER_SIZE:
        raise RuntimeError("special tokens did not land at their Qwen3 IDs")
    return tok.to_str(pretty=True)


def tokenizer_config() -> dict[str, Any]:
    """Contents of `tokenizer_config.json` (Qwen3-like)."""
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ENDOFTEXT_ID + offset): {
                "content": text,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for offset, (text, special) in enumerate(QWEN3_ADDED_TOKENS)
        },
        "additional_special_tokens": list(QWEN3_SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "unk_token": None,
    }


def special_tokens_map() -> dict[str, Any]:
    """Contents of `special_tokens_map.json`."""
    return {
        "additional_special_tokens": list(QWEN3_SPECIAL_TOKENS[1:]),
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    }


def tokenizer_files() -> dict[str, bytes]:
    """File name -> exact bytes of every tokenizer file of a checkpoint."""

    def dump(obj: dict[str, Any]) -> bytes:
        return (json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n").encode()

    return {
        "tokenizer.json": tokenizer_json().encode(),
        "tokenizer_config.json": dump(tokenizer_config()),
        "special_tokens_map.json": dump(special_tokens_map()),
    }
