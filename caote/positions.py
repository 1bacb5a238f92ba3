"""The position a layer records for each of its slots: the token's absolute position (>= 0), or a sentinel."""

from __future__ import annotations

import torch

PADDING = -1  # left padding, or a token its row of a padded batch no longer holds (masked, `EvictionLayer.keep`)
FREE = -2  # a slot decoding in place that holds no token (`caote.slots`)
UNSEEN = -3  # `caote.slots.SlotBuffer.normed`: no norm taken for the slot yet


def held(positions: torch.Tensor) -> torch.Tensor:
    """Which slots hold a real token (neither padding nor free)."""
    return positions >= 0
