"""The README's "Choosing a policy" table, generated from the committed runs: KL from the full cache and pass keys
found on the standard and long grids (docs/results/**/*_summary.csv), decode speed, prefill time and KV memory from
the committed benchmark (benchmarks/results/results.json). A test keeps the README's copy equal to this output:
``python benchmarks/choice_table.py`` prints it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

# the rows: the reference, auto's choices (the learned policy each model's predictor validation names; models without
# a helpful predictor, by budget), the two training-free policies of lower KL that decode too slowly for auto, and
# StreamingLLM (learned-block runs on Gemma-3's parts only: "–" elsewhere)
POLICIES = {
    "full": "",
    "learned+caote": " = auto on SmolLM2",
    "learned-block": " = auto on Gemma-3",
    "tova+caote": " = auto without a helpful predictor, b < 512",
    "h2o+caote": " = auto without a helpful predictor, b ≥ 512",
    "caote-block": "",
    "snapkv+caote": "",
    "streamingllm": "",
}
BUDGET = 256  # of every quality column
CONTEXT = "8192"  # of the benchmark's columns
# the summary CSVs under docs/results, in the order of the header's parts
KL_PARTS = (
    "standard_perplexity_summary.csv",
    "long/smollm2-essays-4k_perplexity-joined_summary.csv",
    "long/smollm2-code-4k_perplexity-code_summary.csv",
    "long/gemma3-essays-8k_perplexity-joined_summary.csv",
    "long/gemma3-code-8k_perplexity-code_summary.csv",
)
NIAH_PARTS = ("standard_niah_summary.csv", "long/gemma3-niah-8k_niah_summary.csv")
PROTOCOLS = ("in-prompt", "question-after")


def _summary(path: Path, metric: str, task: str) -> dict[str, tuple[float, int]]:
    """``{policy: (mean, n)}`` of ``metric`` at `BUDGET` (the full cache: at no budget) in a summary CSV."""
    found = {}
    with path.open(encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            at_budget = row["budget"] == ("" if row["policy"] == "full" else str(BUDGET))
            if row["metric"] == metric and row["task"] == task and at_budget:
                found[row["policy"]] = (float(row["mean"]), int(row["n"]))
    return found


def _kl_cells(results: Path) -> tuple[list[list[str]], list[int]]:
    """Per KL part, the cells of every policy (``"0.0086"``), and the number of texts of each part."""
    parts = [_summary(results / name, "kl", "all") for name in KL_PARTS]
    cells = [[f"{part[policy][0]:.4f}" if policy in part else "–" for part in parts] for policy in POLICIES]
    return cells, [part["full"][1] for part in parts]


def _niah_cells(results: Path) -> list[list[str]]:
    """Per NIAH part, ``"5 · 5"``: pass keys found in-prompt and question-after."""
    cells = [[] for _ in POLICIES]
    for name in NIAH_PARTS:
        by_protocol = [_summary(results / name, "score", protocol) for protocol in PROTOCOLS]
        for index, policy in enumerate(POLICIES):
            found = [part.get(policy) for part in by_protocol]
            if None in found:
                cells[index].append("–")
            else:
                cells[index].append(" · ".join(f"{round(mean * n)}" for mean, n in found))
    return cells


def _bench_cells(bench: dict) -> list[list[str]]:
    """Per policy, at `CONTEXT` tokens: KV peak, prefill time against the full cache's, decoding speed against the
    full cache's and against a full cache of the budget's size."""
    medians, ratios = bench["summary"]["medians"], bench["summary"]["ratios"][CONTEXT]
    cells = []
    for policy in POLICIES:
        name = "full-sdpa" if policy == "full" else policy
        measured = medians.get(name, {}).get(CONTEXT)
        if measured is None:
            cells.append(["–"] * 4)
            continue
        kv = f"{measured['kv_peak_bytes'] / 2**20:.1f} MiB"
        if policy == "full":
            cells.append([kv, f"{measured['prefill_s']:.0f} s", f"{measured['decode_tokens_per_s']:.1f} tok/s", "–"])
            continue
        ratio = ratios[policy]
        decode = [ratio.get(key) for key in ("decode_speedup", "decode_vs_full_at_budget")]
        decode = ["–" if value is None else f"{value:.2f}x" for value in decode]
        cells.append([kv, f"{ratio['prefill_vs_full_sdpa']:.2f}x", *decode])
    return cells


def choice_table(results: Path, bench_json: Path) -> str:
    """The table, as markdown lines (no trailing newline)."""
    bench = json.loads(bench_json.read_text(encoding="utf-8"))
    meta = bench["meta"]
    budget = meta["config"]["budget"]
    (kl, texts), niah, cost = _kl_cells(results), _niah_cells(results), _bench_cells(bench)
    examples = _summary(results / NIAH_PARTS[0], "score", PROTOCOLS[0])["full"][1]
    lines = [
        "| policy | KL 1k | KL 4k essays | KL 4k code | KL 8k essays | KL 8k code | pass keys 1k | pass keys 8k "
        "| KV at 8k | prefill time 8k | decode speed 8k | decode speed vs same size |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for index, (policy, role) in enumerate(POLICIES.items()):
        cells = [*kl[index], *niah[index], *cost[index]]
        lines.append(f"| `{policy}`{role} | {' | '.join(cells)} |")
    lines.append("")
    lines.append(
        f"KL from the full cache's next-token distribution (lower is better) and pass keys found (of {examples}, "
        f"in-prompt · question-after; higher is better) at budget {BUDGET} tokens per layer: 1k and 4k on SmolLM2-135M "
        f"({texts[0]} test essays; {texts[1]} windows of joined essays, {texts[2]} code files), 8k on Gemma-3 270M "
        f"({texts[3]} and {texts[4]}), from [docs/results.md](docs/results.md) and "
        "[docs/results/long.md](docs/results/long.md). The last four columns: `caote bench` on SmolLM2 at 8k tokens "
        f"and budget {budget} ([benchmarks/results/results.md](benchmarks/results/results.md) states the machine and "
        "its load): KV bytes at the peak; prefill time (lower is faster) and decoding speed (higher is faster) "
        "against the full cache's (sdpa; for `full` its own seconds and tokens/s); decoding speed against a full cache "
        f"that holds only {budget} tokens, which is what the scoring costs."
    )
    return "\n".join(lines)


def main() -> None:
    root = Path(__file__).resolve().parents[1]
    print(choice_table(root / "docs" / "results", root / "benchmarks" / "results" / "results.json"))


if __name__ == "__main__":
    main()
