"""Adapters that plug rlfleet into the trainers people already use (`trl`: TRL's
GRPOTrainer). Each module imports its trainer library only when it is imported itself."""
