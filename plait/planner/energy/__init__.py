"""Energy plans: per-frequency unit profiles, the time-energy frontier (Perseus) and its plan."""
