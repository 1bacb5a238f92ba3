"""Evaluation: benchmarks that measure what eviction costs, on the bundled model or any other.

Bottom up: leaf modules (`examples`, `metrics`, `data`, `stats`, `reference`, `tasks`, `fidelity`,
`ruler_content`) -> one module per task (`niah`, `ruler`, `longbench`, `perplexity`) -> `registry` (the only list
of tasks) -> `rows`, `lockstep` -> `config` -> `runner` -> `grids` -> `report` (the runs, then their documents from
`caote.reports`, which nothing below it imports) -> `cli` (``caote eval``). See docs/architecture.md.
"""
