"""``python -m caote ...`` runs the same command line as ``caote ...``."""

import sys

from caote.cli import main

sys.exit(main())
