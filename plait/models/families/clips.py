"""The one check of an audio clip's length against an encoder's fixed input window, shared by the feature counts
of every audio family (``models.hf.AudioFeatureCount``, ``qwen2_audio.Qwen2AudioFeatureCount``)."""

from __future__ import annotations

__all__ = ["checked_clip_samples"]


def checked_clip_samples(num_samples: int, max_samples: int, sampling_rate: int) -> int:
    """``num_samples`` as an int once it is a clip the encoder accepts (samples at ``sampling_rate`` Hz).

    Raises:
        ValueError: for an empty clip, or one longer than the encoder window of ``max_samples`` samples (both
            lengths in seconds in the message).
    """
    n = int(num_samples)
    if n <= 0:
        raise ValueError("audio clip is empty")
    if n > max_samples:
        raise ValueError(
            f"audio clip of {n / sampling_rate:.2f} s is longer than the encoder window of "
            f"{max_samples / sampling_rate:.2f} s"
        )
    return n
