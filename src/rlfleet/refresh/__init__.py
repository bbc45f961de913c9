"""The policy refresh coordinator: PolicyRefresh (coordinator) moves the fleet from one
verified policy to the next as one transaction (transaction, waves, recovery), through one
WorkerControl per worker flavour (control, staged, adapter, relay), judges it with a
post-update probe (probe), publishes the committed policy (committed) and serves it as the
`rlfleet control` service (fleet_control); its settings (config), the policies it records
(policy), test hooks (hooks) and its metrics (telemetry). It sits above rlfleet.rollout
(it closes and opens the RolloutGate) and rlfleet.journal (its record of every transaction)."""
