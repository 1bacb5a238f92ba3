"""Would another form of predictor rank the future better? The linear map beside a small MLP on the same features.

python benchmarks/predictor_form.py --model smollm2-135m --layers 1,5,10,15,20,25,29 \
    --out benchmarks/results/predictor-form-2026-12-07/predictor_form_smollm2-135m.json

Rows come from ``learned+caote`` passes with the model's shipped predictor, so the candidates are those the policy
meets: after every prompt block, per evicting layer and KV head, each candidate's features (`caote.learned`) and
target ``log(1e-6 + future mass)``, as ``caote calibrate`` records them. Per (layer, KV head), on the training texts'
rows, two maps are fitted with calibration's row weights (`mass_weights`, power 1):

- ``ridge``: calibration's own fit (demeaned normal equations, the strength chosen on the last training text);
- ``mlp``: two hidden layers (128, 64, GELU) on standardised features, fitted by AdamW to each eviction's demeaned
  target, one eviction per step.

On each test eviction a map ranks the candidates and would evict the ``block`` lowest (a prompt block's worth); its
score is the future mass of those, summed over the evictions, beside the shipped map's, H2O's running sum (the first
feature's) and the oracle's (the true mass's), on the test texts' evictions of the ``--layers`` asked. The summary is
each map's mass evicted beyond the oracle's, over the shipped map's (1: as good as the shipped map). That judges one
eviction at a time on the shipped map's kept sets, so each map is then judged as a policy too: the KL from the full
cache of ``learned+caote`` with the map standing in for the predictor (`mapped`), beside ``--kl-policies``. The test
texts' documents are never fitted on. Findings: docs/learned.md, "A nonlinear map: better at ranking, worse in KL".
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from caote.cache import EvictionCache, evicting_layers
from caote.evaluation.calibration.collection import Collector, roll_out
from caote.evaluation.calibration.recipe import Recipe
from caote.evaluation.calibration.ridge import NormalEquations, ridge_strength, weighted_rows
from caote.evaluation.calibration.texts import calibration_texts
from caote.evaluation.lockstep import reference_pass, track
from caote.evaluation.splits import documents_of
from caote.learned import LayerPredictor
from caote.models import load_model
from caote.predictor import Predictor

MAPS = ("oracle", "shipped", "ridge", "mlp", "h2o")
TRAINING_FREE = ("h2o+caote", "tova+caote", "snapkv+caote", "streamingllm")  # the gap is measured from their best
KL_POLICIES = ("h2o+caote", "tova+caote", "streamingllm", "oracle")
LEAST_CANDIDATES = 64  # an eviction with fewer candidates in a head adds no row there
# a training text adds the rows of every second eviction of each layer (consecutive evictions share most candidates;
# every row of a 4k text at budget 1024 over 30 layers is 1.3 GB)
TRAIN_EVERY = 2


class RowRecorder(Collector):
    """A `Collector` that keeps each eviction's rows themselves (``rows[(layer, head)]``: ``(text, x, y)``) instead
    of their normal equations, for the ``layers`` asked and every ``every``-th eviction of each; evictions after the
    last block (no future) are skipped."""

    def __init__(self, rows: dict, layers: set[int], text: int, every: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows, self.layers, self.text, self.every = rows, layers, text, every
        self.evictions: Counter = Counter()

    def record(self, index: int, features: torch.Tensor, target: torch.Tensor, candidates: torch.Tensor) -> None:
        self.evictions[index] += 1
        if index not in self.layers or self.evictions[index] % self.every:
            return
        for batch in range(features.shape[0]):
            for head in range(features.shape[1]):
                chosen = candidates[batch, head].cpu()
                y = target[batch, head].cpu()[chosen].float()
                if int(chosen.sum()) < LEAST_CANDIDATES or float(y.max() - y.min()) < 1e-6:
                    continue
                x = features[batch, head].cpu()[chosen].float()
                self.rows.setdefault((index, head), []).append((self.text, x, y))


def record_rows(model, predictor, texts: list, block: int = 128) -> dict:
    """Rows of every ``(text number, token ids, budgets, layers, every)`` of ``texts`` under ``learned+caote`` with
    ``predictor`` (`RowRecorder`)."""
    rows: dict = {}
    passes = [(*text[:2], budget, *text[3:]) for text in texts for budget in text[2] if budget < text[1].shape[1]]
    reference, referred = None, None
    width = predictor.weights.shape[-1]
    for number, ids, budget, layers, every in tqdm(passes, desc="passes", unit="pass"):
        if referred != number:
            reference, referred = reference_pass(model, ids, block, future=True, states=set(), scored_tail=1), number
        settings = Recipe(budgets=(budget,), block_size=block).settings(budget)
        recorder = RowRecorder(
            rows,
            layers,
            number,
            every,
            predictor.groups,
            width,
            settings.recent,
            settings.sink_tokens,
            rollout=predictor,
        )
        roll_out(model, ids, settings, reference.future, recorder)
    return rows


def fit_ridge(train: list, validation: int) -> torch.Tensor:
    """Calibration's weighted ridge fit on ``train`` ``(text, x, y)``, the strength chosen on text ``validation``."""
    width = train[0][1].shape[-1]
    fit, held = NormalEquations.empty(width), NormalEquations.empty(width)
    for text, x, y in train:
        x, y, weights = weighted_rows(x, y, 1.0)
        root = weights.sqrt()
        (held if text == validation else fit).add((x * root[:, None]).double(), (y * root).double())
    strength, _ = ridge_strength(fit, held)
    fit += held
    return fit.solve(strength).float()


def fit_mlp(train: list, hidden: int = 128, epochs: int = 8, learning_rate: float = 1e-3):
    """An MLP fitted to each eviction's demeaned target (weighted as calibration weighs rows); returns the map."""
    features = torch.cat([x for _, x, _ in train])
    mean, std = features.mean(0), features.std(0)
    # a column constant over the candidates (the sink flag: sinks are never candidates) is read as 0: scaled by its
    # std of 0 it would turn a sink's flag into an input of 1e6 and its prediction into anything
    std = torch.where(std > 1e-6, std, torch.inf)
    net = torch.nn.Sequential(
        torch.nn.Linear(features.shape[1], hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden // 2),
        torch.nn.GELU(),
        torch.nn.Linear(hidden // 2, 1),
    )
    optimiser = torch.optim.AdamW(net.parameters(), lr=learning_rate, weight_decay=1e-4)
    evictions = [((x - mean) / std, *weighted_rows(x, y, 1.0)[1:]) for _, x, y in train]
    with torch.enable_grad():
        for _ in range(epochs):
            for index in torch.randperm(len(evictions)).tolist():
                x, y, weights = evictions[index]
                prediction = net(x).squeeze(-1)
                prediction = prediction - (weights * prediction).sum() / weights.sum()
                loss = (weights * (prediction - y) ** 2).mean()
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()

    def mlp(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return net((x - mean) / std).squeeze(-1)

    return mlp


def evicted_mass(score: torch.Tensor, target: torch.Tensor, count: int) -> float:
    """Future mass of the ``count`` candidates of lowest ``score`` (``target``: log future mass)."""
    return float(target.exp()[score.argsort()[:count]].sum())


def fit_maps(rows: dict, predictor, train_texts: set[int], epochs: int = 8) -> dict:
    """Per ``(layer, head)`` of ``rows``: each of `MAPS`' scoring function ``(x, y) -> score`` (the ridge and the MLP
    fitted on the ``train_texts``' rows)."""
    maps = {}
    for (layer, head), head_rows in tqdm(sorted(rows.items()), desc="fits", unit="head"):
        train = [row for row in head_rows if row[0] in train_texts]
        if not train:
            continue
        maps[layer, head] = {
            "oracle": lambda x, y: y,
            "shipped": lambda x, y, w=predictor.weights[layer, head]: x @ w,
            "ridge": lambda x, y, w=fit_ridge(train, max(train_texts)): x @ w,
            "mlp": lambda x, y, net=fit_mlp(train, epochs=epochs): net(x),
            "h2o": lambda x, y: x[:, 0],
        }
    return maps


def compare(rows: dict, maps: dict, train_texts: set[int], block: int = 128) -> dict:
    """Per ``"layer.head"``: the mass each of `MAPS` evicts on the test texts' evictions (and their total mass)."""
    results = {}
    for (layer, head), head_rows in sorted(rows.items()):
        test = [row for row in head_rows if row[0] not in train_texts]
        if not test or (layer, head) not in maps:
            continue
        totals = {
            name: sum(evicted_mass(score(x, y), y, block) for _, x, y in test)
            for name, score in maps[layer, head].items()
        }
        totals["mass"] = sum(float(y.exp().sum()) for _, _, y in test)
        results[f"{layer}.{head}"] = totals
    return results


class MappedLayer(LayerPredictor):
    """One layer of `mapped`: each KV head's tokens scored by that head's map of their features."""

    def __init__(self, maps: dict, groups, index: int, unrotate, sink_tokens: int):
        super().__init__(None, groups, unrotate, sink_tokens)
        self.maps, self.index = maps, index

    def predict(self, inputs) -> torch.Tensor:
        features = self.features(inputs).float()
        batch, heads, tokens, width = features.shape
        scores = [self.maps[self.index, head](features[:, head].reshape(-1, width), None) for head in range(heads)]
        return torch.stack([score.reshape(batch, tokens) for score in scores], dim=1)


def mapped(maps: dict, name: str, groups):
    """A stand-in predictor (`caote.cache.EvictionCache`'s ``stand_in``) that predicts with the maps called ``name``
    (every evicting layer and head needs one), and the cache class that builds it in (for `track`)."""
    chosen = {key: head_maps[name] for key, head_maps in maps.items()}

    class StandIn:
        def __init__(self):
            self.groups = groups

        def layer(self, index: int, unrotate, sink_tokens: int) -> MappedLayer:
            return MappedLayer(chosen, groups, index, unrotate, sink_tokens)

    class MappedCache(EvictionCache):
        def __init__(self, model, settings, future=None):
            super().__init__(model, settings, future=future, stand_in=StandIn())

    return MappedCache


def kl_rows(model, maps: dict, groups, texts: list, budget: int, policies: tuple[str, ...], block: int = 128) -> list:
    """KL from the full cache on each ``(text id, token ids)``: ``learned+caote`` predicting with each fitted map
    (``map:<name>``), and each of ``policies`` as caote runs them."""
    rows = []
    runs = [(f"map:{name}", "learned+caote", mapped(maps, name, groups)) for name in ("shipped", "ridge", "mlp")]
    runs += [(policy, policy, EvictionCache) for policy in policies]
    for text_id, ids in tqdm(texts, desc="KL texts", unit="text"):
        reference = reference_pass(model, ids, block, future="oracle" in policies)
        for label, policy, cache_class in runs:
            result = track(model, ids, reference, policy, budget, cache_class=cache_class)
            rows.append({"text": text_id, "run": label, "budget": budget, "kl": result["kl"]})
    return rows


def kl_table(rows: list) -> str:
    """Markdown: each run's mean KL, and its share of the gap between the best training-free policy and the oracle
    (when both ran)."""
    runs = list(dict.fromkeys(row["run"] for row in rows))
    mean = {run: statistics.fmean(row["kl"] for row in rows if row["run"] == run) for run in runs}
    free = [run for run in runs if run in TRAINING_FREE]
    best = min(free, key=mean.get) if free else None
    lines = ["| run | mean KL | share of the gap |", "|---|---|---|"]
    for run in runs:
        share = ""
        if best is not None and "oracle" in mean and mean[best] > mean["oracle"]:
            share = f"{(mean[best] - mean[run]) / (mean[best] - mean['oracle']):.0%}"
        lines.append(f"| {run} | {mean[run]:.4f} | {share} |")
    if best is not None:
        lines.append(f"(gap: from {best}, the best of {', '.join(free)}, to the oracle)")
    return "\n".join(lines)


def summary(results: dict) -> dict:
    """Each map's evicted mass beyond the oracle's, over the shipped map's, summed over the heads."""
    totals = {name: sum(head[name] for head in results.values()) for name in MAPS}
    beyond = totals["shipped"] - totals["oracle"]
    return {name: (totals[name] - totals["oracle"]) / beyond for name in MAPS if name != "oracle"}


def texts_of(tokenizer, spec: str) -> tuple[list, list[int], int]:
    """``domain:length:budgets:count`` -> the excerpts (`calibration_texts`, dev split), the budgets, the count."""
    domain, length, budgets, count = spec.split(":")
    return calibration_texts(tokenizer, domain, int(length)), [int(b) for b in budgets.split(",")], int(count)


def choose(train_pool: list, train_count: int, test_pool: list, test_count: int) -> tuple[list, list]:
    """One excerpt per document for training (the first ``train_count`` documents), then the first ``test_count``
    test excerpts drawing on none of those documents."""
    train, documents = [], set()
    for text in train_pool:
        if len(train) < train_count and not documents_of(text.id, "dev") & documents:
            train.append(text)
            documents |= documents_of(text.id, "dev")
    test = [text for text in test_pool if not documents_of(text.id, "dev") & documents][:test_count]
    return train, test


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--train", default="code:4096:1024:9", help="domain:length:budgets:count (dev split)")
    parser.add_argument("--test", default="code:4096:1024:4", help="domain:length:budgets:count (dev split)")
    parser.add_argument("--layers", default=None, help="the layers scored by evicted mass (default: all evicting)")
    parser.add_argument("--kl-policies", default=",".join(KL_POLICIES), help="run beside the maps for KL")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    train_pool, train_budgets, train_count = texts_of(tokenizer, args.train)
    test_pool, test_budgets, test_count = texts_of(tokenizer, args.test)
    train, test = choose(train_pool, train_count, test_pool, test_count)
    predictor = Predictor.for_model(model, budget=min(test_budgets))
    every_layer = set(evicting_layers(model))
    scored = {int(layer) for layer in args.layers.split(",")} if args.layers else every_layer
    texts = [(number, tokenizer(text.text, return_tensors="pt").input_ids) for number, text in enumerate(train + test)]
    plan = [(train_budgets, every_layer, TRAIN_EVERY)] * len(train) + [(test_budgets, scored, 1)] * len(test)
    rows = record_rows(model, predictor, [(n, ids, *how) for (n, ids), how in zip(texts, plan)])
    maps = fit_maps(rows, predictor, set(range(len(train))))
    results = compare(rows, maps, set(range(len(train))))
    relative = summary(results)
    print(f"{args.model}: future mass evicted beyond the oracle's, over the shipped map's (lower is better)")
    print(f"train {', '.join(text.id for text in train)} at {train_budgets}; test {', '.join(t.id for t in test)}")
    print(" | ".join(f"{name} {value:.3f}" for name, value in relative.items()))
    record = {"model": args.model, "train": [t.id for t in train], "test": [t.id for t in test], "args": vars(args)}
    record.update(train_budgets=train_budgets, test_budgets=test_budgets, summary=relative, per_head=results)
    del rows
    kl_texts = [(text.id, ids) for text, (_, ids) in zip(test, texts[len(train) :])]
    policies = tuple(args.kl_policies.split(","))
    record["kl"] = kl_rows(model, maps, predictor.groups, kl_texts, min(test_budgets), policies)
    print(kl_table(record["kl"]))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
