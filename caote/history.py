"""What a base score remembers of the attention rows it has seen: small strategy objects, one per kind of memory.

A `BaseScore` names its history (`caote.policies`); each evicting layer keeps the tensor the history folds rows
into, ``(B, H_q, N)`` or ``(B, H_q, R, N)`` with the token axis last, and gathers it with the tokens it keeps.
``fold(history, rows, in_place, seen)``: ``in_place`` says the layer decodes in place, so its history is its own (a
snapshot copies it) and may be written; ``seen`` is how many tokens the layer has seen, these rows' queries included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from caote.base_scores import accumulate_attention, keep_recent_rows


@dataclass(frozen=True)
class AttentionSum:
    """Every query row, summed per token (H2O's heavy hitters, Zhang et al., arXiv 2306.14048): ``(B, H_q, N)``."""

    def rows(self, new: int, retained: int, budget: int) -> int:
        """A running sum needs every row of every step."""
        return new

    def fold(self, history: torch.Tensor | None, rows: torch.Tensor, in_place: bool = False, seen: int = 0):
        if in_place and history is not None and history.shape[-1] == rows.shape[-1]:  # the same slots: add to them
            return history.add_(rows.sum(-2))
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

    def fold(self, history: torch.Tensor | None, rows: torch.Tensor, in_place: bool = False, seen: int = 0):
        return keep_recent_rows(history, rows, self.window)

    def carries_over(self, block_rows: int) -> bool:
        """Rows of earlier forwards reach the eviction of a block of ``block_rows`` queries when the window is
        longer than the block."""
        return self.window > block_rows


# rows of `SumAndRecent`'s tensor
KEY_TERM, KEY_TERM_POSITION, PREDICTION, PREDICTION_POSITION, NEWEST, RECENT_START = 3, 4, 5, 6, 7, 8


@dataclass(frozen=True)
class SumAndRecent:
    """What the ``learned`` base reads (`caote.learned`), in one tensor ``(B, H_q, 8 + <=window, N)``: row 0 the
    running sum of every row (H2O's), row 1 the sum and row 2 the maximum of the newest prompt block's rows (kept
    through decode steps, which fold into rows 0, 7 and 8+ only), row 3 the token's key term of the predictor and row 4
    the position it was computed for, plus one (0: none yet; `caote.learned.LayerPredictor.remember_keys` fills
    them), row 5 the token's last predicted log future mass and row 6 its position plus one (`caote.learned.
    LayerPredictor.predict`), row 7 the newest row, rows 8+ the newest ``window`` rows as a ring: the row of the
    ``c``-th query the layer has seen sits at ``8 + c % window``, so a decode step overwrites the oldest row in
    place instead of moving the window (what reads them is blind to their order: sums and maxima). Rows 3-6
    travel with the token like every row."""

    window: int

    def rows(self, new: int, retained: int, budget: int) -> int:
        """Every row of every step (the running sum's)."""
        return new

    def fold(self, history: torch.Tensor | None, rows: torch.Tensor, in_place: bool = False, seen: int = 0):
        tokens, new = rows.shape[-1], rows.shape[-2]
        full_window = history is not None and history.shape[2] == RECENT_START + self.window
        if in_place and full_window and new == 1 and history.shape[-1] == tokens:  # a decode step's row
            row = rows[:, :, 0]
            history[:, :, 0].add_(row)
            history[:, :, NEWEST] = row
            history[:, :, RECENT_START + (seen - 1) % self.window] = row
            return history
        batch, heads = rows.shape[:2]
        old = 0 if history is None else history.shape[-1]
        earlier = 0 if history is None else history.shape[2] - RECENT_START  # recent rows held so far
        window = min(self.window, earlier + new)
        folded = rows.new_empty(batch, heads, RECENT_START + window, tokens)  # every row written below
        block_sum = rows.sum(-2)
        folded[:, :, 0] = block_sum
        if history is not None:
            folded[:, :, 0, :old] += history[:, :, 0]
        if new > 1 or history is None:
            folded[:, :, 1] = block_sum
            folded[:, :, 2] = rows.amax(-2)
        # the rows remembered per token (the block's, when a decode step keeps them; key terms, predictions)
        kept = slice(KEY_TERM if new > 1 or history is None else 1, NEWEST)
        if history is not None:
            folded[:, :, kept, :old] = history[:, :, kept]
        folded[:, :, kept, old:] = 0.0  # new tokens: no key term nor prediction yet
        folded[:, :, NEWEST] = rows[:, :, -1]
        if new >= self.window:  # the window is this forward's newest rows: written straight into their ring slots
            arrival = rows[:, :, -self.window :]
            turn = seen % self.window
            folded[:, :, RECENT_START + turn :] = arrival[:, :, : self.window - turn]
            folded[:, :, RECENT_START : RECENT_START + turn] = arrival[:, :, self.window - turn :]
        else:
            previous = None if history is None else self._ring(history[:, :, RECENT_START:], -(seen - new))
            folded[:, :, RECENT_START:] = self._ring(keep_recent_rows(previous, rows, self.window), seen)
        return folded

    def _ring(self, recent: torch.Tensor, seen: int) -> torch.Tensor:
        """A full window of rows in arrival order, the oldest first, as the ring of ``seen`` queries (``-seen``: a
        ring back into arrival order); a window not yet full holds every row so far, the same in both orders."""
        if recent.shape[-2] < self.window:
            return recent
        return recent.roll(seen % self.window if seen >= 0 else -(-seen % self.window), dims=-2)

    def carries_over(self, block_rows: int) -> bool:
        """Rows of earlier forwards reach an eviction: always, for the running sum."""
        return True


def newest_recent_rows(history: torch.Tensor, positions: torch.Tensor, count: int) -> torch.Tensor:
    """The newest ``count`` of the ring rows of `SumAndRecent`'s ``history`` ``(B, H_q, <=count, N)``, in any order
    (whatever reads them sums or maximises over them). A ring of ``w`` rows holds the ``c``-th query at ``c % w``
    once full, and every row so far in arrival order before (``w`` = the queries seen), so the newest rows sit at
    ``c % w`` for the last ``count`` queries either way; the queries seen are the newest position held plus one."""
    recent = history[:, :, RECENT_START:]
    rows = recent.shape[2]
    if rows <= count:
        return recent
    seen = int(positions.amax()) + 1
    newest = torch.arange(seen - count, seen, device=recent.device) % rows
    return recent.index_select(2, newest)
