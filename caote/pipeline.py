"""The ``caote-text-generation`` transformers pipeline: several questions answered from one compressed context.

Registered when ``caote`` is imported (lazily: right after ``transformers.pipelines`` is first imported, see
`caote._registration`; importing this module registers it too)::

    import caote
    from transformers import pipeline

    pipe = pipeline("caote-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, questions=["Who?", "When?"], budget=256, policy="snapkv+caote")  # {"answers": [...]}

The context is prefilled once, block by block, into an `EvictionCache` (so its memory never exceeds the budget);
the compressed state is snapshotted, and each question is answered by a greedy loop from that snapshot, which is
restored before the next question. The prefill therefore runs once however many questions there are.

What the budget covers (``compress``): by default (``"all"``) the cache keeps evicting while it reads the question
and writes the answer, so memory never exceeds ``budget + block_size`` tokens per layer, and the context keeps about
a question's length fewer tokens. ``compress="context"`` is kvpress's behaviour: the context is compressed to the
budget, then the question and the answer grow the cache uncompressed (memory reaches budget + question + answer).
Compare policies with kvpress's numbers under ``"context"``.

Chat templates are handled like kvpress: the template is applied to ``context + SEPARATOR`` and split at the
separator, so the template's head (system prompt, user header) goes with the context and its tail (end of turn,
assistant header) goes after every question.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from caote.cache import EvictionCache
from caote.generation import announce_predictor, check_length, check_max_new_tokens
from caote.settings import FIELDS, CacheSettings

TASK = "caote-text-generation"
COMPRESS = ("all", "context")  # what the budget covers: context, question and answer; or the context only (kvpress)
SEPARATOR = "\n\n<<<caote-question-separator>>>\n\n"


def split_chat_template(tokenizer, context: str) -> tuple[str, str]:
    """``(context_text, question_suffix)``: the chat template applied to ``context + SEPARATOR`` as one user message
    with the generation prompt, split at the separator. Without a chat template: ``(context, "")``."""
    if not getattr(tokenizer, "chat_template", None):
        return context, ""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": context + SEPARATOR}], add_generation_prompt=True, tokenize=False
    )
    if text.count(SEPARATOR) != 1:
        raise ValueError("the tokenizer's chat template altered the question separator; pass chat=False")
    head, tail = text.split(SEPARATOR)
    return head, tail


class CaoteTextGenerationPipeline(Pipeline):
    """Answer one or more questions about a context from a single compressed prefill.

    Call: ``pipe(context, question=None, questions=None, max_new_tokens=50, answer_prefix="", chat=None,
    compress="all", return_stats=False, settings=None, budget=..., policy=..., block_size=..., sink_tokens=...,
    recent_window=..., gqa=..., decode_eviction_interval=..., seed=...)``: the cache settings as one `CacheSettings`
    or as its fields (defaults in `caote.defaults`). Returns ``{"answer": str}`` for ``question`` (or none) and
    ``{"answers": [str, ...]}`` for ``questions``; with ``return_stats=True`` also ``"stats"``: the `CacheStats`
    after the context and after each answer. ``chat=None`` uses the chat template when the tokenizer has one.
    ``compress``: what the budget covers (see the module docstring). Decoding is greedy, batch size 1. A predictor
    the cache reads (a learned policy's, or the one ``auto`` resolves with) has its validation verdict printed to
    stderr once (`caote.generation.announce_predictor`).
    """

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(
        self,
        question=None,
        questions=None,
        answer_prefix: str = "",
        chat=None,
        max_new_tokens: int = 50,
        compress: str = "all",
        return_stats: bool = False,
        settings: CacheSettings | None = None,
        **kwargs,
    ):
        unknown = sorted(set(kwargs) - set(FIELDS))
        if unknown:
            raise ValueError(
                f"unknown argument(s) {', '.join(unknown)} for the {TASK} pipeline; "
                f"cache settings are {', '.join(FIELDS)}"
            )
        if question is not None and questions is not None:
            raise ValueError("give either question or questions, not both")
        if compress not in COMPRESS:
            raise ValueError(f"compress must be one of {', '.join(map(repr, COMPRESS))}, got {compress!r}")
        if questions is not None:
            if isinstance(questions, str) or not questions or not all(isinstance(q, str) for q in questions):
                raise ValueError("questions must be a non-empty list of strings")
            items = list(questions)
        else:
            if question is not None and not isinstance(question, str):
                raise ValueError(f"question must be a string, got {type(question).__name__}")
            items = [question or ""]
        settings = CacheSettings.of(settings, **kwargs)
        check_max_new_tokens(max_new_tokens)
        preprocess = {"questions": items, "answer_prefix": answer_prefix, "chat": chat}
        forward = {"settings": settings, "max_new_tokens": max_new_tokens, "compress": compress}
        postprocess = {"single": questions is None, "return_stats": return_stats}
        return preprocess, forward, postprocess

    def preprocess(self, context, questions=("",), answer_prefix="", chat=None):
        if not isinstance(context, str) or not context.strip():
            raise ValueError("the context must be a non-empty string")
        if chat is True and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat=True but the tokenizer has no chat template")
        if chat is False:
            head, tail = context, ""
        else:
            head, tail = split_chat_template(self.tokenizer, context)
        templated = bool(tail)
        context_ids = self.tokenizer(head, return_tensors="pt", add_special_tokens=not templated).input_ids
        question_ids = [
            self.tokenizer(question + tail + answer_prefix, return_tensors="pt", add_special_tokens=False).input_ids
            for question in questions
        ]
        return {"context_ids": context_ids, "question_ids": question_ids}

    def _forward(self, model_inputs, settings: CacheSettings | None = None, max_new_tokens=50, compress="all"):
        settings = settings or CacheSettings()
        block_size = settings.prefill_chunk_size  # None: each prompt part whole (prefill, then compress)
        context_ids = model_inputs["context_ids"]
        question_ids = model_inputs["question_ids"]
        longest = max(ids.shape[-1] for ids in question_ids)
        check_length(self.model, context_ids.shape[-1] + longest, max_new_tokens)
        announce_predictor(self.model, settings)
        cache = EvictionCache(self.model, settings)
        with cache:
            context_logits = self._feed(context_ids, cache, block_size)
            if compress == "context":
                cache.freeze()
            stats = [cache.stats()]
            snapshot = cache.snapshot()
            answers = []
            for index, ids in enumerate(question_ids):
                if index:
                    cache.restore(snapshot)
                answers.append(self._greedy(ids, context_logits, cache, block_size, max_new_tokens))
                stats.append(cache.stats())
        return {"answers": answers, "stats": stats}

    def _feed(self, ids: torch.Tensor, cache: EvictionCache, block_size: int | None) -> torch.Tensor | None:
        """Run ``ids`` through the model in blocks of ``block_size`` (None: whole); the last position's logits (None
        if empty)."""
        logits = None
        ids = ids.to(self.model.device)
        block_size = block_size or max(ids.shape[-1], 1)
        for start in range(0, ids.shape[-1], block_size):
            block = ids[:, start : start + block_size]
            output = self.model(input_ids=block, cache=cache, use_cache=True, logits_to_keep=1)
            logits = output.logits[:, -1]
        return logits

    def _greedy(self, question_ids, context_logits, cache, block_size, max_new_tokens) -> list[int]:
        """Greedy answer after ``question_ids``; with no question tokens (no question, no chat template) the answer
        continues the context from ``context_logits``."""
        stop = set()
        for source in (getattr(self.model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if source is not None:
                stop.update(source if isinstance(source, (list, tuple)) else [source])
        logits = self._feed(question_ids, cache, block_size)
        if logits is None:
            logits = context_logits
        answer: list[int] = []
        for _ in range(max_new_tokens):
            token = int(logits.argmax(dim=-1)[0])
            if token in stop:
                break
            answer.append(token)
            if len(answer) == max_new_tokens:
                break
            logits = self._feed(torch.tensor([[token]]), cache, block_size)
        return answer

    def postprocess(self, model_outputs, single=True, return_stats=False):
        answers = [self.tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in model_outputs["answers"]]
        result = {"answer": answers[0]} if single else {"answers": answers}
        if return_stats:
            result["stats"] = model_outputs["stats"]
        return result


def register() -> None:
    """Register ``caote-text-generation`` with transformers (idempotent; done when this module is imported)."""
    if TASK not in PIPELINE_REGISTRY.get_supported_tasks():
        PIPELINE_REGISTRY.register_pipeline(
            TASK, pipeline_class=CaoteTextGenerationPipeline, pt_model=AutoModelForCausalLM
        )


__all__ = ["CaoteTextGenerationPipeline", "register", "split_chat_template", "TASK"]

register()
