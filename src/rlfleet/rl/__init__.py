"""The framework side: the trainer-facing Fleet (rollouts and refreshes from any thread),
rollouts admitted exactly once (RolloutClient, admission checks, sample ledger, retry and
partial-rollout policies; prompts as token IDs, text, chat or a next turn) and fleet policy
refresh (PolicyRefresh, its RefreshConfig, its journal, and the trainer-side RolloutGate
between them)."""
# ruff: noqa: F401  (this module only re-exports the public API)

from rlfleet.journal import EtcdJournal, SqliteJournal, open_journal
from rlfleet.protocol.identity import PolicyIdentity, WeightSpan
from rlfleet.protocol.nvext import PolicyBound
from rlfleet.refresh.config import OnFailure, PauseMode, RefreshConfig, RefreshMode, UpdatePath
from rlfleet.refresh.control import FleetFenced, SglangWorker
from rlfleet.refresh.coordinator import PolicyRefresh
from rlfleet.refresh.hooks import RefreshHooks
from rlfleet.refresh.policy import Policy
from rlfleet.refresh.probe import Probe, probe_from_model
from rlfleet.refresh.transaction import RefreshResult, RefreshState
from rlfleet.rl.fleet import Fleet, FleetHeld
from rlfleet.rl.stream import OnStale, RolloutStream, StreamConfig, StreamedSample, StreamStats
from rlfleet.rollout.attempt import AttemptState, IllegalTransition
from rlfleet.rollout.checks import (
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
from rlfleet.rollout.client import RolloutClient, TokenizeFailed
from rlfleet.rollout.gate import RolloutGate
from rlfleet.rollout.ledger import (
    AlreadyAdmitted,
    AttemptClosed,
    RetryWindow,
    RetryWindowPassed,
    SampleLedger,
)
from rlfleet.rollout.partial import PartialAction, PartialOutput, PartialRolloutPolicy
from rlfleet.rollout.retry import RetryPolicy
from rlfleet.rollout.sample import *  # noqa: F403  (its __all__: what a trainer builds and gets back)
