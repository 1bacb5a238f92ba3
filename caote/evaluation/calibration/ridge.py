"""The fit: weighted ridge regression per (layer, KV head) from normal equations.

Rows are weighted (`mass_weights`): evicting a token costs about the attention it would have received, so a
least-squares fit of the log mass that weighs every candidate alike spends itself on ordering tokens that no later
query reads; weighing each row by its future mass relative to its eviction's mean, to the power ``mass_weight``,
moves the fit to the tokens whose eviction would be felt. Only ``X^T X``, ``X^T y`` and ``y^T y`` of the rows
(centred within their eviction on the weighted means) are kept, so memory does not grow with the text. The ridge
strength of each head is the one with the least squared error on the held-out texts (`ridge_strength`); the final
fit reads every text (`solve_heads`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RIDGE_STRENGTHS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
DEFAULT_STRENGTH = 1e-2  # a head without held-out rows to choose by
HELD_OUT_EVERY = 4  # every 4th calibration text chooses the ridge strengths
# relative weights are clipped to this range before they are scaled to mean 1: it bounds how far apart two rows of a
# group can weigh (400x), which limits how much of a fit the few heaviest tokens can decide
MASS_WEIGHT_RANGE = (0.05, 20.0)
MASS_WEIGHT_MOST = 4  # the largest power `calibrate` accepts (at 2 the heaviest few tokens already decide each fit)
DEAD_COLUMN = 1e-4  # a feature column this much smaller than the median one (root mean square) holds rounding only


@dataclass
class NormalEquations:
    """``X^T X``, ``X^T y``, ``y^T y`` and the row count of one (layer, KV head), in float64; rows arrive already
    scaled by the square roots of their weights, so these are the weighted sums."""

    xtx: torch.Tensor
    xty: torch.Tensor
    yty: float = 0.0
    rows: float = 0  # the rows' total weight: their number unless `scaled`

    @classmethod
    def empty(cls, width: int) -> NormalEquations:
        return cls(torch.zeros(width, width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64))

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.add_sums(x.T @ x, x.T @ y, float(y @ y), x.shape[0])

    def add_sums(self, xtx: torch.Tensor, xty: torch.Tensor, yty: float, rows: float) -> None:
        """Add rows given by their sums (``X^T X``, ``X^T y``, ``y^T y``) and their count."""
        self.xtx += xtx
        self.xty += xty
        self.yty += yty
        self.rows += rows

    def scaled(self, factor: float) -> NormalEquations:
        """These rows, each weighing ``factor`` times as much (``rows`` counts the weight)."""
        return NormalEquations(self.xtx * factor, self.xty * factor, self.yty * factor, self.rows * factor)

    def __iadd__(self, other: NormalEquations) -> NormalEquations:
        self.add_sums(other.xtx, other.xty, other.yty, other.rows)
        return self

    def solve(self, strength: float) -> torch.Tensor:
        """Ridge weights on standardised columns (each scaled by its root mean square), returned unscaled. A column
        whose root mean square is below `DEAD_COLUMN` times the median column's gets weight 0: it holds rounding
        noise (a key channel the model's norm zeroes, undone from RoPE), which standardising would blow up into a
        weight of 1e5-1e6 that a half-precision cache's rounding then turns into noise in every prediction."""
        scale = (self.xtx.diagonal() / max(self.rows, 1)).sqrt()
        live = scale > DEAD_COLUMN * scale.median()
        weights = torch.zeros_like(self.xty)
        if not live.any():
            return weights
        kept = scale[live]
        gram = self.xtx[live][:, live] / (kept[:, None] * kept[None, :]) / max(self.rows, 1)
        gram += strength * torch.eye(gram.shape[0], dtype=gram.dtype)
        weights[live] = torch.linalg.solve(gram, self.xty[live] / kept / max(self.rows, 1)) / kept
        return weights

    def squared_error(self, weights: torch.Tensor) -> float:
        """Mean squared error of ``weights`` on these rows: ``(y^T y - 2 w^T X^T y + w^T X^T X w) / n`` (weighted as
        the rows are: `mass_weights` average 1 per group, so it is the weighted mean; not comparable with the error
        of a predictor fitted with another ``mass_weight``)."""
        error = self.yty - 2 * float(weights @ self.xty) + float(weights @ self.xtx @ weights)
        return error / max(self.rows, 1)


def check_mass_weight(power: float, name: str = "mass_weight") -> None:
    """Refuse a ``mass_weight`` outside ``[0, MASS_WEIGHT_MOST]`` (``name``: how the caller spells it)."""
    if not 0 <= power <= MASS_WEIGHT_MOST:
        raise ValueError(f"{name} must lie in [0, {MASS_WEIGHT_MOST}], got {power}")


def mass_weights(target: torch.Tensor, power: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Row weights of each group (the last dimension) from its targets ``log(EPSILON + future mass)``:
    ``(m / mean m) ** power`` clipped to `MASS_WEIGHT_RANGE`, then scaled to mean 1 (so the ridge strengths keep
    their meaning). ``rows``: a boolean mask of the rows each group holds (the others weigh 0); None: all."""
    rows = torch.ones_like(target, dtype=torch.bool) if rows is None else rows
    count = rows.sum(-1, keepdim=True).clamp(min=1)
    mass = torch.where(rows, target.exp(), 0)
    relative = (mass / (mass.sum(-1, keepdim=True) / count)).pow(power).clamp(*MASS_WEIGHT_RANGE)
    relative = torch.where(rows, relative, 0)
    return relative / (relative.sum(-1, keepdim=True) / count)


def centred(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``(..., N, F)`` and targets ``(..., N)`` less their means over ``N`` weighted by ``weights``."""
    total = weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)
    x_mean = (weights[..., None] * x).sum(-2, keepdim=True) / total[..., None]
    return x - x_mean, y - (weights * y).sum(-1, keepdim=True) / total


def weighted_rows(x: torch.Tensor, y: torch.Tensor, power: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One group's features ``(N, F)`` and targets ``(N,)`` `centred` on their `mass_weights` to ``power``, and
    those weights (in the targets' dtype)."""
    weights = mass_weights(y.double(), power).to(y.dtype)
    return *centred(x, y, weights), weights


def weighted_sums(
    x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, power: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(X^T X, X^T y, y^T y)`` of each group's ``rows`` (boolean ``(G, N)``) of features ``x`` ``(G, N, F)`` and
    targets ``y`` ``(G, N)``, in float64: `centred` on the group's weighted means and weighted by `mass_weights` to
    ``power``; shapes ``(G, F, F)``, ``(G, F)``, ``(G,)``."""
    x, y = x.double(), y.double()
    weights = mass_weights(y, power, rows)
    x, y = centred(torch.where(rows[..., None], x, 0), torch.where(rows, y, 0), weights)
    root = weights.sqrt()  # 0 outside ``rows``: those rows add nothing
    x, y = x * root[..., None], y * root
    return x.transpose(-1, -2) @ x, (x.transpose(-1, -2) @ y[..., None])[..., 0], (y * y).sum(-1)


def ridge_strength(fit: NormalEquations, held: NormalEquations | None) -> tuple[float, float | None]:
    """The strength of `RIDGE_STRENGTHS` whose fit on ``fit`` has the least squared error on ``held``, and that
    error; `DEFAULT_STRENGTH` and None when there are no held-out rows."""
    if held is None or not held.rows:
        return DEFAULT_STRENGTH, None
    errors = {strength: held.squared_error(fit.solve(strength)) for strength in RIDGE_STRENGTHS}
    strength = min(errors, key=errors.get)
    return strength, errors[strength]


def solve_heads(totals: dict, layers: int, width: int) -> tuple[torch.Tensor, dict, float, float]:
    """``(weights, strengths, held_out_mse, held_out_variance)`` from ``totals`` (``(part, layer, head)`` ->
    `NormalEquations`, part ``fit`` or ``held_out``): per head the strength chosen on the held-out rows, then the
    fit on every row; weights ``(layers, heads, width)``, zero for a head without fitted rows."""
    heads = sorted({head for _, _, head in totals})
    weights = torch.zeros(layers, len(heads), width)
    chosen, held_out_error, baseline_error = {}, [], []
    for layer in sorted({layer for _, layer, _ in totals}):
        for head in heads:
            fit = totals.get(("fit", layer, head))
            held = totals.get(("held_out", layer, head))
            if fit is None:
                continue
            strength, error = ridge_strength(fit, held)
            if error is not None:
                held_out_error.append(error)
                baseline_error.append(held.yty / held.rows)
            every = NormalEquations.empty(width)
            every += fit
            if held is not None:
                every += held
            weights[layer, head] = every.solve(strength).float()
            chosen[f"{layer}.{head}"] = strength
    mean_error = sum(held_out_error) / max(len(held_out_error), 1)
    return weights, chosen, mean_error, sum(baseline_error) / max(len(baseline_error), 1)
