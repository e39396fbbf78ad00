#!/usr/bin/env python
"""Score a run's checkpoints without training: ``python pipelines/evaluate.py --run RUN_DIR``.

The program is ``mcit/cli/evaluate.py`` (also the command ``mcit-evaluate``); this file is what the launchers start.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install
    from mcit.cli import common
    from mcit.cli.evaluate import main

    common.script(main)
