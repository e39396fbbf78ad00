"""Print the summary of one or more finished runs, and a side-by-side table of their final metrics.

    python -m mcit.report runs/digits_seq runs/digits_l2p
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mcit import metrics as M
from mcit.rundir import RunDir

KEYS = ["final_avg_acc", "final_avg_acc_task_mean", "avg_incremental_acc", "forgetting", "forgetting_mammoth", "bwt",
        "fwd"]


def load(run_dir: Path) -> dict:
    p = RunDir(run_dir).metrics
    if not p.is_file():
        raise SystemExit(f"error: {p} not found (has the run finished?)")
    return json.loads(p.read_text())


def compare_table(runs: list[tuple[str, dict]]) -> str:
    width = max(12, *(len(name) + 2 for name, _ in runs))
    lines = ["metric".ljust(26) + "".join(name.rjust(width) for name, _ in runs)]
    for k in KEYS:
        cells = "".join((f"{m[k]:.2f}" if m.get(k) is not None else "n/a").rjust(width) for _, m in runs)
        lines.append(k.ljust(26) + cells)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    args = ap.parse_args(argv)
    runs = []
    for d in args.run_dirs:
        m = load(d)
        print(f"== {m['name']} ({m['method']}) ==")
        print(M.format_matrix(m["tasks"], m["acc_matrix"], m.get("zero_shot")))
        print(M.format_summary(m))
        print()
        runs.append((m["method"], m))
    methods = [label for label, _ in runs]
    # one column per run: the method's name, or the run's where runs share a method (Soft-TF's
    # inference rules, VPT-NSP² on ViT and on CLIP)
    runs = [(m["name"] if methods.count(label) > 1 else label, m) for label, m in runs]
    if len(runs) > 1:
        print(compare_table(runs))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
