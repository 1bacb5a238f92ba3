"""``caote calibrate``: fit the ``learned`` policy's importance predictor (`caote.learned`) to the hindsight oracle.

- `recipe`: the `Recipe` and `calibrate` (full-cache passes, rounds of evicting passes, the fit into a predictor);
- `collection`: the evicting pass whose every eviction records the candidates' features and future (`Collector`);
- `ridge`: the weighted ridge fit per (layer, KV head) from normal equations;
- `texts`: the dev-split or folder excerpts calibration reads.

Calibration texts are never evaluation texts: they come from the dev split, and the evaluation refuses a learned
policy on any text of a document its predictor read (`caote.evaluation.splits`). A known simplification: the
texts choosing the ridge strengths are every fourth excerpt, so one document can give excerpts to both sides (the
choice of strength is then a little optimistic).
"""
