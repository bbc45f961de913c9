"""Which policy a worker serves, a token was sampled under, or a refresh installs: the one
shape of "which policy" (`PolicyIdentity`) and how each surface spells it.

Surfaces (one table each, derived from the Struct's fields, so a new field is one edit here):
- the identity as a JSON object (`to_dict` / `from_dict`): {"version", "digest", "step"}
  and, for a LoRA adapter's policy, "adapter" (the coordinator's view of a worker, the
  journal); an unknown adapter (the base model) is left out on every surface;
- stamped (`stamped` / `from_stamped`): {"weight_version", "weight_digest", "weight_step"}
  (discovery entries, `nvext.engine_data`, request-plane frames);
- an admin reply's fields (`reply_fields` / `from_reply`): {"version", "weight_digest",
  "step"} (get_weight_version and every install route, docs/contract.md);
- a span label (`span_label` / `from_span_label`): "<version>|<digest>|<step>", what an
  engine that tracks policies per token stamps on its tokens (the base model's: an
  adapter's tokens are stamped by the worker from the adapter the request ran on);
- a weight-version span (`WeightSpan`): the identity's fields, then `start` and `end`
  (nvext.weight_versions, request-plane deltas, an admitted sample's spans).
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType


class PolicyIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """A policy: its caller-declared label, the content digest of its weights, and the
    fleet step a refresh coordinator gave it; for a LoRA adapter served beside the base
    model, the adapter's name (its version, digest and step are the adapter's own). Any of
    them may be unknown (None)."""

    version: str | None = None  # the caller-declared label
    digest: str | None = None  # content digest of the weights (rlfleet.weights.digest)
    step: int | None = None  # the policy's fleet step (increases with every refresh)
    # the LoRA adapter's name; unset (None reads as unset): the base model, left out of
    # every surface, the wire encoding too
    adapter: str | UnsetType = UNSET

    def __post_init__(self) -> None:
        if self.adapter is None:
            msgspec.structs.force_setattr(self, "adapter", UNSET)

    # ---------------------------------------------------------------- as a JSON object

    def _shown(self) -> tuple[str, ...]:
        """The fields every surface spells: all but an unknown adapter."""
        return self.__struct_fields__ if self.adapter else _without_adapter(type(self))

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self._shown()}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> PolicyIdentity:
        """From `to_dict`'s shape; missing keys are unknown, other keys are ignored."""
        d = d or {}
        return cls(**{f: d.get(f) for f in cls.__struct_fields__ if f in d})

    # ---------------------------------------------------------------- stamped

    def stamped(self) -> dict[str, Any]:
        """As responses, discovery entries and engine data carry it: `weight_<field>`."""
        return {f"weight_{f}": getattr(self, f) for f in self._shown()}

    @classmethod
    def from_stamped(cls, d: dict[str, Any] | None) -> PolicyIdentity:
        d = d or {}
        return cls(**{f: d.get(f"weight_{f}") for f in cls.__struct_fields__})

    @classmethod
    def stamped_on(cls, d: dict[str, Any]) -> PolicyIdentity | None:
        """The identity stamped on `d` (say, SGLang's meta_info beside other fields), or
        None when `d` carries none of the stamped names."""
        if not any(f"weight_{f}" in d for f in cls.__struct_fields__):
            return None
        return cls.from_stamped(d)

    # ---------------------------------------------------------------- admin replies

    def reply_fields(self) -> dict[str, Any]:
        """As the admin routes reply with it (the contract's names)."""
        return {REPLY_NAMES.get(f, f): getattr(self, f) for f in self._shown()}

    @classmethod
    def from_reply(cls, d: dict[str, Any] | None) -> PolicyIdentity:
        d = d or {}
        return cls(**{f: d.get(REPLY_NAMES.get(f, f)) for f in cls.__struct_fields__})

    # ---------------------------------------------------------------- span labels

    def span_label(self) -> str:
        """"<version>|<digest>|<step>": each field's text, empty for None (the adapter is
        not part of it)."""
        return "|".join("" if (v := getattr(self, f)) is None else str(v)
                        for f in _without_adapter(type(self)))

    @classmethod
    def from_span_label(cls, label: str) -> PolicyIdentity:
        """The identity of a span label (older, shorter labels too: missing parts are
        unknown). The last fields are split off from the right: a version may hold '|'."""
        fields = [f for f in msgspec.structs.fields(cls) if f.name != "adapter"]
        parts = label.rsplit("|", len(fields) - 1)
        parts += [""] * (len(fields) - len(parts))
        return cls(**{f.name: _parse(f.type, text)
                      for f, text in zip(fields, parts, strict=True)})

    def of_adapter(self, adapter: str | None) -> PolicyIdentity:
        """The same policy, named as `adapter`'s (None: the base model's)."""
        return msgspec.structs.replace(self, adapter=UNSET if adapter is None else adapter)

    @property
    def adapter_name(self) -> str | None:
        """The adapter's name; None for the base model."""
        return self.adapter or None

    def __bool__(self) -> bool:
        """Whether anything about the policy is known."""
        return any(getattr(self, f) not in (None, UNSET) for f in self.__struct_fields__)


class WeightSpan(PolicyIdentity, frozen=True, kw_only=True):
    """Half-open span [start, end) of a choice's output tokens generated under one policy:
    the policy's fields, then the span's (on the wire: {"version", "digest", "step",
    "start", "end"})."""

    start: int
    end: int

    @classmethod
    def of(cls, policy: PolicyIdentity, start: int, end: int) -> WeightSpan:
        return cls(**policy.to_dict(), start=start, end=end)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "start": self.start, "end": self.end}

    @property
    def policy(self) -> PolicyIdentity:
        """The policy that generated the span's tokens."""
        return PolicyIdentity(**{f: getattr(self, f) for f in PolicyIdentity.__struct_fields__})

    def moved(self, by: int) -> WeightSpan:
        """The same span `by` positions later (a resumed sample's later attempt)."""
        return msgspec.structs.replace(self, start=self.start + by, end=self.end + by)

    def __bool__(self) -> bool:
        return True  # a span is a span, whether or not its policy is known


def _without_adapter(cls: type) -> tuple[str, ...]:
    """The fields of `cls` a base model's policy spells (all but `adapter`)."""
    return tuple(f for f in cls.__struct_fields__ if f != "adapter")

#: the admin routes' names for the fields that differ from the Struct's
REPLY_NAMES = {"digest": "weight_digest"}

UNKNOWN = PolicyIdentity()


def _parse(annotation: Any, text: str) -> Any:
    """A span label's part as the field's type: empty is unknown, an int field's text that
    is no number too."""
    if not text:
        return None
    if annotation is int or int in typing.get_args(annotation):
        return int(text) if text.isdigit() else None
    return text
