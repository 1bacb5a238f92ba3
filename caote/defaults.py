"""Default settings shared by the library and the command line, in a module that imports nothing.

`caote.cache` and `caote.policies` import torch; the ``caote`` parsers need these values for their ``--help`` defaults
without paying for torch and transformers, so they live here and both sides import them from this module.
"""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 128  # prompt tokens per prefill block
DEFAULT_SINK_TOKENS = 4  # first tokens every policy keeps (attention sinks)
PAPER_BASES = ("h2o", "tova", "snapkv")  # the base policies of the CAOTE paper, each also with +caote / +fastcaote
