"""Draw docs/caote-toy.png: on a toy head, attention alone and CAOTE pick different tokens to evict.

Six cached tokens with 2-D values. Token 3 gets the most attention, but its value sits next to the attention
output, so dropping it barely moves the output: CAOTE ranks it cheap. Token 5 gets less attention, but its value is
far from the output: CAOTE keeps it. Run: ``python examples/plot_caote_toy.py``.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from caote.value_aware import caote_score  # noqa: E402

WEIGHTS = torch.tensor([0.30, 0.05, 0.10, 0.32, 0.08, 0.15])
VALUES = torch.tensor([[0.2, 0.3], [1.4, -0.2], [-0.6, 0.9], [-0.05, 0.16], [0.9, 1.1], [-1.3, -0.9]])
TARGET = Path(__file__).resolve().parents[1] / "docs" / "caote-toy.png"


def main() -> Path:
    """Compute the toy scores with `caote.value_aware.caote_score` and save the two-panel figure."""
    output = WEIGHTS @ VALUES
    scores = caote_score(WEIGHTS, VALUES)
    tokens = [f"t{j}" for j in range(len(WEIGHTS))]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))

    left.scatter(VALUES[:, 0], VALUES[:, 1], s=3000 * WEIGHTS, alpha=0.5, color="tab:blue")
    for j, (x, y) in enumerate(VALUES.tolist()):
        left.annotate(f"v{j}  α={WEIGHTS[j]:.2f}", (x, y), textcoords="offset points", xytext=(8, 6))
        left.plot([x, output[0]], [y, output[1]], color="grey", lw=0.6, ls=":")
    left.scatter([output[0]], [output[1]], marker="*", s=250, color="tab:red", label="attention output X = Σ α_j v_j")
    left.set_title("values (dot size = attention α_j)")
    left.legend(loc="lower right", fontsize=8)

    width = 0.4
    positions = torch.arange(len(tokens)).float()
    left_shares = WEIGHTS / WEIGHTS.max()
    right.bar(positions - width / 2, left_shares, width, label="attention α_j (TOVA)", color="tab:blue")
    right.bar(
        positions + width / 2,
        scores / scores.max(),
        width,
        label="CAOTE c_j = α_j/(1-α_j)·‖X − v_j‖",
        color="tab:orange",
    )
    right.set_xticks(positions.tolist(), tokens)
    right.set_ylabel("score / max (higher = keep)")
    right.set_title("budget 5: attention evicts t1, CAOTE evicts t3")
    right.annotate(
        "evicted by CAOTE",
        (3 + width / 2, float(scores[3] / scores.max())),
        xytext=(3.3, 0.6),
        arrowprops=dict(arrowstyle="->"),
    )
    right.legend(fontsize=8)
    figure.tight_layout()
    TARGET.parent.mkdir(exist_ok=True)
    figure.savefig(TARGET, dpi=110)
    return TARGET


if __name__ == "__main__":
    print(main())
