"""The comparison of finished runs: each run's summary and a side-by-side table of their final metrics
(the program: ``mcit-report`` / ``python -m mcit.cli.report``).

``--zero-shot-of RUN`` adds a first column for the pre-trained backbone itself: the averages of that run's
zero-shot row (the same test samples, nothing trained). A run with ``data.schedule: joint`` (the multi-task
bound) is labelled ``multitask``.
"""

from __future__ import annotations

import json
from pathlib import Path

from mcit.core import metrics as M
from mcit.core.checkpoint import atomic_write_text
from mcit.core.rundir import RunDir, RunDirError

KEYS = ["final_avg_acc", "final_avg_acc_task_mean", "avg_incremental_acc", "forgetting", "forgetting_mammoth", "bwt",
        "fwd", "mft", "mfn", "maa"]


def load(run_dir: Path) -> dict:
    p = RunDir(run_dir).metrics
    if not p.is_file():
        raise RunDirError(f"{p} not found (has the run finished?)")
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
        raise RunDirError(f"run {m['name']!r} has no zero-shot row (eval.zero_shot was off)")
    return {**M.compute_joint(m["zero_shot"], m["test_counts"]), "name": m["name"], "method": "zero_shot"}


def label(m: dict) -> str:
    return "multitask" if m.get("schedule") == "joint" else m["method"]


def unfinished(run_dir: Path) -> str | None:
    """Why ``run_dir`` is not a finished run (not a run directory, or where its state ends), or None."""
    rd = RunDir(run_dir)
    if not rd.root.is_dir() or not (rd.config.is_file() or rd.state.is_file()):
        return "not a run directory"
    try:
        state = rd.read_state()
    except RunDirError as e:
        return str(e)
    if not (state and state.get("finished")) or not rd.metrics.is_file():
        done = (state or {}).get("completed") or ["nothing"]
        return f"unfinished (state.json ends at stage {done[-1]})"
    return None


def comparison(run_dirs: list[Path], zero_shot_of: Path | None = None) -> tuple[str, list[str]]:
    """Each finished run's accuracy matrix and summary, then (for several runs) one column per run: the method's
    name, or the run's where runs share a method (Soft-TF's inference rules, VPT-NSP² on ViT and on CLIP). A run
    that has not finished (a glob over runs/ that catches one still running) is left out and named in the second
    value; none finished is an error."""
    runs = [] if zero_shot_of is None else [("zero_shot", zero_shot_metrics(load(zero_shot_of)))]
    parts, skipped = [], []
    for d in run_dirs:
        why = unfinished(d)
        if why is not None:
            skipped.append(f"{d}: {why}")
            continue
        m = load(d)
        parts += [f"== {m['name']} ({m['method']}) ==", M.format_matrix(m["tasks"], m["acc_matrix"], m.get("zero_shot"),
                                                                       m.get("rows")), M.format_summary(m), ""]
        runs.append((label(m), m))
    if not parts:
        raise RunDirError(f"no finished run to report: {'; '.join(skipped)}")
    methods = [name for name, _ in runs]
    runs = [(m["name"] if methods.count(name) > 1 else name, m) for name, m in runs]
    if len(runs) > 1:
        parts.append(compare_table(runs))
    return "\n".join(parts), skipped


def write_html(dirs: list[Path], published: list | None = None) -> tuple[list[Path], list[str]]:
    """report.html for each finished run or sweep directory (``aggregate.json``) in ``dirs`` (``mcit-report
    --html``: runs and sweeps written before the page existed); the others are named in the second value.
    ``published``: (row, ours) pairs (``mcit.studies.published.compare``): each page shows the rows of its runs."""
    from mcit.run.html_report import published_html, sweep_html, write_run_html
    from mcit.studies.results import MCITLIB_METRICS, TABLE_METRICS

    made, skipped = [], []
    for d in dirs:
        if (d / "aggregate.json").is_file():
            agg = json.loads((d / "aggregate.json").read_text())
            mine = [p for p in published or [] if p[0].config_name in {g["config"] for g in agg["groups"]}]
            atomic_write_text(d / "report.html",
                              sweep_html(agg, TABLE_METRICS, MCITLIB_METRICS, published_html(mine)))
            made.append(d / "report.html")
            continue
        why = unfinished(d)
        if why is not None:
            skipped.append(f"{d}: {why}")
            continue
        name = load(d)["name"]
        made.append(write_run_html(d, extra=published_html([p for p in published or []
                                                             if p[0].config_name == name])))
    return made, skipped


def published_table(files: list[Path], dirs: list[Path]) -> tuple[str, list]:
    """``mcit-report --published``: the published / ours / Δ table of ``files``' rows against the finished runs and
    sweeps in ``dirs``, and its (row, ours) pairs."""
    from mcit.studies import published as P

    runs = [load(d) for d in dirs if not (d / "aggregate.json").is_file() and unfinished(d) is None]
    sweeps = [json.loads((d / "aggregate.json").read_text()) for d in dirs if (d / "aggregate.json").is_file()]
    ours = P.ours_of(runs, sweeps)
    pairs, skipped = [], 0
    for f in files:
        got, left = P.compare(P.load(f), ours)
        pairs += got
        skipped += left
    return P.markdown(pairs, skipped), pairs
