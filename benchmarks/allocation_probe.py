"""Per-layer KV budgets against uniform ones at the same total slots, on dev texts only (issue 43, step 1).

python benchmarks/allocation_probe.py --out benchmarks/results/allocation_probe.json

Every evicting layer keeps the same budget ``b`` today. This probe asks whether spending the same ``L x b`` slots
unevenly, by shares fitted once per model from the hindsight oracle, lowers the KL from the full cache:

* **Shares.** On the calibration texts (the model's predictor was fitted on them: SmolLM2's first 40 dev code
  excerpts) a full-cache pass records the attention each token receives from later queries (`caote.future`). For
  layer ``l`` the curve ``C_l(k)`` is the share of that future mass held by the ``k`` tokens that receive most of it,
  averaged over block boundaries, KV heads and texts. Slots go in steps of ``b / 4`` (every layer at least ``b / 4``)
  to the layer whose curve gains most from the step, until ``sum_l b_l = L x b``: the greedy maximum of
  ``sum_l C_l(b_l)``, exact for concave curves. The peak of a block-wise prefill, ``sum_l (b_l + block)``, is then
  the uniform one's, byte for byte.
* **Bounded.** The same greedy with every layer between ``b / 2`` and ``2 b``.
* **Ceiling.** The same allocation fitted on each evaluated text's own future (`hindsight`), applied to the oracle.
* **Texts.** The 12 dev essay excerpts the learned recipe was chosen on and 12 dev code excerpts the predictor was
  not fitted on (later excerpts of its documents: the dev split has 16 code documents, all read by the fit); 1,024
  tokens, KL over every prediction, lockstep with one full-cache pass per text.

A layer's budget is its own settings' (`caote.strategies` reads ``layer.settings``); the probe hands each evicting
layer its budget right after the cache is built (`allocated`, the cache class `track` builds), the one thing it adds
to the library's path.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from caote.cache import EvictionCache, evicting_layers
from caote.evaluation.calibration.texts import calibration_texts
from caote.evaluation.lockstep import reference_pass, track
from caote.layer import EvictionLayer
from caote.models import load_model
from caote.predictor import Predictor

POLICIES = ("learned+caote", "tova+caote", "h2o+caote", "oracle")


def captured_curve(future, layers: list[int], heads: int, tokens: int, block_size: int, longest: int) -> torch.Tensor:
    """``(len(layers), longest + 1)``: ``C_l(k)``, the share of the future mass the ``k`` tokens receiving most of it
    hold, per evicting layer, averaged over one text's block boundaries (those with later queries) and KV heads."""
    curves = []
    for layer in layers:
        per_boundary = []
        for seen in range(block_size, tokens, block_size):
            mass = future.at(layer, seen, torch.arange(seen).expand(1, heads, seen))[0]
            top = mass.sort(dim=-1, descending=True).values.cumsum(-1) / mass.sum(-1, keepdim=True)
            curve = torch.ones(heads, longest + 1, dtype=torch.float64)
            curve[:, 0] = 0.0
            curve[:, 1 : min(seen, longest) + 1] = top[:, :longest]
            per_boundary.append(curve.mean(0))
        curves.append(torch.stack(per_boundary).mean(0))
    return torch.stack(curves)


def allocate(curves: torch.Tensor, budget: int, step: int, floor: int, cap: int) -> list[int]:
    """Per-layer budgets, multiples of ``step`` in ``[floor, cap]``, summing to ``layers x budget``: every step of
    slots to the layer whose curve gains most from it (`captured_curve`)."""
    layers, longest = curves.shape[0], curves.shape[1] - 1
    budgets = [floor] * layers
    for _ in range((layers * budget - sum(budgets)) // step):
        gains = [
            curves[layer, b + step] - curves[layer, b] if b + step <= min(cap, longest) else -1.0
            for layer, b in enumerate(budgets)
        ]
        budgets[max(range(layers), key=lambda layer: gains[layer])] += step
    return budgets


# the allocations tried, as (floor, cap) in units of the budget: the greedy with a floor of a quarter and nothing but
# the text's length above, and a bounded one (half to twice the uniform budget), as AdaKV keeps a floor per head
ALLOCATIONS = {"calibrated": (0.25, 4.0), "bounded": (0.5, 2.0)}


def allocated(budgets: list[int] | None) -> type[EvictionCache]:
    """The cache class whose ``l``-th evicting layer keeps ``budgets[l]`` tokens (validated against the sinks and the
    recent window by `CacheSettings.replace`), for `track`'s ``cache_class``; None: the uniform `EvictionCache`."""
    if budgets is None:
        return EvictionCache

    class Allocated(EvictionCache):
        def __init__(self, model, settings=None, **values):
            super().__init__(model, settings, **values)
            layers = [layer for layer in self.layers if isinstance(layer, EvictionLayer)]
            for layer, budget in zip(layers, budgets, strict=True):
                layer.settings = layer.settings.replace(budget=budget)

        def attention_mask(self, module, queries, attention_mask, additive: bool):
            """The model builds one mask for the width of its first layer; a layer holding more or fewer tokens
            gets it cut or widened on the left, where the tokens it retains are all visible (one unpadded
            sequence)."""
            mask = super().attention_mask(module, queries, attention_mask, additive)
            layer = self.layers[module.layer_idx]
            if mask is None or not isinstance(layer, EvictionLayer) or mask.shape[-1] == layer.keys.shape[-2]:
                return mask
            if queries.shape[0] != 1:
                raise ValueError("the allocation probe reads one unpadded sequence at a time")
            width = layer.keys.shape[-2]
            if mask.shape[-1] > width:
                return mask[..., -width:]
            visible = torch.zeros if additive else torch.ones
            extra = visible(*mask.shape[:-1], width - mask.shape[-1], dtype=mask.dtype, device=mask.device)
            return torch.cat([extra, mask], dim=-1)

    return Allocated


def evaluation_texts(tokenizer, predictor: Predictor, count: int, length: int) -> list:
    """``count`` dev essay excerpts, then ``count`` dev code excerpts the predictor was not fitted on (the dev split's
    16 code documents all gave it excerpts: these are later excerpts of the same documents)."""
    fitted = set(predictor.texts) | {t for texts in predictor.details.get("rolled_out_by", []) for t in texts}
    code = [text for text in calibration_texts(tokenizer, "code", length) if text.id not in fitted]
    return calibration_texts(tokenizer, "essays", length, count) + code[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budgets", default="128,256")
    parser.add_argument("--texts", type=int, default=12, help="dev essay excerpts, and as many dev code excerpts")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--calibration-texts", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    model, tokenizer = load_model(args.model)
    predictor = Predictor.for_model(model)
    block = 128
    longest = 4 * max(budgets)
    fitted = set(predictor.texts)
    fitting = [text for text in calibration_texts(tokenizer, "code", args.length) if text.id in fitted]
    fitting = fitting[: args.calibration_texts]
    layers, heads = evicting_layers(model), model.config.num_key_value_heads
    curves = []
    for text in tqdm(fitting, desc="shares"):
        ids = tokenizer(text.text, return_tensors="pt").input_ids
        future = reference_pass(model, ids, block, future=True, states=set()).future
        curves.append(captured_curve(future, layers, heads, ids.shape[1], block, longest))
    curves = torch.stack(curves).mean(0)
    shares = {
        (name, b): allocate(curves, b, b // 4, int(floor * b), int(cap * b))
        for name, (floor, cap) in ALLOCATIONS.items()
        for b in budgets
    }
    for (name, b), layer_budgets in shares.items():
        print(f"{name} b={b}: per-layer budgets {layer_budgets} ({len(set(layer_budgets))} distinct)")
    rows = []
    texts = evaluation_texts(tokenizer, predictor, args.texts, args.length)
    for text in tqdm(texts, desc="texts"):
        ids = tokenizer(text.text, return_tensors="pt").input_ids
        reference = reference_pass(model, ids, block, future=True, states=set())
        own = captured_curve(reference.future, layers, heads, ids.shape[1], block, longest)
        for b in budgets:
            runs = [(policy, "uniform", None) for policy in POLICIES]
            runs += [(policy, name, shares[(name, b)]) for name in ALLOCATIONS for policy in POLICIES]
            runs += [("oracle", "hindsight", allocate(own, b, b // 4, b // 4, longest))]
            for policy, allocation, layer_budgets in runs:
                result = track(
                    model, ids, reference, policy, b, skip_prefix=False, cache_class=allocated(layer_budgets)
                )
                rows.append(
                    {
                        "text": text.id,
                        "domain": text.id.split("-")[0],
                        "policy": policy,
                        "budget": b,
                        "allocation": allocation,
                        "layer_budgets": layer_budgets,
                        "kl": result["kl"],
                    }
                )
    for domain in ("essay", "code", None):
        print(f"\n{domain or 'all'} texts:")
        print(table([row for row in rows if domain in (None, row["domain"])], budgets))
    if args.out:
        args.out.write_text(
            json.dumps({"shares": {f"{n} {b}": v for (n, b), v in shares.items()}, "rows": rows}, indent=1) + "\n"
        )


def table(rows: list[dict], budgets: list[int]) -> str:
    """Mean KL per policy and allocation, and the change against uniform with the texts where it is lower."""
    lines = ["| policy | allocation | " + " | ".join(f"KL b={b}; vs uniform; lower on" for b in budgets) + " |"]
    lines.append("|---|---|" + "---|" * len(budgets))
    keys = list(dict.fromkeys((row["policy"], row["allocation"]) for row in rows))

    def kl_by_text(policy: str, allocation: str, budget: int) -> dict[str, float]:
        return {
            r["text"]: r["kl"]
            for r in rows
            if (r["policy"], r["allocation"], r["budget"]) == (policy, allocation, budget)
        }

    for policy, allocation in keys:
        cells = []
        for b in budgets:
            mine, base = kl_by_text(policy, allocation, b), kl_by_text(policy, "uniform", b)
            mean, uniform = statistics.mean(mine.values()), statistics.mean(base.values())
            lower = sum(mine[t] < base[t] for t in mine)
            cells.append(f"{mean:.4f}; {100 * (mean / uniform - 1):+.0f} %; {lower}/{len(mine)}")
        lines.append(f"| {policy} | {allocation} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
