"""Pipeline plans as data: stages and ranks, schedules (1F1B, interleaved, GPipe), their simulation."""
