"""Default settings shared by the library and the command line, in a module that imports nothing.

`caote.cache` and `caote.policies` import torch; the ``caote`` parsers need these values for their ``--help`` defaults
without paying for torch and transformers, so they live here and both sides import them from this module.
"""

from __future__ import annotations

DEFAULT_BUDGET = 512  # KV tokens kept per full-attention layer (and per KV head)
DEFAULT_BLOCK_SIZE = 128  # prompt tokens per prefill block
# how a prompt is read (`caote.settings.CacheSettings.prefill`): in blocks, each evicted to the budget (the paper's), or
# whole with the full cache and compressed to the budget once (prefill, then compress)
PREFILL_MODES = ("blocks", "compress")
DEFAULT_PREFILL = "blocks"
DEFAULT_SINK_TOKENS = 4  # first tokens every policy keeps (attention sinks)
DEFAULT_GQA = "rss"  # how the CAOTE errors of a KV group's query heads combine (caote.value_aware.GQA_AGGREGATIONS)
DEFAULT_DECODE_EVICTION_INTERVAL = 1  # tokens evicted per scoring while decoding (the paper's: one per step)
DEFAULT_SEED = 0  # seed of the `random` policy
PAPER_BASES = ("h2o", "tova", "snapkv")  # the base policies of the CAOTE paper, each also with +caote / +fastcaote
# the policies the CAOTE paper evaluates (arXiv 2504.14051, Tables 1-4), in report order: listed here once, for the
# policy group "paper" (`caote.policies.POLICY_GROUPS`) and `caote bench`'s default policies (which need no torch)
PAPER_GROUP = ("full", "streamingllm") + tuple(f"{b}{t}" for b in PAPER_BASES for t in ("", "+caote", "+fastcaote"))
# the policy of EvictionCache, caote.generate, the pipeline and `caote generate` unless one is named: auto, since no
# one policy is best for every model and budget; it is resolved where the model is known (`caote.settings`)
AUTO_POLICY = "auto"
DEFAULT_POLICY = AUTO_POLICY
# auto's learned policy, for a model whose predictor's validation says it helps and names none (`caote.learned`)
AUTO_LEARNED = "learned+caote"
# auto's training-free policy by the long grid's budget (docs/results/long.md): a budget takes the choice of the grid
# budget nearest on a log scale (below 512, the geometric midpoint of 256 and 1024). Each is the lowest geometric mean
# over the complete perplexity parts (SmolLM2 essays and code at 4k, Gemma-3 essays and code at 8k) of the mean KL over
# 10 texts, among the training-free policies of the grid that decode at 0.9x or more of a full cache of the same size
# at 2k-8k in the committed `caote bench` run (benchmarks/results/results.json): at 256 tova+caote (0.0958 / 0.2801 /
# 0.0979 / 0.2669; decode 0.96x), at 1024 h2o+caote (0.0311 / 0.0798 / 0.0528 / 0.1320; 0.94x). The two of lower KL
# decode too slowly: caote-block (auto's choice has a 13 % higher geometric mean at 256) at 0.11x, snapkv+caote (10 %
# at 1024) at 0.63-0.67x. tests/test_auto.py recomputes the table from the committed rows and run.
AUTO_TRAINING_FREE = {256: "tova+caote", 1024: "h2o+caote"}
# auto's policy when the prompt is read whole, then compressed (prefill="compress", a retrieval setting): whole pages of
# 16 positions ranked by TOVA+CAOTE, which found on each of SmolLM2's plain-text pass-key prompts at 2k what the full
# cache found, at budgets 256 and 512 (docs/results/retrieval.md)
AUTO_COMPRESS = "tova+caote/page16"
# the learned policy's calibration (`caote calibrate`, caote.evaluation.calibration): evicting passes at these budgets
# (on held-out dev essays one calibrated at 128 alone did as well at 256 as one calibrated at 128, 256 and 512, with a
# third of the evicting passes: docs/learned.md), these feature groups (of caote.learned.FEATURE_GROUPS), texts of this
# domain's dev split
CALIBRATION_BUDGETS = (128,)
FEATURE_GROUPS = ("scalars", "key", "value")
DEFAULT_FEATURE_GROUPS = ("scalars", "key")
# rows weighted by (future mass / the group's mean) ** this (calibration.ridge.mass_weights); 0: unweighted
CALIBRATION_MASS_WEIGHT = 1.0
# what the predictor ranks by (caote.future.received): later queries' attention, or their output change were the token
# evicted alone
FUTURE_TARGETS = ("mass", "change")
CALIBRATION_TARGET = "mass"
CALIBRATION_ROUNDS = 2  # the second round evicts by the first round's predictor (on-policy rows; docs/learned.md)
# ... whose passes the first round's predictor only ranks, so the first round reads this share of the texts
CALIBRATION_FIRST_ROUND_SHARE = 0.25
CALIBRATION_LENGTH = 1024  # tokens per calibration excerpt, the standard grid's length ...
CALIBRATION_WINDOWS = 4  # ... or this many sliding windows for a model mixing sliding and full layers (Gemma-3: 2,048)
# the excerpts fitted on unless --count: this many tokens (24 of 1,024; the shipped predictors read 40 of 1,024, or 20
# of 2,048 for Gemma-3, and three times as much text did not help: docs/learned.md)
CALIBRATION_TOKENS = 24 * 1024
# --long-count excerpts besides those are this many times longer by default (SmolLM2: 4,096 tokens; Gemma-3: 8,192),
# the long grid's lengths; none by default: with 10 of 4,096 at budgets 128 and 1024, each length's rows weighed
# alike, SmolLM2's learned+caote closed 38 % of the oracle gap at budget 1024 on dev essays of 4,096 tokens instead of
# 20 %, and at 1,024 tokens 46 % instead of 51 % at budget 128, level or better at 256 / 512 (docs/learned.md, "Each
# excerpt length weighed alike"); SmolLM2 ships that fit for budgets from 256:
# caote/predictors/smollm2-135m-long.safetensors
CALIBRATION_LONG_FACTOR = 4
DEFAULT_CALIBRATION_DOMAIN = "code"  # on dev essays code beat essays (unweighted fit; weighted: not re-chosen)
