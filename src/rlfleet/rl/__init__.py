"""The framework side: rollouts admitted exactly once (RolloutClient, admission checks,
sample ledger, retry and partial-rollout policies)."""
# ruff: noqa: F401  (this module only re-exports the public API)

from rlfleet.rl.admission import (
    AdmissionError,
    AdmissionRules,
    IdentityMismatch,
    LogprobsMisaligned,
    MixedPolicy,
    NotTerminal,
    PromptLogprobsShifted,
    TokenIdsMissing,
)
from rlfleet.rl.attempt import AttemptState, IllegalTransition
from rlfleet.rl.client import RolloutClient
from rlfleet.rl.ledger import AlreadyAdmitted, AttemptClosed, SampleLedger
from rlfleet.rl.partial import PartialAction, PartialOutput, PartialRolloutPolicy
from rlfleet.rl.retry import RetryPolicy
from rlfleet.rl.sample import (
    AdmittedSample,
    Completion,
    RolloutOutcome,
    SampleFailed,
    SampleRequest,
    SamplingSpec,
    WeightSpan,
)
