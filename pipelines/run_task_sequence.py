#!/usr/bin/env python
"""Run a whole task sequence: ``deepspeed pipelines/run_task_sequence.py --config C [key.path=value ...]``.

The program is ``mcit/cli/run.py`` (also the command ``mcit-run``); this file is what the launchers start.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without install
    from mcit.cli import common
    from mcit.cli.run import main

    common.script(main)
