"""Print the summary of one or more finished runs, and a side-by-side table of their final metrics.

    python -m mcit.report runs/digits_seq runs/digits_l2p
    python -m mcit.report --zero-shot-of runs/tiny_mcit_lora runs/tiny_mcit_lora runs/tiny_mcit_multitask

``--zero-shot-of RUN`` adds a first column for the pre-trained backbone itself: the averages of that run's
zero-shot row (the same test samples, nothing trained). A run with ``data.schedule: joint`` (the multi-task
bound) is labelled ``multitask``.
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


def zero_shot_metrics(m: dict) -> dict:
    """The zero-shot row of a finished run as a column: its sample-weighted and task-mean averages."""
    if not m.get("zero_shot"):
        raise SystemExit(f"error: run {m['name']!r} has no zero-shot row (eval.zero_shot was off)")
    return {**M.compute_joint(m["zero_shot"], m["test_counts"]), "name": m["name"], "method": "zero_shot"}


def label(m: dict) -> str:
    return "multitask" if m.get("schedule") == "joint" else m["method"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--zero-shot-of", type=Path, metavar="RUN",
                    help="add a zero-shot column: the averages of this run's zero-shot row")
    args = ap.parse_args(argv)
    runs = [] if args.zero_shot_of is None else [("zero_shot", zero_shot_metrics(load(args.zero_shot_of)))]
    for d in args.run_dirs:
        m = load(d)
        print(f"== {m['name']} ({m['method']}) ==")
        print(M.format_matrix(m["tasks"], m["acc_matrix"], m.get("zero_shot"), m.get("rows")))
        print(M.format_summary(m))
        print()
        runs.append((label(m), m))
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
