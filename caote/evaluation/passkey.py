"""Pass keys in plain text: the retrieval prompts on-device runtimes are compared on.

A 5-digit pass key ("The pass key is 60494. Remember it. 60494 is the pass key.") hidden in repetitive filler at
depths from 20 to 90 %, asked for after the document, in plain text with no chat template ("... What is the pass
key? The pass key is"), answered greedily; scored by substring match. The same prompts as `caote.evaluation.niah`'s
pass keys but for the template. Protocols as in NIAH (``--protocols``: the question in the prompt, or asked after
the context was compressed).
"""

from __future__ import annotations

from caote.evaluation.niah import needle_task

NAME = "passkey"
DEFAULT_DEPTHS = (20, 28, 36, 43, 51, 59, 67, 74, 82, 90)  # ten depths evenly spaced over 20-90 %

TASK = needle_task(
    NAME,
    "Pass keys (plain text)",
    "pass keys",
    DEFAULT_DEPTHS,
    True,
    "Pass keys: a 5-digit key in repetitive filler, plain text",
)
