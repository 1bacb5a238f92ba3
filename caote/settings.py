"""`CacheSettings`: every setting of an `EvictionCache` in one frozen value, validated once where it is built.

Every entry point (``caote.generate``, the pipeline, ``caote generate``, the evaluation, the benchmark) builds one
and hands it on as it is; nothing downstream validates again. Each default is written once, in `caote.defaults`.

The policy ``"auto"`` (the default) is resolved in two steps: without a model, to the training-free policy of the
budget (`caote.policies.auto_training_free`); where the model is known (`CacheSettings.for_model`, called by
`caote.cache.EvictionCache`), to the learned policy when the model's predictor helps. With ``prefill="compress"``
auto is the paged policy for retrieval, `caote.defaults.AUTO_COMPRESS`, on every model.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from dataclasses import dataclass, field

from caote.defaults import (
    AUTO_COMPRESS,
    AUTO_LEARNED,
    AUTO_POLICY,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BUDGET,
    DEFAULT_DECODE_EVICTION_INTERVAL,
    DEFAULT_GQA,
    DEFAULT_POLICY,
    DEFAULT_PREFILL,
    DEFAULT_SEED,
    DEFAULT_SINK_TOKENS,
    PREFILL_MODES,
)
from caote.policies import Policy, auto_training_free, is_auto, parse_policy, policy_name
from caote.predictor import Predictor
from caote.value_aware import GQA_AGGREGATIONS

SEED_LIMIT = 2**63 - 1  # the largest seed torch.Generator.manual_seed takes


def integer(name: str, value, low: int, high: int | None = None) -> int:
    """``value`` as an int when it is integer-like (``int``, ``numpy.int64``, ...; not ``bool``, not ``1.0``) and in
    ``[low, high]``; else a one-line `ValueError` naming the setting and what is allowed."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return number


@dataclass(frozen=True)
class CacheSettings:
    """How an `EvictionCache` evicts.

    ``policy`` may be given as a name; it is stored parsed (`caote.policies.Policy`): ``"auto"`` is stored as its
    training-free choice for the budget, with ``auto`` True (see `for_model`). ``recent_window`` None means
    the policy's own window; ``recent`` is the window in effect (H2O: half the budget). ``gqa`` is overridden by a
    policy name ending in ``/<gqa>``; ``aggregation`` is the one in effect. ``seed`` None means the default.

    Fields
    ------
    budget:
        Tokens kept per full-attention layer (and per KV head) after each step (default 512). Sliding-window layers
        of hybrid models (Gemma-2/3, Cohere-2, ...) keep transformers' own sliding-window layer, bounded by its
        window.
    policy:
        ``"auto"`` (the default: the model's learned policy when its predictor's validation says it helps, else
        ``tova+caote`` below budget 512 and ``h2o+caote`` from 512, `caote.defaults.AUTO_TRAINING_FREE`; with
        ``prefill="compress"``, `caote.defaults.AUTO_COMPRESS`, whole pages for retrieval),
        ``"full"``, a base (``"streamingllm"``, ``"h2o"``, ``"tova"``, ``"snapkv"``, ...: ``caote policies`` lists
        them all) or ``"<base>+caote"`` / ``"<base>+fastcaote"`` (see `caote.policies`).
    block_size:
        Prompt block size that ``generate(prefill_chunk_size=...)`` should use (the paper's 128); a forward with more
        new tokens than this is allowed but logs a warning, since its attention is not bounded by the budget.
    prefill:
        How a prompt is read: ``"blocks"`` (the default, the paper's) in blocks of ``block_size``, each block evicted
        down to the budget, so no layer ever holds more than ``budget + block_size`` tokens; ``"compress"``
        (prefill, then compress) the whole prompt in one forward with the full cache, each layer evicted to the
        budget once right after its attention, so the scores read the whole prompt, its question included. Peak KV:
        one layer holds the whole prompt while the others hold the budget (`caote.cache.CacheStats`); decoding stays
        bounded as in ``"blocks"``. `prefill_chunk_size` is what ``generate`` takes for either.
    sink_tokens:
        The first positions, never evicted (StreamingLLM's attention sinks). Default 4.
    recent_window:
        The newest tokens, never evicted. Default: the policy's own (half the budget for H2O, SnapKV's 32-query
        window, else the newest token only).
    gqa:
        How CAOTE errors of the query heads sharing a KV head combine: ``"rss"`` (exact), ``"mean"`` or ``"max"``.
        Plain base scores are always averaged over the group. A policy name ending in ``/<gqa>`` sets it instead.
    seed:
        Seed of the ``random`` policy (its numbers are drawn on the CPU, whatever device each layer is on).
    predictor:
        A predictor file written by ``caote calibrate``, read by the ``learned`` policies and by ``auto`` when it
        resolves (`caote.learned`); None: the predictor committed for the model (each bundled model has one).
    decode_eviction_interval:
        Decoding evicts one token per step by default (1). With ``k > 1`` a step with one new token that overflows
        the budget evicts ``k`` tokens at once, so scoring runs every ``k`` steps; the cache then holds between
        ``budget - k + 1`` and ``budget`` tokens. Prompt blocks of two or more tokens evict down to ``budget``; a
        prompt whose last block has a single token counts it as a decode step (``generate`` does not tell the cache
        which forwards are prompt chunks).
    compile_decode:
        Opt-in (default False): decode steps in place compute their CAOTE / FastCAOTE errors (weighted output,
        distances, formula) in one kernel made by ``torch.compile``, a single pass over the values instead of a
        matrix product and a ``cdist``. Faster, not bit-identical: the errors differ from the exact eager default by
        float32 rounding (about 1e-7 relative), which can swap two nearly tied tokens. The first steps compile
        (seconds to a minute; on a CPU it needs a C++ compiler); prompt blocks stay eager.
    auto:
        Whether ``policy`` is auto's choice (set by ``policy="auto"``; `replace` keeps it unless a policy is named):
        a training-free policy is then chosen again for the budget, and a learned one is kept.
    """

    budget: int = DEFAULT_BUDGET
    policy: Policy | str = DEFAULT_POLICY
    block_size: int = DEFAULT_BLOCK_SIZE
    prefill: str = DEFAULT_PREFILL
    sink_tokens: int = DEFAULT_SINK_TOKENS
    recent_window: int | None = None
    gqa: str = DEFAULT_GQA
    decode_eviction_interval: int = DEFAULT_DECODE_EVICTION_INTERVAL
    seed: int | None = DEFAULT_SEED
    predictor: str | None = None
    compile_decode: bool = False
    auto: bool = False
    recent: int = field(init=False, repr=False)
    aggregation: str = field(init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.auto, bool):
            raise ValueError(f"auto must be True or False, got {self.auto!r}")
        auto = self.auto or is_auto(self.policy)
        budget = integer("budget", self.budget, 1)
        policy = self.policy if isinstance(self.policy, Policy) or is_auto(self.policy) else parse_policy(self.policy)
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {self.prefill!r}")
        if auto and self.prefill == "compress":  # retrieval: pages, whatever the model's predictor says
            policy = parse_policy(AUTO_COMPRESS)
        elif auto and not (isinstance(policy, Policy) and policy.reads_predictor):
            policy = parse_policy(auto_training_free(budget))
        values = {
            "policy": policy,
            "auto": auto,
            "budget": budget,
            "block_size": integer("block_size", self.block_size, 1),
            "sink_tokens": integer("sink_tokens", self.sink_tokens, 0),
            "recent_window": None if self.recent_window is None else integer("recent_window", self.recent_window, 0),
            "decode_eviction_interval": integer("decode_eviction_interval", self.decode_eviction_interval, 1),
            "seed": DEFAULT_SEED if self.seed is None else integer("seed", self.seed, 0, SEED_LIMIT),
        }
        if self.predictor is not None and not isinstance(self.predictor, (str, os.PathLike)):
            raise ValueError(f"predictor must be the path of a file written by caote calibrate, got {self.predictor!r}")
        if self.predictor is not None and not ((auto and self.prefill == "blocks") or policy.reads_predictor):
            raise ValueError(
                f"policy {policy.name!r} reads no predictor, so predictor={str(self.predictor)!r} would be ignored: "
                "use it with a learned policy (e.g. 'learned+caote') or 'auto' reading its prompt in blocks, or "
                "leave it out"
            )
        if not isinstance(self.compile_decode, bool):
            raise ValueError(f"compile_decode must be True or False, got {self.compile_decode!r}")
        if self.gqa not in GQA_AGGREGATIONS:
            raise ValueError(f"gqa must be one of {', '.join(GQA_AGGREGATIONS)}, got {self.gqa!r}")
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "aggregation", policy.gqa or self.gqa)
        object.__setattr__(self, "recent", self._check_room(policy))

    def _check_room(self, policy: Policy) -> int:
        """The recent window in effect; refuses a budget that leaves an evicting policy nothing to choose from, and a
        page larger than the room it leaves (auto's pages shrink to that room instead)."""
        if not policy.evicts:  # the full cache never evicts: any budget serves it
            return 0 if self.recent_window is None else self.recent_window
        recent = self.recent_window
        if recent is None:
            default = policy.base.recent_window
            recent = int(default * self.budget) if isinstance(default, float) else default
        resolved = f" (policy auto resolved to {policy.name!r})" if self.auto else ""
        protected = f"sink_tokens + recent_window = {self.sink_tokens} + {recent}{resolved}"
        if self.budget <= self.sink_tokens + recent:
            raise ValueError(f"budget {self.budget} leaves no room to choose: it must exceed {protected}")
        if self.budget - self.decode_eviction_interval + 1 <= self.sink_tokens + recent:
            raise ValueError(
                f"decode_eviction_interval {self.decode_eviction_interval} is too large for budget {self.budget}: "
                f"budget - interval + 1 must exceed {protected}"
            )
        room = self.budget - self.sink_tokens - recent
        if policy.page is not None and policy.page > room and self.auto:  # auto's pages shrink to fit a small budget
            policy = parse_policy(policy_name(policy.base_name, policy.transform, policy.gqa, room))
            object.__setattr__(self, "policy", policy)
        if policy.page is not None and policy.page > room:
            raise ValueError(
                f"page size {policy.page} of policy {policy.name!r} is larger than the {room} tokens budget "
                f"{self.budget} leaves to choose from ({protected}): choose pages of at most {room}"
            )
        return recent

    @classmethod
    def of(cls, settings: CacheSettings | None = None, **values) -> CacheSettings:
        """``settings`` as given, or new settings from keyword ``values`` (unknown names refused in one line); both
        at once is an error, since it would be unclear which wins."""
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            raise ValueError(f"unknown cache setting(s) {', '.join(unknown)}; the settings are {', '.join(FIELDS)}")
        if settings is None:
            return cls(**values)
        if not isinstance(settings, CacheSettings):
            raise ValueError(f"settings must be a CacheSettings, got {type(settings).__name__}")
        if values:
            raise ValueError(
                f"give either settings= or the separate setting(s) {', '.join(sorted(values))}, not both "
                "(use settings.replace(...) to change a few)"
            )
        return settings

    def replace(self, **changes) -> CacheSettings:
        """A copy with ``changes`` applied and validated (the policy's recent window follows a new budget, and so does
        auto's training-free choice; a policy named anew is no longer auto's)."""
        if "policy" in changes:
            changes.setdefault("auto", False)
        return dataclasses.replace(self, **changes)

    @property
    def requested(self) -> str:
        """The policy asked for: ``"auto"``, or the policy's own name."""
        return AUTO_POLICY if self.auto else self.policy.name

    def predictor_for(self, model) -> tuple[Predictor, str] | None:
        """The predictor these settings read on ``model`` (a learned policy's, or the one auto resolves with) and
        where it comes from, for `caote.predictor.Predictor.verdict_line`: the file ``predictor`` names, else the one
        shipped for the model. None when they read none, or auto finds none shipped; a file that cannot serve the
        model (named or shipped) is refused in one line, as is a learned policy without a predictor."""
        if not ((self.auto and self.prefill == "blocks") or self.policy.reads_predictor):
            return None
        if self.predictor is None and not self.policy.reads_predictor:  # auto, asking only for a shipped one
            predictor = Predictor.shipped_for(model, self.budget)
            if predictor is None:
                return None
        else:
            predictor = Predictor.for_model(model, self.predictor, self.budget)
        return predictor, repr(str(self.predictor)) if self.predictor else predictor.shipped_source

    def for_model(self, model) -> CacheSettings:
        """These settings as ``model`` runs them: auto upgraded to the learned policy its predictor's validation
        names when the verdict is that it helps (`caote.predictor.Predictor.helps`) and the prompt is read in blocks,
        else as they are."""
        found = self.predictor_for(model) if self.auto else None  # None with prefill="compress": auto reads none
        if found is None or not found[0].helps:
            return self
        return self.replace(policy=found[0].validation.get("learned", AUTO_LEARNED), auto=True)

    @property
    def prefill_chunk_size(self) -> int | None:
        """What ``model.generate(prefill_chunk_size=...)`` takes: ``block_size``, or None (the whole prompt in one
        forward) when ``prefill`` is ``"compress"``."""
        return self.block_size if self.prefill == "blocks" else None

    def kept_after(self, new_tokens: int) -> int:
        """How many tokens a layer keeps when a forward of ``new_tokens`` overflows the budget: ``budget`` after a
        prompt block, ``budget - interval + 1`` after a decode step (so scoring runs every ``interval`` steps)."""
        return self.budget if new_tokens > 1 else self.budget - self.decode_eviction_interval + 1


# the settings a caller names (``auto`` is set by naming the policy "auto")
FIELDS = tuple(item.name for item in dataclasses.fields(CacheSettings) if item.init and item.name != "auto")
