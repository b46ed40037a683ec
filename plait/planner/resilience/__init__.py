"""Planning under failures: pipeline templates (Oobleck), reconfiguration, stragglers."""
