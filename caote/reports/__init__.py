"""Reports: results documents, Markdown tables, CSV and plots, written from the rows `caote.evaluation` computes.

The rule: nothing in caote's core (``caote/*.py``), the computing side of `caote.evaluation` or `caote.benchmark`
loads caote.reports when imported. Only the body of ``caote eval`` (`caote.evaluation.report`, which
`caote.evaluation.cli.run` imports inside the command function) imports it at the top; `caote.benchmark.document`
imports the plot styles when it draws; benchmarks/ scripts import it freely. Reports import the evaluation, never the
other way round (tests/test_architecture.py checks both).

Bottom up: `tables` (per-cell means, paired comparisons, Markdown and CSV) -> `plots` -> `summary` (one task's
summary.md), `glance` (the compact table a report prints) -> `claims` -> `beyond` -> `document` (docs/results.md) ->
`long_results` (docs/results/long.md).
"""
