"""Attention-output fidelity: how far each layer's attention output moves when the cache evicts.

CAOTE ranks tokens by how much evicting them changes the attention output. This module measures that quantity
end to end: a prompt is consumed block by block twice in lockstep (`caote.evaluation.lockstep`), once with the full
cache and once under the policy, and for every layer ``i`` the output of its attention module
(`caote.attention.attention_modules`; its ``output[0]``, after ``o_proj``) is captured with a forward hook. Per
layer, the relative error is

    ||O_policy - O_full||_F / ||O_full||_F

over all tokens of the blocks that attend a cache from which something has been evicted (blocks starting after
position ``budget``). The inputs of layer ``i > 0`` differ too (earlier layers' errors propagate), so this is the
error a user sees, not the one-step error CAOTE's score bounds. The mean over layers is the headline number.
"""

from __future__ import annotations

import torch
from torch import nn

from caote.attention import attention_modules


class AttentionCapture:
    """Forward hooks that keep every layer's attention output of a forward until `take` (a context manager: hooks
    are removed on exit).

    Only a layer's first output since the last `take` is kept: the forwards a forward runs inside itself
    (caote-ahead's one-token draft, after the block's layers) must not replace the block's outputs."""

    def __init__(self, model: nn.Module):
        self.modules = attention_modules(model)
        self.outputs: list[torch.Tensor | None] = [None] * len(self.modules)
        self._handles = []

    def __enter__(self) -> "AttentionCapture":
        for index, module in enumerate(self.modules):
            self._handles.append(module.register_forward_hook(self._hook(index)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, index: int):
        def hook(module, args, output):
            if self.outputs[index] is not None:  # a nested forward of the same block
                return
            value = output[0] if isinstance(output, tuple) else output
            self.outputs[index] = value.detach().float()

        return hook

    def take(self) -> list[torch.Tensor]:
        """The outputs of the forward run since the last call (and forget them)."""
        outputs, self.outputs = self.outputs, [None] * len(self.modules)
        if any(output is None for output in outputs):
            raise RuntimeError("an attention module did not run in the last forward")
        return outputs


class FidelityMeter:
    """Accumulates ``||O_policy - O_full||^2`` and ``||O_full||^2`` per layer over the measured blocks."""

    def __init__(self, layers: int):
        self.error = torch.zeros(layers, dtype=torch.float64)
        self.reference = torch.zeros(layers, dtype=torch.float64)
        self.blocks = 0
        self.per_block: list[float] = []  # per measured block: relative error averaged over layers

    def add(self, policy_outputs: list[torch.Tensor], full_outputs: list[torch.Tensor]) -> None:
        """One block's outputs of every layer, under the policy and under the full cache (same shapes: a
        broadcast would compare other tokens' outputs)."""
        block = []
        for index, (policy, full) in enumerate(zip(policy_outputs, full_outputs)):
            if policy.shape != full.shape:
                raise ValueError(f"layer {index}: policy output {tuple(policy.shape)} vs full {tuple(full.shape)}")
            error = (policy - full).double().pow(2).sum()
            reference = full.double().pow(2).sum()
            self.error[index] += error
            self.reference[index] += reference
            block.append(float(error.sqrt() / reference.sqrt().clamp_min(1e-30)))
        self.per_block.append(sum(block) / len(block))
        self.blocks += 1

    def per_layer(self) -> list[float] | None:
        """Relative error of every layer, or None when no block was measured."""
        if self.blocks == 0:
            return None
        return (self.error.sqrt() / self.reference.sqrt().clamp_min(1e-30)).tolist()

    def mean(self) -> float | None:
        values = self.per_layer()
        return None if values is None else float(sum(values) / len(values))


def measured(block_start: int, budget: int | None) -> bool:
    """Whether the block starting at ``block_start`` attends an evicted cache (always true for the full cache,
    whose error is measured over every block and must be 0)."""
    return budget is None or block_start > budget
