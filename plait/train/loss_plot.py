"""Loss-curve PNG of a run's metrics (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_loss_curve"]


def plot_loss_curve(metrics_path: str | Path, out_path: str | Path) -> Path:
    """Draw training loss per step (and validation exact match per task, right axis) to a PNG.

    Raises:
        ValueError: when the metrics file holds no loss record.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from plait.train.metrics import read_metrics

    records = read_metrics(metrics_path)
    steps = [r["step"] for r in records if "loss" in r]
    if not steps:
        raise ValueError(f"{metrics_path} holds no training loss")
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(steps, [r["loss"] for r in records if "loss" in r], color="tab:blue", lw=1.2, label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean token cross-entropy)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    evals = [r for r in records if "eval" in r]
    if evals:
        ax2 = ax.twinx()
        for task in sorted(evals[-1]["eval"]):
            ax2.plot([r["step"] for r in evals], [r["eval"].get(task, float("nan")) for r in evals],
                     marker="o", ms=3, lw=1, label=f"val {task}")
        ax2.set_ylabel("validation exact match")
        ax2.set_ylim(0, 1.02)
        ax2.legend(loc="center right", fontsize=8)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("plait training")
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out)
    plt.close(fig)
    return out
