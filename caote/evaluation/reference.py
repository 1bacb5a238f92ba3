"""The full cache: the reference every policy x budget cell is compared with.

Every task runs ``full`` once per example (``budget`` None, stored as ``"full"`` in row keys) before the evicting
policies; a cache for ``full`` still gets a budget, `UNBOUNDED`, large enough never to matter.
"""

from __future__ import annotations

FULL = "full"
UNBOUNDED = 1 << 40


def with_reference(policies: list[str]) -> list[str]:
    """The policies to run: `FULL` first (the reference), then the rest in the given order."""
    return [FULL] + [policy for policy in policies if policy != FULL]
