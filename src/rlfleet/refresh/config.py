"""What a policy refresh coordinator is configured with (`RefreshConfig`): which fleet, how
the weights travel, what a failure does, how the update is probed, and how a rolling refresh
moves. Frozen and cross-validated in one place (`__post_init__`), built by a caller, by
`Fleet`, or from the `rlfleet refresh` / `rlfleet recover` arguments (`from_args`)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.refresh.control import DEFAULT_CONCURRENCY, TRANSFER_BACKENDS, SglangWorker
from rlfleet.refresh.probe import PROBE_TEXT
from rlfleet.refresh.relay import DEFAULT_THRESHOLD as DEFAULT_RELAY_THRESHOLD


class UpdatePath(enum.StrEnum):
    VLLM_DISK = "vllm-disk"
    VLLM_DISTRIBUTED = "vllm-distributed"
    SGLANG_DISK = "sglang-disk"
    VLLM_STAGED = "vllm-staged"  # pulled while serving (rlfleet.refresh.staged), installed gated
    VLLM_ADAPTER = "vllm-adapter"  # one LoRA adapter, the engine serving on (rlfleet.refresh.adapter)


class OnFailure(enum.StrEnum):
    RETRY = "retry"  # retry the failed workers, then hold
    ROLLBACK = "rollback"  # reapply the previous policy everywhere, verify it, reopen on it
    HOLD = "hold"  # keep the fleet gated for an operator


class RefreshMode(enum.StrEnum):
    SYNC = "sync"  # the whole fleet gated while it changes
    ROLLING = "rolling"  # in waves, the rest serving, within max_lag steps


class PauseMode(enum.StrEnum):
    """What a paused worker does with the requests it is running (the pause route's mode)."""

    KEEP = "keep"  # keep them in the engine; they go on under the new weights
    WAIT = "wait"  # let them finish before the pause returns
    ABORT = "abort"  # abort them


@dataclass(frozen=True, kw_only=True)
class RefreshConfig:
    """How one coordinator refreshes one fleet.

    `rl_url`: the frontend's RL listener (the vLLM paths); `model`: only workers serving it;
    `sglang_workers`: the SGLang path's workers (they are not in discovery). `journal`: a
    path, ``:memory:`` or ``etcd://host:port[/name]``; every coordinator of one fleet uses
    the same one. `probe_tolerance`: max logprob difference in the post-update probe
    (default: by the dtype each worker serves in, see rlfleet.refresh.probe);
    `probe_from_checkpoint`: without a trainer's probe, compute the expected one from the
    checkpoint with transformers (loads the whole model here), else the workers must agree
    with each other on `probe_text`. `transfer_backend`, `master_address` (default: this
    host's address toward the workers), `master_port`: the distributed path's process group.
    `mode` "rolling": update `wave_size` workers at a time (default: as many as keeps
    `min_serving` serving) while the rest serve, refusing a target more than `max_lag` steps
    ahead of a serving worker. `stage_fanout` (the staged path, from an S3, directory or
    trainer source): 0, every worker pulls the version from the source; k >= 1, a pipelined fan-out
    (rlfleet.weights.fanout): only the first worker in discovery pulls from the source and
    each other one from a worker before it, a chain (1) or a k-ary tree, each serving what
    it has while it still receives. `discovery`: the store where the committed policy is
    published for the frontends (rlfleet.refresh.committed; default: the one the RL listener
    names). `adapter` (with path vllm-adapter): refresh that LoRA adapter alone, the base
    model and other adapters serving on (rlfleet.refresh.adapter). `concurrency`: admin calls
    (and probes) in flight at once, however many workers (the HTTP client holds as many
    connections); `phase_timeout`: seconds one phase may take over the whole fleet (default:
    1.25 × `timeout`): a worker not done by then is left out as missing, named in the result, and
    the others go on. `relay_threshold`: a phase over more workers than this goes through
    relays (rlfleet.refresh.relay: K workers each run the phase's call on their subtree; None:
    never); `relay_fanout`: K (default: the square root of the phase's workers).
    `probe_after_reopen` (where the workers commit in one call each): the verified workers
    (version and digest checked, liveness and their own self-check passed) reopen first and
    are probed then; a worker whose probe fails is closed again and left out, a probe on
    which the workers disagree closes the wave again and holds the fleet, as before the
    reopen. The trade: such a worker served the frontend's other clients for the length of
    its probe (a trainer's own rollouts wait at its gate until the refresh ends, probe
    included); what it gains: the pause and the cache reset are no longer followed by a
    generation before the fleet serves again."""

    rl_url: str | None = None
    model: str | None = None
    path: UpdatePath = UpdatePath.VLLM_DISK
    sglang_workers: tuple[SglangWorker, ...] = ()
    journal: str | Path = ":memory:"
    on_failure: OnFailure = OnFailure.HOLD
    retries: int = 1
    pause_mode: PauseMode = PauseMode.WAIT
    probe_text: str = PROBE_TEXT
    probe_tokens: int = 8
    probe_tolerance: float | None = None
    probe_from_checkpoint: bool = False
    transfer_backend: str = "gloo"
    master_address: str | None = None
    master_port: int | None = None
    min_workers: int = 1
    timeout: float = 120.0
    admin_token: str | None = None
    mode: RefreshMode = RefreshMode.SYNC
    max_lag: int = 1
    min_serving: int = 1
    wave_size: int | None = None
    stage_fanout: int = 0
    discovery: str | None = None
    adapter: str | None = None  # the LoRA adapter a vllm-adapter refresh moves
    concurrency: int = DEFAULT_CONCURRENCY
    phase_timeout: float | None = None
    relay_threshold: int | None = DEFAULT_RELAY_THRESHOLD
    relay_fanout: int | None = None
    #: the post-update probe runs once the verified workers reopened, not before (a worker
    #: that then fails it is closed again and left out): see `probe_after_reopen` below
    probe_after_reopen: bool = False

    def __post_init__(self) -> None:
        """Every check, and the enums from their names (a caller may pass strings)."""
        for name, kind in (("path", UpdatePath), ("on_failure", OnFailure),
                           ("pause_mode", PauseMode), ("mode", RefreshMode)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                choices = ", ".join(k.value for k in kind)
                raise ValueError(f"{name} must be one of {choices}, not {value!r}") from None
        object.__setattr__(self, "sglang_workers", tuple(self.sglang_workers))
        _check_counts(self)
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer backend must be gloo or nccl, not "
                             f"{self.transfer_backend!r}")
        if self.path is not UpdatePath.SGLANG_DISK and not self.rl_url:
            raise ValueError("the vLLM paths need rl_url (the frontend's RL listener)")
        if (self.path is UpdatePath.VLLM_ADAPTER) != bool(self.adapter):
            raise ValueError("path vllm-adapter and adapter (the LoRA adapter's name) go "
                             "together: give both, or neither")
        if self.mode is RefreshMode.ROLLING:
            if self.path is UpdatePath.SGLANG_DISK:
                raise ValueError("a rolling refresh needs workers that leave and rejoin "
                                 "routing (set_admission in discovery): use a vLLM path")
            if self.on_failure is OnFailure.ROLLBACK:
                raise ValueError("a rolling refresh does not roll back: workers that fail stay "
                                 "out and the rest keep serving (on_failure hold or retry)")

    def replace(self, **changes: Any) -> RefreshConfig:
        """This config with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RefreshConfig:
        """From the arguments of `rlfleet refresh` / `rlfleet recover` (rlfleet.cli)."""
        staged = getattr(args, "staged", False)
        return cls(
            rl_url=args.rl_url, model=args.model,
            path=UpdatePath.VLLM_STAGED if staged else args.path,
            sglang_workers=tuple(SglangWorker(*pair.split(",", 1))
                                 for pair in args.sglang_worker),
            journal=args.journal, on_failure=args.on_failure, retries=args.retries,
            pause_mode=args.pause_mode, probe_tokens=args.probe_tokens,
            probe_tolerance=args.probe_tolerance,
            probe_from_checkpoint=args.probe_from_checkpoint,
            transfer_backend=args.transfer_backend, master_address=args.master_address,
            master_port=args.master_port, admin_token=args.admin_token,
            # `rlfleet recover` has no rolling settings: a recovery is synchronous
            mode=getattr(args, "mode", RefreshMode.SYNC), max_lag=getattr(args, "max_lag", 1),
            min_serving=getattr(args, "min_serving", 1),
            wave_size=getattr(args, "wave_size", None),
            stage_fanout=getattr(args, "stage_fanout", 0),
            discovery=getattr(args, "discovery", None),
            adapter=getattr(args, "adapter", None),
            concurrency=getattr(args, "admin_concurrency", DEFAULT_CONCURRENCY),
            phase_timeout=getattr(args, "phase_timeout", None),
            relay_threshold=getattr(args, "relay_threshold", DEFAULT_RELAY_THRESHOLD),
            relay_fanout=getattr(args, "relay_fanout", None),
            # `rlfleet refresh` probes after the reopen unless told otherwise
            probe_after_reopen=not getattr(args, "probe_before_reopen", True))


def _check_counts(c: RefreshConfig) -> None:
    if c.probe_tokens < 1:
        raise ValueError("probe_tokens must be at least 1")
    if type(c.retries) is not int or c.retries < 0:
        raise ValueError(f"retries must be a non-negative integer, not {c.retries!r}")
    if type(c.min_workers) is not int or c.min_workers < 0:
        raise ValueError(f"min_workers must be a non-negative integer, not {c.min_workers!r}")
    if c.timeout <= 0:
        raise ValueError(f"timeout must be positive (seconds), not {c.timeout!r}")
    if type(c.max_lag) is not int or c.max_lag < 0:
        raise ValueError(f"max_lag must be a non-negative integer (steps), not {c.max_lag!r}")
    if type(c.min_serving) is not int or c.min_serving < 1:
        raise ValueError("min_serving must be at least 1")
    if c.wave_size is not None and (type(c.wave_size) is not int or c.wave_size < 1):
        raise ValueError("wave_size must be at least 1")
    if type(c.stage_fanout) is not int or c.stage_fanout < 0:
        raise ValueError("stage_fanout must be a non-negative integer (0: off, 1: a chain, "
                         f"k: a k-ary tree), not {c.stage_fanout!r}")
    if type(c.concurrency) is not int or c.concurrency < 1:
        raise ValueError(f"concurrency must be a positive integer, not {c.concurrency!r}")
    for name in ("relay_threshold", "relay_fanout"):
        value = getattr(c, name)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{name} must be a positive integer (or None: "
                             f"{'never relay' if name == 'relay_threshold' else 'the default'})"
                             f", not {value!r}")
    if c.phase_timeout is not None and not c.phase_timeout > 0:
        raise ValueError(f"phase_timeout must be positive (seconds), not {c.phase_timeout!r}")
