"""Run the caote performance benchmark (same as ``caote bench``); see `caote.benchmark` and docs/performance.md.

python benchmarks/run.py --out benchmarks/results  # the committed full run (default --out: results/bench/)
python benchmarks/run.py --model tiny-llama --contexts 64,128 --budget 32 --block-size 16 --new-tokens 4
"""

import sys

from caote.benchmark.cli import main

if __name__ == "__main__":
    sys.exit(main())
