"""The trainer side of the demo: a verifiable task, a GRPO trainer on a transformers model,
HF-format checkpoints the fleet can load, and the run report."""
# ruff: noqa: F401  (this module only re-exports the public API)

from rlfleet.train.checkpoint import save_checkpoint
from rlfleet.train.grpo import GrpoTrainer, Rollout, StepStats
from rlfleet.train.task import SevensTask
