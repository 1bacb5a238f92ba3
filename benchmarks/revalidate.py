"""Validate a committed predictor again with the current policies (`caote.evaluation.validation`: the learned
policies against the best training-free one) on the same held-out dev excerpts its calibration validated it on,
and store the new table and verdict in its metadata (written atomically, like `caote calibrate`'s).

usage: python benchmarks/revalidate.py --model gemma3-270m --predictor caote/predictors/gemma3-270m.safetensors \\
           --domain code --length 2048
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm.auto import tqdm

from caote.evaluation.calibration import calibration_texts
from caote.evaluation.validation import CANDIDATES, LEARNED, hold_out, validate, validation_table
from caote.models import load_model
from caote.predictor import Predictor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--predictor", required=True, help="a predictor file with a validation (rewritten in place)")
    parser.add_argument("--domain", default="code", help="the calibration texts' domain (default: %(default)s)")
    parser.add_argument("--length", type=int, required=True, help="the calibration excerpts' length in tokens")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    predictor = Predictor.load(args.predictor)
    before = predictor.validation
    if before is None:
        print(f"{args.predictor} has no validation to redo: calibrate it again", file=sys.stderr)
        return 2
    model, tokenizer = load_model(args.model)
    _, held = hold_out(calibration_texts(tokenizer, args.domain, args.length))
    if [text.id for text in held] != before["texts"]:
        print(f"the held-out excerpts {[t.id for t in held]} are not the validated {before['texts']}", file=sys.stderr)
        return 2
    began = time.time()
    with tqdm(total=len(held) * len(LEARNED + CANDIDATES) * len(before["budgets"]), desc="validating") as bar:
        predictor.details["validation"] = validate(model, tokenizer, args.predictor, held, before["budgets"], bar)
    predictor.save(args.predictor)
    print(validation_table(predictor.details["validation"]))
    print(f"validated in {time.time() - began:.0f} s; the verdict was: {before['verdict']} ({before['summary']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
