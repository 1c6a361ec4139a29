"""``python -m jaxdd.train.plot HISTORY.json OUT.png``:
loss curves (and the drafter's per-slot accuracy)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot_history(history_path: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = json.loads(Path(history_path).read_text())
    panels = 2 if "accuracy" in history else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    loss = axes[0, 0]
    loss.plot(history["step"], history["train_loss"], label="train")
    loss.plot(history["step"], history["validation_loss"], label="validation")
    loss.set(xlabel="step", ylabel="cross-entropy (nats)", title=Path(history_path).stem)
    loss.legend()
    if panels == 2:  # accuracy of each mask slot of the block at the last evaluation
        final = history["accuracy"][-1]
        axes[0, 1].bar(range(1, len(final) + 1), final)
        axes[0, 1].set(
            xlabel="position in block", ylabel="greedy draft accuracy", title="validation, final"
        )
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


if __name__ == "__main__":
    print(plot_history(Path(sys.argv[1]), Path(sys.argv[2])))
