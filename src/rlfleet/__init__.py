"""rlfleet: RL rollouts from a fleet of vLLM workers, with token authority and live policy refresh."""

__version__ = "0.1.0"
