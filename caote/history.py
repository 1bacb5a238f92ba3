"""What a base score remembers of the attention rows it has seen: small strategy objects, one per kind of memory.

A `BaseScore` names its history (`caote.policies`); each evicting layer keeps the tensor the history folds rows
into, ``(B, H_q, N)`` or ``(B, H_q, R, N)`` with the token axis last, and gathers it with the tokens it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from caote.scoring import accumulate_attention, keep_recent_rows


@dataclass(frozen=True)
class AttentionSum:
    """Every query row, summed per token (H2O's heavy hitters, Zhang et al., arXiv 2306.14048): ``(B, H_q, N)``."""

    def rows(self, new: int, retained: int, budget: int) -> int:
        """A running sum needs every row of every step."""
        return new

    def fold(self, history: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        return accumulate_attention(history, rows)

    def carries_over(self, block_rows: int) -> bool:
        """Rows of earlier forwards reach an eviction: always, for a running sum."""
        return True


@dataclass(frozen=True)
class RecentRows:
    """The newest ``window`` query rows (TOVA: 1, SnapKV: its observation window): ``(B, H_q, <=window, N)``."""

    window: int

    def rows(self, new: int, retained: int, budget: int) -> int:
        """Rows to compute this step: none while the layer holds ``budget - window`` tokens or fewer, since rows
        that old fall out of the window before the next eviction (which comes once the layer exceeds ``budget``)."""
        return min(self.window, new) if retained > budget - self.window else 0

    def fold(self, history: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        return keep_recent_rows(history, rows, self.window)

    def carries_over(self, block_rows: int) -> bool:
        """Rows of earlier forwards reach the eviction of a block of ``block_rows`` queries when the window is
        longer than the block."""
        return self.window > block_rows
