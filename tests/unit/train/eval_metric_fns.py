"""Metric functions for ``train.eval_metrics`` in the evaluation tests (``module:function`` paths)."""

__all__ = ["answer_lengths", "first_char_match"]


def first_char_match(predictions: list[str], references: list[str]) -> float:
    """Fraction of answers whose first character equals the reference's (a float metric)."""
    return sum(p[:1] == r[:1] for p, r in zip(predictions, references)) / max(1, len(predictions))


def answer_lengths(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean characters of the predictions and of the references (a dict metric)."""
    n = max(1, len(predictions))
    return {"pred_chars": sum(map(len, predictions)) / n, "ref_chars": sum(map(len, references)) / n}
