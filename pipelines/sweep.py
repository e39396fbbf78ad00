#!/usr/bin/env python
"""Run a study: ``python -m pipelines.sweep --config C --seeds 0 1 2 [--grid key=v1,v2 ...]``.

The program is ``mcit/cli/sweep.py`` (also the command ``mcit-sweep``); this module is the name the README
and the Makefile use.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install
    from mcit.cli.sweep import main

    raise SystemExit(main())
