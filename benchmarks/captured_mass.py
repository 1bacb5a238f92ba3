"""How much of the hindsight oracle's future mass each policy keeps, per evicting layer (issue 41's diagnosis).

python benchmarks/captured_mass.py --model gemma3-270m --out benchmarks/results/captured_mass_gemma3-270m.json

After every prompt block's eviction a layer holds ``b`` tokens per KV head. The oracle would hold the ``b`` tokens that
the later queries of the full-cache pass attend to most; a policy's **captured share** is the future mass of the
tokens it holds over that top-``b`` mass (1: as good as hindsight at that boundary), per evicting layer and KV head,
averaged over the block boundaries that have later queries and over the texts. The oracle itself stays below 1: its
earlier evictions are final, and the sinks and its recent window are kept whatever their mass.

Texts: the excerpts the model's predictor was validated on (documents its calibration never read; the validation's
domain and length), so the shares explain the verdict `caote calibrate` stored.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from caote.cache import EvictionCache, evicting_layers
from caote.evaluation.calibration.texts import calibration_texts
from caote.evaluation.lockstep import reference_pass, track
from caote.evaluation.splits import TEXT_ID
from caote.future import FutureAttention
from caote.models import load_model
from caote.predictor import Predictor

POLICIES = ("learned+caote", "h2o+caote", "tova+caote", "snapkv+caote", "caote-block", "oracle")


def captured_share(future: FutureAttention, layer: int, seen: int, kept: torch.Tensor, budget: int) -> torch.Tensor:
    """``(H_kv,)`` future mass of the ``kept`` positions ``(H_kv, N)`` over that of the ``budget`` tokens receiving most
    of it, after ``seen`` tokens; NaN for a head whose tokens receive no later attention (the last block)."""
    held = future.at(layer, seen, kept.unsqueeze(0))[0].sum(-1)
    heads = kept.shape[0]
    everything = future.at(layer, seen, torch.arange(seen).expand(1, heads, seen))[0]
    best = everything.topk(min(budget, seen), dim=-1).values.sum(-1)
    return torch.where(best > 0, held / best, torch.nan)


def recording(shares: dict[int, list[float]], future: FutureAttention, budget: int) -> type[EvictionCache]:
    """The cache class (for `track`'s ``cache_class``) that appends, after each forward that leaves an evicting layer
    holding fewer tokens than it has seen, that layer's captured share per KV head to ``shares[layer]``."""

    class Recording(EvictionCache):
        def after_forward(self, model, output, forward_kwargs: dict) -> None:
            super().after_forward(model, output, forward_kwargs)
            for index in evicting_layers(model):
                layer = self.layers[index]
                seen = layer.get_seq_length()
                if layer.keys is None or layer.keys.shape[-2] >= seen:
                    continue  # nothing evicted yet
                share = captured_share(future, index, seen, layer.kept_positions()[0], budget)
                shares.setdefault(index, []).extend(value for value in share.tolist() if not math.isnan(value))

    return Recording


def validation_texts(tokenizer, predictor: Predictor) -> list:
    """The excerpts ``predictor``'s validation measured (`caote.evaluation.calibration.TEXT_ID` names their domain
    and length), in its order."""
    ids = predictor.validation["texts"]
    kind, _, length = TEXT_ID.fullmatch(ids[0]).groups()
    by_id = {text.id: text for text in calibration_texts(tokenizer, {"essay": "essays"}.get(kind, kind), int(length))}
    return [by_id[text_id] for text_id in ids]


def measure(
    model, texts: list[tuple[str, torch.Tensor]], budgets: list[int], policies=POLICIES, block: int = 128
) -> list[dict]:
    """One row per ``(text id, token ids)``, policy and budget: the mean captured share per evicting layer, and the
    run's KL."""
    rows = []
    for text_id, ids in tqdm(texts, desc="texts"):
        reference = reference_pass(model, ids, block, future=True, states=set())
        for budget in budgets:
            for policy in policies:
                shares: dict[int, list[float]] = {}
                watched = recording(shares, reference.future, budget)
                result = track(model, ids, reference, policy, budget, skip_prefix=False, cache_class=watched)
                rows.append(
                    {
                        "text": text_id,
                        "policy": policy,
                        "budget": budget,
                        "kl": result["kl"],
                        "shares": {str(layer): statistics.fmean(values) for layer, values in sorted(shares.items())},
                    }
                )
    return rows


def table(rows: list[dict], budgets: list[int]) -> str:
    """Markdown: per policy, the captured share of each evicting layer (mean over texts) and the mean KL, per budget
    (a budget at which nothing was evicted has no row)."""
    policies = list(dict.fromkeys(row["policy"] for row in rows))
    layers = list(dict.fromkeys(layer for row in rows for layer in row["shares"]))
    header = "| policy | budget | " + " | ".join(f"layer {layer}" for layer in layers) + " | all layers | KL |"
    lines = [header, "|" + "---|" * (len(layers) + 4)]
    for budget in budgets:
        for policy in policies:
            chosen = [row for row in rows if row["policy"] == policy and row["budget"] == budget and row["shares"]]
            if not chosen:
                continue
            per_layer = [statistics.fmean(row["shares"][layer] for row in chosen) for layer in layers]
            kl = statistics.fmean(row["kl"] for row in chosen)
            cells = " | ".join(f"{share:.3f}" for share in per_layer)
            lines.append(f"| {policy} | {budget} | {cells} | {statistics.fmean(per_layer):.3f} | {kl:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--budgets", default=None, help="comma-separated (default: the validation's budgets)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    predictor = Predictor.for_model(model)
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else predictor.validation["budgets"]
    texts = validation_texts(tokenizer, predictor)
    texts = [(text.id, tokenizer(text.text, return_tensors="pt").input_ids) for text in texts]
    rows = measure(model, texts, budgets)
    print(f"{args.model}: captured share of the oracle's top-b future mass per evicting layer ({len(texts)} texts)")
    print(table(rows, budgets))
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "budgets": budgets, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
