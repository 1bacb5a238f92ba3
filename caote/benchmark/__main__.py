"""``python -m caote.benchmark ...`` runs the benchmark like ``caote bench ...`` (and an isolated sample's worker)."""

import sys

from caote.benchmark.cli import main

sys.exit(main())
