"""Plot lm loss, lm_z_loss and mean lse per iteration for several z-loss runs (matplotlib, Agg)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_runs(runs, path):
    """``runs``: ``{coeff: [{"iteration", "lm loss", "lm_z_loss", "lm_lse", ...}, ...]}``."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = [("lm loss", "lm loss (CE)"), ("lm_z_loss", "lm_z_loss = c * mean(lse^2)"), ("lm_lse", "mean log-sum-exp")]
    for ax, (key, title) in zip(axes, panels):
        for coeff, hist in runs.items():
            its = [row["iteration"] for row in hist]
            ax.plot(its, [row.get(key, 0.0) for row in hist], marker=".", label=f"z_loss_coeff={coeff:g}")
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("tiny MoE GPT (megatron-core, TP=2): fused CE + z-loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
