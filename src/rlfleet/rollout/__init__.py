"""The rollout side, in the trainer's process: samples admitted exactly once. RolloutClient
(client) sends each attempt and judges the response (checks, response) into a sample ledger
(ledger, attempt), with retry and partial-rollout policies (retry, partial); what a trainer
builds and gets back (sample); the RolloutGate a refresh closes and opens (gate); rollout
metrics and trace context (telemetry). It imports neither rlfleet.refresh nor rlfleet.rl."""
