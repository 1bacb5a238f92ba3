"""`caote.evaluation.plots`: in the metric-vs-budget plot every line stays visible (issue 14, item 7)."""

from __future__ import annotations

import pytest

from caote.evaluation import plots

pytest.importorskip("matplotlib")


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
