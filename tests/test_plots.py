"""`caote.reports.plots`: in the metric-vs-budget plot every line stays visible; every plot,
`caote eval`'s and `caote bench`'s, says which way is better and colours a policy alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from caote.benchmark import document as bench_document
from caote.evaluation.rows import load_rows
from caote.reports import plots
from caote.reports.summary import summarise_rows

matplotlib = pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
FEW = {"full", "streamingllm", "h2o", "h2o+caote", "tova+fastcaote", "learned+caote", "oracle"}  # the committed rows'


def _records() -> list[dict]:
    records = [{"policy": "full", "budget": "", "mean": 1.0, "ci_low": 0.3, "ci_high": 1.0}]
    for policy in ("streamingllm", "h2o", "h2o+caote", "tova", "tova+caote", "snapkv+fastcaote"):
        for budget in (128, 256):
            records.append({"policy": policy, "budget": budget, "mean": 0.5, "ci_low": 0.1, "ci_high": 0.9})
    return records


def test_equal_lines_are_shifted_apart_and_the_legend_covers_no_data(tmp_path, monkeypatch):
    captured = {}
    original = plots._save_with_legend

    def keep_axis(plt, figure, axis, path):
        data_lines = [container.lines[0] for container in axis.containers]  # one errorbar container per policy
        captured["x"] = [tuple(line.get_xdata()) for line in data_lines]
        captured["markers"] = {line.get_marker() for line in data_lines}
        result = original(plt, figure, axis, path)
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        canvas = FigureCanvasAgg(figure)  # the closed figure has lost its pyplot canvas
        canvas.draw()
        renderer = canvas.get_renderer()
        captured["legend"] = axis.get_legend().get_window_extent(renderer)
        captured["axes"] = axis.get_window_extent(renderer)
        return result

    monkeypatch.setattr(plots, "_save_with_legend", keep_axis)
    path = plots.plot_metric_vs_budget(_records(), tmp_path / "score.png", "score", "equal scores")
    assert path is not None and path.is_file()
    xs = captured["x"]
    assert len(xs) == 6 and len(set(xs)) == 6, "lines with equal values must not sit on the same x"
    assert all(0.9 * 128 < x[0] < 1.1 * 128 and 0.9 * 256 < x[1] < 1.1 * 256 for x in xs)
    assert len(captured["markers"]) == 3  # plain, +caote and +fastcaote differ in marker
    assert captured["legend"].x0 >= captured["axes"].x1, "the legend must sit outside the axes"


def test_dodge_is_centred():
    assert plots._dodge(0, 1) == 1.0
    factors = [plots._dodge(i, 5) for i in range(5)]
    assert factors == sorted(factors) and factors[2] == 1.0 and factors[0] * factors[4] == pytest.approx(1.0)


@pytest.fixture
def saved(monkeypatch) -> dict:
    """The figures written while the test runs, by file name."""
    from matplotlib.figure import Figure

    figures, original = {}, Figure.savefig

    def savefig(self, path, *args, **kwargs):
        figures[Path(path).name] = self
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def _silent_panels(figure) -> list[str]:
    """The panels of ``figure`` whose title and y label say neither "lower is better" nor "higher is better" (a
    colour bar's label speaks for the panels it colours)."""
    bars = [axis for axis in figure.axes if axis.get_label() == "<colorbar>"]
    said = any("is better" in axis.get_ylabel() for axis in bars)
    panels = [axis for axis in figure.axes if axis not in bars and axis.has_data()]
    texts = [f"{axis.get_title()} | {axis.get_ylabel()}" for axis in panels]
    return [text for text in texts if not said and "lower is better" not in text and "higher is better" not in text]


def _colours(figure) -> dict[str, str]:
    """``{legend label: line colour}`` over the panels of ``figure``."""
    found = {}
    for axis in figure.axes:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            line = handle.lines[0] if hasattr(handle, "lines") else handle  # an error bar's data line
            found[label] = matplotlib.colors.to_hex(line.get_color())
    return found


@pytest.mark.parametrize("task", ["perplexity", "niah"])
def test_every_eval_plot_says_which_way_is_better_and_colours_policies_alike(task, tmp_path, saved):
    rows = [row for row in load_rows(ROOT / "docs/results/runs/standard" / task) if row["policy"] in FEW]
    summarise_rows(rows, task, tmp_path)
    assert saved and all(path.name in saved for path in tmp_path.glob("*.png"))
    if task == "perplexity":
        assert any(name.startswith("fidelity_layers") for name in saved)
    for name, figure in saved.items():
        assert _silent_panels(figure) == [], name
        for label, colour in _colours(figure).items():
            policy = label.split(" ")[0]  # "full cache", "oracle (hindsight ceiling)"
            assert colour == matplotlib.colors.to_hex(plots.policy_colour(policy)), (name, label)


def test_the_benchmark_plots_say_which_way_is_better_and_colour_policies_as_the_eval_plots(tmp_path, saved):
    document = json.loads((ROOT / "benchmarks/results/results.json").read_text())
    bench_document.plot(document, tmp_path / "results.png")
    assert bench_document.plot_growth(document, tmp_path / "growth.png") is not None
    assert sorted(saved) == ["growth.png", "results.png"]
    for name, figure in saved.items():
        assert _silent_panels(figure) == [], name
        colours = _colours(figure)
        assert colours, name
        for label, colour in colours.items():
            expected = plots.FULL_COLOUR if label in bench_document.FULL_LINES else plots.policy_colour(label)
            assert colour == matplotlib.colors.to_hex(expected), (name, label)


def test_every_base_has_its_colour():
    from caote.bases import BASE_SCORES

    assert set(BASE_SCORES) <= set(plots.BASE_COLOURS), "give a new base its colour in plots.BASE_COLOURS"
    assert plots.FULL_COLOUR not in plots.BASE_COLOURS.values()
