"""Dynamo's LoRA route facts (rlfleet.worker.dynamo_lora): the id of a name, the URIs and
the hot-swap switch."""

from __future__ import annotations

import pytest

from rlfleet.worker.dynamo_lora import hotswap_enabled, local_path, lora_name_to_id


def test_lora_ids_are_dynamos():
    assert lora_name_to_id("test_lora") == 1983627077  # Dynamo's own stability value
    assert lora_name_to_id("a") == lora_name_to_id("a") != lora_name_to_id("b")
    assert all(0 < lora_name_to_id(n) < 2**31 for n in ("x", "y", "z" * 300))


def test_file_uris_only_and_the_hotswap_switch():
    assert local_path("file:///tmp/a") == "/tmp/a"
    for bad in ("s3://b/k", "hf://org/x", "/tmp/a", "file://"):
        with pytest.raises(ValueError, match="file://"):
            local_path(bad)
    assert hotswap_enabled({"DYN_LORA_HOTSWAP_ENABLED": "true"})
    assert not hotswap_enabled({}) and not hotswap_enabled({"DYN_LORA_HOTSWAP_ENABLED": "0"})
