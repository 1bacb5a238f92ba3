"""One-call generation under a bounded KV budget, the checks that refuse what the cache cannot serve, and the line
that tells a user what validation said of the predictor a policy reads."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from caote.attention import attention_modules
from caote.cache import CacheStats, EvictionCache
from caote.settings import FIELDS, CacheSettings, integer

# generate() options that need a cache which can be cropped, reordered or re-batched (EvictionCache cannot).
UNSUPPORTED_MODES = {
    "num_beams": ("beam search", lambda value: value is not None and value > 1),
    "num_beam_groups": ("diverse beam search", lambda value: value is not None and value > 1),
    "penalty_alpha": ("contrastive search", lambda value: value is not None and value > 0),
    "assistant_model": ("assisted decoding", lambda value: value is not None),
    "prompt_lookup_num_tokens": ("prompt-lookup decoding", lambda value: value is not None),
    "assistant_early_exit": ("self-speculative (early-exit) decoding", lambda value: value is not None),
    "dola_layers": ("DoLa decoding", lambda value: value is not None),
    "custom_generate": ("a custom generate method", lambda value: value is not None),
}
# generate() arguments caote.generate sets itself.
RESERVED_ARGUMENTS = (
    "cache",
    "past_key_values",
    "prefill_chunk_size",
    "use_cache",
    "input_ids",
    "inputs",
    "attention_mask",
)
_announced: set[str] = set()  # the predictor verdict lines this process has printed (`announce_predictor`)


@dataclass
class GenerationResult:
    """The decoded answer, its token ids and what the cache held."""

    text: str
    token_ids: list[int]
    stats: CacheStats


def check_max_new_tokens(max_new_tokens) -> int:
    """``max_new_tokens`` as an int when it is an integer >= 1 (``numpy.int64`` too); else a one-line `ValueError`."""
    return integer("max_new_tokens", max_new_tokens, 1)


def split_settings(settings: CacheSettings | None, options: dict) -> CacheSettings:
    """The cache settings of a call: ``settings``, or those named among ``options`` (removed from it; the rest are
    for ``model.generate``), built and validated once."""
    return CacheSettings.of(settings, **{name: options.pop(name) for name in FIELDS if name in options})


def check_model(model) -> None:
    """Refuse a model given by name or path (a string): it has to be loaded first, with `caote.models.load_model`."""
    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model)
        raise ValueError(
            f"model must be a loaded model, not the name {name!r}; load it first: "
            f"model, tokenizer = caote.models.load_model({name!r})"
        )


def check_tokenizer(tokenizer) -> None:
    """Refuse what is not a loaded tokenizer (None, a name, ...): `generate` calls it and decodes with it."""
    if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        named = tokenizer is None or isinstance(tokenizer, (str, os.PathLike))
        shown = repr(tokenizer) if named else f"an object of type {type(tokenizer).__name__}"
        raise ValueError(
            f"tokenizer must be a loaded tokenizer (model, tokenizer = caote.models.load_model(...)), got {shown}"
        )


def check_generate_options(model, options: dict) -> None:
    """Refuse, before any forward, the decoding modes that need to crop or reorder the cache, and the arguments
    that `generate` sets itself. Looks at ``options`` and at ``options["generation_config"]`` / the model's own
    generation config."""
    for name in RESERVED_ARGUMENTS:
        if name in options:
            raise ValueError(f"caote.generate sets {name!r} itself; do not pass it")
    configs = [options.get("generation_config"), getattr(model, "generation_config", None)]
    for name, (mode, active) in UNSUPPORTED_MODES.items():
        if name in options:
            value = options[name]
        else:
            value = next(
                (
                    getattr(config, name)
                    for config in configs
                    if config is not None and getattr(config, name, None) is not None
                ),
                None,
            )
        if active(value):
            shown = repr(value) if isinstance(value, (int, float, str)) else f"<{type(value).__name__}>"
            raise ValueError(
                f"{name}={shown} asks for {mode}, which an EvictionCache cannot serve (it cannot be cropped, "
                "reordered or re-batched); use greedy decoding or sampling with num_beams=1"
            )


def position_limit(model) -> int | None:
    """The longest sequence the model's position embeddings cover (``max_position_embeddings``), if known."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_length(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a prompt that, with the tokens to generate, exceeds the model's position limit: eviction bounds the
    memory, but positions stay absolute, so RoPE still has to cover every token seen."""
    limit = position_limit(model)
    if limit is None:
        return
    if prompt_tokens > limit:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens, more than the model's position limit "
            f"max_position_embeddings={limit}; shorten the prompt"
        )
    if prompt_tokens + max_new_tokens > limit:
        raise ValueError(
            f"the prompt ({prompt_tokens} tokens) plus max_new_tokens={max_new_tokens} exceeds the model's position "
            f"limit max_position_embeddings={limit}; lower max_new_tokens to at most {limit - prompt_tokens}"
        )


def encode_prompt(tokenizer, prompt_or_messages) -> torch.Tensor:
    """``(1, T)`` input ids: a string is tokenised as is; a list of chat messages goes through the chat template.

    Raises a one-line `ValueError` for an empty prompt or message list, a prompt of another type, or a tokenizer
    without a chat template when messages are given."""
    if isinstance(prompt_or_messages, str):
        if not prompt_or_messages.strip():
            raise ValueError("the prompt is empty")
        ids = tokenizer(prompt_or_messages, return_tensors="pt").input_ids
    elif isinstance(prompt_or_messages, (list, tuple)):
        if not prompt_or_messages:
            raise ValueError("the message list is empty")
        if all(isinstance(item, str) for item in prompt_or_messages):
            raise ValueError(
                f"caote.generate answers one prompt at a time, got a list of {len(prompt_or_messages)} strings: call "
                "it once per prompt (a list is taken as chat messages, dicts with 'role' and 'content')"
            )
        if not all(
            isinstance(message, dict) and "role" in message and "content" in message for message in prompt_or_messages
        ):
            raise ValueError(
                "chat messages must be dicts with 'role' and 'content', e.g. [{'role': 'user', 'content': '...'}]"
            )
        if not any(str(message["content"]).strip() for message in prompt_or_messages):
            raise ValueError("the prompt is empty: every message has empty content")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass the prompt as a plain string instead")
        ids = tokenizer.apply_chat_template(
            list(prompt_or_messages), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        raise ValueError(
            f"the prompt must be a string or a list of chat messages, got {type(prompt_or_messages).__name__}"
        )
    if ids.shape[-1] == 0:
        raise ValueError("the prompt is empty after tokenisation")
    return ids


def check_inputs(
    model, tokenizer, prompt_or_messages, max_new_tokens, settings: CacheSettings | None, options: dict
) -> tuple[torch.Tensor, CacheSettings, int]:
    """Every check of `generate`, before any forward, each a one-line `ValueError`. Returns the prompt's ``(1, T)``
    input ids, the cache settings (their fields are removed from ``options``; the rest are for ``model.generate``)
    and ``max_new_tokens`` as an int."""
    check_model(model)
    settings = split_settings(settings, options)
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    attention_modules(model)  # refuses unsupported architectures before anything runs
    check_generate_options(model, options)
    check_tokenizer(tokenizer)
    input_ids = encode_prompt(tokenizer, prompt_or_messages)
    check_length(model, input_ids.shape[-1], max_new_tokens)
    return input_ids, settings, max_new_tokens


def announce_predictor(model, *cells: CacheSettings) -> None:
    """Print to stderr, once per process and predictor, what validation said of each predictor ``cells`` read on
    ``model`` (a learned policy's, or the one auto resolves with; a model may ship one per range of budgets):
    whether it helps, or that it was never validated. Used by ``caote generate``, ``caote eval`` and the pipeline; a
    predictor that cannot serve the model is refused in one line (`CacheSettings.predictor_for`)."""
    for settings in cells:
        found = settings.predictor_for(model)
        if found is not None:
            line = found[0].verdict_line(found[1])
            if line not in _announced:
                _announced.add(line)
                print(line, file=sys.stderr)


def generate(
    model,
    tokenizer,
    prompt_or_messages,
    budget: int | None = None,
    policy: str | None = None,
    max_new_tokens: int = 64,
    block_size: int | None = None,
    *,
    settings: CacheSettings | None = None,
    return_stats: bool = False,
    streamer=None,
    **cache_and_generate_kwargs,
):
    """Answer ``prompt_or_messages`` with ``model`` while every layer keeps at most ``budget`` KV tokens.

    ``prompt_or_messages`` is a string (tokenised as is) or a list of chat messages (``[{"role": "user",
    "content": ...}]``, run through the tokenizer's chat template with the generation prompt). The prompt is
    consumed in blocks of ``block_size`` tokens (evicting after each; ``prefill="compress"``: whole, then evicted to
    the budget once) and every decoded token evicts one. The cache settings come as one `CacheSettings`
    (``settings=``) or as its fields: ``budget``, ``policy`` and ``block_size`` (also positional, as before) and the
    keywords ``prefill``, ``sink_tokens``, ``recent_window``, ``gqa``, ``decode_eviction_interval``, ``seed``
    (defaults in `caote.defaults`); every other keyword goes to ``model.generate`` (``do_sample``, ``temperature``,
    ...); decoding defaults to greedy.

    Every input is checked before the first forward (`check_inputs`): the settings, the model and the tokenizer
    (loaded ones, not names: use `caote.models.load_model`) and the model's class, the decoding mode (beam search,
    assisted / prompt-lookup decoding and contrastive search are refused, since the cache cannot be cropped or
    reordered), an empty prompt, a list of prompts and a prompt beyond the model's position limit each raise a
    one-line `ValueError`.

    Returns the text, or a `GenerationResult` (text, token ids, `CacheStats`) with ``return_stats=True``.
    """
    named = {"budget": budget, "policy": policy, "block_size": block_size}  # positional, as before CacheSettings
    cache_and_generate_kwargs.update({name: value for name, value in named.items() if value is not None})
    input_ids, settings, max_new_tokens = check_inputs(
        model, tokenizer, prompt_or_messages, max_new_tokens, settings, cache_and_generate_kwargs
    )
    result = generate_checked(
        model, tokenizer, input_ids, settings, max_new_tokens, streamer=streamer, **cache_and_generate_kwargs
    )
    return result if return_stats else result.text


def generate_checked(
    model, tokenizer, input_ids: torch.Tensor, settings: CacheSettings, max_new_tokens: int, streamer=None, **options
) -> GenerationResult:
    """`generate` after `check_inputs` (which returned ``input_ids``, ``settings`` and ``max_new_tokens``, and left
    in ``options`` only what goes to ``model.generate``): the answer, its ids and the cache's statistics."""
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    options.setdefault("pad_token_id", pad_token_id)
    new_ids, stats = generate_ids(model, input_ids, settings, max_new_tokens, streamer=streamer, **options)
    return GenerationResult(tokenizer.decode(new_ids, skip_special_tokens=True), new_ids, stats)


def generate_ids(
    model,
    input_ids: torch.Tensor,
    settings: CacheSettings,
    max_new_tokens: int,
    streamer=None,
    **generate_kwargs,
) -> tuple[list[int], CacheStats]:
    """The decoding core of `generate` (and of the evaluation runner): ``input_ids`` ``(1, T)`` answered under a
    fresh `EvictionCache` of ``settings``, the prompt consumed as ``settings.prefill`` says (blocks of
    ``settings.block_size``, or whole then compressed); greedy unless
    ``do_sample=True``.

    Checks nothing itself (`generate` checks first); keyword arguments go to ``model.generate``. Returns the new
    token ids and the cache's `CacheStats`."""
    input_ids = input_ids.to(model.device)
    generate_kwargs.setdefault("do_sample", False)
    if not generate_kwargs["do_sample"]:
        generate_kwargs.update(temperature=None, top_p=None, top_k=None)
    cache = EvictionCache(model, settings)
    cache.check_sequence_length(input_ids.shape[1] + max_new_tokens)
    with torch.no_grad(), cache:
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            cache=cache,
            prefill_chunk_size=settings.prefill_chunk_size,
            max_new_tokens=max_new_tokens,
            streamer=streamer,
            **generate_kwargs,
        )
    return output[0, input_ids.shape[1] :].tolist(), cache.stats()
