"""LoRA ranks: the rank law and its TOML tables."""
