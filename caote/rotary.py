"""Undoing a model's rotary position embedding (RoPE) on its keys: the learned policy's key features read each token's
key as it was before RoPE turned it by the token's position (`caote.learned`)."""

from __future__ import annotations

import inspect
import sys
from typing import Callable

import torch
from torch import nn


def rotary_inverse(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(keys (B, H, N, d), positions (B, H, N)) -> keys before RoPE``, by the family's own rotary embedding and
    ``apply_rotary_pos_emb``: RoPE turns each pair of key channels by the angle of the token's position, ``k cos +
    rotate_half(k) sin`` (interleaved or partial in some families), so the same function with ``sin`` negated and
    both divided by the embedding's ``attention_scaling`` squared turns it back. Checked once on random keys; a
    family it cannot undo is refused in one line (calibrate with ``--features scalars`` there)."""
    rotary = next((module for name, module in model.named_modules() if name.endswith("rotary_emb")), None)
    attention = model.get_decoder().layers[0].self_attn
    apply = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None)
    if rotary is None or apply is None:
        raise ValueError(
            f"{type(model).__name__} has no rotary embedding to undo: the learned policy's key features need one "
            "(calibrate with --features scalars)"
        )
    layer_type = (
        {"layer_type": "full_attention"} if "layer_type" in inspect.signature(rotary.forward).parameters else {}
    )
    scaling = getattr(rotary, "attention_scaling", 1.0)  # per layer type where the embedding has several
    scale = float(getattr(rotary, "full_attention_attention_scaling", scaling) if layer_type else scaling) ** 2
    rope_type = getattr(rotary, "rope_type", "default")
    rope_type = rope_type.get("full_attention", "default") if isinstance(rope_type, dict) else rope_type
    # the angles of a position never change unless the embedding rescales with the length it has seen
    fixed = "dynamic" not in rope_type and rope_type != "longrope"
    tables: dict = {}  # fixed: per device, cos / scale and -sin / scale of positions 0, 1, ... (grown by doubling)

    def angles(keys: torch.Tensor, positions: torch.Tensor):
        batch, heads, tokens, _ = keys.shape
        cos, sin = rotary(keys, positions.reshape(batch * heads, tokens), **layer_type)
        return cos.float(), sin.float()

    def inverse_angles(keys: torch.Tensor, positions: torch.Tensor):
        if not fixed:
            cos, sin = angles(keys, positions)
            return cos / scale, -sin / scale
        needed = int(positions.max()) + 1
        table = tables.get(keys.device)
        if table is None or table[0].shape[0] < needed:
            length = max(needed, 1024 if table is None else 2 * table[0].shape[0])
            cos, sin = rotary(keys, torch.arange(length, device=keys.device).view(1, length), **layer_type)
            table = tables[keys.device] = (cos[0].float() / scale, -sin[0].float() / scale)
        flat = positions.reshape(-1, positions.shape[-1])
        return table[0][flat], table[1][flat]

    def unrotate(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch, heads, tokens, dim = keys.shape
        cos, sin = inverse_angles(keys, positions)
        flat = keys.reshape(batch * heads, 1, tokens, dim)
        return apply(flat, flat, cos, sin)[1].view(batch, heads, tokens, dim)

    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(1, 1, 6, attention.head_dim, generator=generator)
    positions = torch.tensor([[[0, 1, 7, 30, 200, 1000]]])
    try:
        cos, sin = angles(probe, positions)
        turned = apply(probe[0:1], probe[0:1], cos, sin)[1]
        exact = torch.allclose(unrotate(turned, positions), probe, atol=1e-4)
    except (RuntimeError, TypeError, ValueError):
        exact = False
    if not exact:
        raise ValueError(
            f"the learned policy cannot undo the RoPE of {type(model).__name__} by position (its key features need "
            "it): calibrate with --features scalars"
        )
    return unrotate
