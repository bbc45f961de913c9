"""The framework side: the trainer-facing Fleet (rollouts and refreshes from any thread),
rollouts admitted exactly once (RolloutClient, admission checks, sample ledger, retry and
partial-rollout policies; prompts as token IDs, text, chat or a next turn) and fleet policy
refresh (PolicyRefresh, its RefreshConfig, its journal, and the trainer-side RolloutGate
between them)."""
# ruff: noqa: F401  (this module only re-exports the public API)

from rlfleet.protocol.identity import PolicyIdentity, WeightSpan
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.rl.attempt import AttemptState, IllegalTransition
from rlfleet.rl.checks import (
    CheckFailed,
    IdentityMismatch,
    LogprobsMisaligned,
    MixedPolicy,
    NotTerminal,
    PromptLogprobsShifted,
    SampleRules,
    StalePolicy,
    TokenIdsMissing,
    WrongAdapter,
)
from rlfleet.rl.client import RolloutClient, TokenizeFailed
from rlfleet.rl.config import OnFailure, PauseMode, RefreshConfig, RefreshMode, UpdatePath
from rlfleet.rl.control import FleetFenced, SglangWorker
from rlfleet.rl.fleet import Fleet, FleetHeld
from rlfleet.rl.gate import RolloutGate
from rlfleet.rl.hooks import RefreshHooks
from rlfleet.rl.journal import EtcdJournal, SqliteJournal, open_journal
from rlfleet.rl.ledger import AlreadyAdmitted, AttemptClosed, SampleLedger
from rlfleet.rl.partial import PartialAction, PartialOutput, PartialRolloutPolicy
from rlfleet.rl.policy import Policy
from rlfleet.rl.probe import Probe, probe_from_model
from rlfleet.rl.refresh import PolicyRefresh
from rlfleet.rl.retry import RetryPolicy
from rlfleet.rl.sample import *  # noqa: F403  (its __all__: what a trainer builds and gets back)
from rlfleet.rl.stream import OnStale, RolloutStream, StreamConfig, StreamedSample, StreamStats
from rlfleet.rl.transaction import RefreshResult, RefreshState
