"""Default settings shared by the library and the command line, in a module that imports nothing.

`caote.cache` and `caote.policies` import torch; the ``caote`` parsers need these values for their ``--help`` defaults
without paying for torch and transformers, so they live here and both sides import them from this module.
"""

from __future__ import annotations

DEFAULT_BUDGET = 512  # KV tokens kept per full-attention layer (and per KV head)
DEFAULT_BLOCK_SIZE = 128  # prompt tokens per prefill block
DEFAULT_SINK_TOKENS = 4  # first tokens every policy keeps (attention sinks)
DEFAULT_GQA = "rss"  # how the CAOTE errors of a KV group's query heads combine (caote.value_aware.GQA_AGGREGATIONS)
DEFAULT_DECODE_EVICTION_INTERVAL = 1  # tokens evicted per scoring while decoding (the paper's: one per step)
DEFAULT_SEED = 0  # seed of the `random` policy
PAPER_BASES = ("h2o", "tova", "snapkv")  # the base policies of the CAOTE paper, each also with +caote / +fastcaote
# the policies the CAOTE paper evaluates (arXiv 2504.14051, Tables 1-4), in report order: listed here once, for the
# policy group "paper" (`caote.policies.POLICY_GROUPS`) and `caote bench`'s default policies (which need no torch)
PAPER_GROUP = ("full", "streamingllm") + tuple(f"{b}{t}" for b in PAPER_BASES for t in ("", "+caote", "+fastcaote"))
# the policy of EvictionCache, caote.generate, the pipeline and `caote generate` unless one is named: set by the
# standard grid of docs/results.md (see the README's "Which policy" paragraph)
DEFAULT_POLICY = "h2o+caote"
# the learned policy's calibration (`caote calibrate`, caote.evaluation.calibration): evicting passes at these budgets
# (on held-out dev essays one calibrated at 128 alone did as well at 256 as one calibrated at 128, 256 and 512, with a
# third of the evicting passes: docs/results.md), these feature groups (of caote.learned.FEATURE_GROUPS), texts of this
# domain's dev split
CALIBRATION_BUDGETS = (128,)
FEATURE_GROUPS = ("scalars", "key", "value")
DEFAULT_FEATURE_GROUPS = ("scalars", "key")
# rows weighted by (future mass / the group's mean) ** this (caote.evaluation.calibration.mass_weights); 0: unweighted
CALIBRATION_MASS_WEIGHT = 1.0
DEFAULT_CALIBRATION_DOMAIN = "code"  # on dev essays code beat essays (unweighted fit; weighted: not re-chosen)
