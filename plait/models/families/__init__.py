"""Per-family facts of the encoders beyond the ViT / Whisper shapes of :mod:`plait.models.hf` (one module per
family: its feature-count function, shared by the processor and the encoder, and what its stock forward needs
besides the pixels or mel features)."""

__all__: list[str] = []
