"""A sweep's results: every point's metrics.json as mean and standard deviation per (config, setting) over its
seeds and orders, the tables (json, csv, Markdown) and figures. Points that did not finish are listed with the
reason (the last attempt's exit code and log, or never run), never dropped silently."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from mcit.core import metrics as M
from mcit.core.checkpoint import atomic_write_text
from mcit.core.rundir import RunDir
from mcit.studies.launch import last_attempts
from mcit.studies.spec import Point, SweepSpec, setting_label, slug

METRICS = ["final_avg_acc", "final_avg_acc_task_mean", "avg_incremental_acc", "avg_incremental_acc_sample_weighted",
           "forgetting", "forgetting_mammoth", "bwt", "fwd", "mft", "mfn", "maa"]
TABLE_METRICS = ["final_avg_acc", "avg_incremental_acc", "forgetting", "bwt", "fwd"]  # the Markdown table
MCITLIB_METRICS = ["mft", "mfn", "maa", "bwt"]  # its second table: MCITlib's columns, as its papers report them


def _mean_std(values: list[float], ddof: int) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    a = np.asarray(values, dtype=float)
    return float(a.mean()), (float(a.std(ddof=ddof)) if len(a) > ddof else None)


def aggregate(spec: SweepSpec, points: list[Point]) -> dict[str, Any]:
    """Mean and std of every metric per (config, setting) over its finished points; unfinished points
    listed in ``failed`` with the reason (exit code and log of the last attempt, or never run)."""
    out = spec.out_dir()
    attempts = last_attempts(out)
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    failed: list[dict[str, Any]] = []
    per_point: list[dict[str, Any]] = []
    for p in points:
        g = groups.setdefault((p.config, p.setting_label), {
            "config": p.config, "method": p.cfg.method.name, "backbone": p.cfg.backbone.tag,
            "setting": p.setting, "setting_label": p.setting_label, "points": [], "runs": []})
        g["points"].append(p.name)
        m = RunDir(p.run_dir).finished_metrics()
        if m is not None:
            g["runs"].append(m)
            per_point.append({"point": p.name, "config": p.config, "setting": p.setting_label, "seed": p.seed,
                              "order": p.order, "status": "finished", **{k: m.get(k) for k in METRICS}})
            continue
        a = attempts.get(p.name)
        if a is None:
            reason = "never run"
        elif a.get("rc") is None:
            reason = f"submitted as Slurm job {a.get('job')}, not finished"
        else:
            reason = f"exit {a['rc']}" if a["rc"] != 0 else "exit 0 but the run is not finished"
        failed.append({"point": p.name, "config": p.config, "setting": p.setting_label, "seed": p.seed,
                       "order": p.order, "reason": reason, "log": a.get("log") if a else None})
        per_point.append({"point": p.name, "config": p.config, "setting": p.setting_label, "seed": p.seed,
                          "order": p.order, "status": f"failed: {reason}", **{k: None for k in METRICS}})
    rows = []
    for g in groups.values():
        runs = g.pop("runs")
        shas = sorted({str(r.get("backbone_sha256")) for r in runs})
        row = {**g, "n": len(runs), "n_failed": len(g["points"]) - len(runs), "backbone_sha256": shas,
               "seeds": sorted({r["seed"] for r in runs}), "orders": sorted({r["meta"]["order"] for r in runs}),
               "metrics": {}}
        for k in METRICS:
            vals = [float(r[k]) for r in runs if r.get(k) is not None]
            mean, std = _mean_std(vals, spec.std_ddof)
            row["metrics"][k] = {"mean": mean, "std": std, "values": vals}
        if runs:
            acc = np.asarray([r["acc_matrix"] for r in runs], dtype=float)
            row["acc_matrix_mean"] = acc.mean(0).tolist()
            losses = [r.get("first_task_loss") for r in runs]
            if all(ls and all(v is not None for v in ls) for ls in losses):
                arr = np.asarray(losses, dtype=float)
                row["first_task_loss"] = {"mean": arr.mean(0).tolist(),
                                          "std": (arr.std(0, ddof=spec.std_ddof).tolist() if len(arr) > spec.std_ddof
                                                  else None)}
            row["tasks"] = runs[0]["tasks"]
        rows.append(row)
    return {"sweep": spec.resolved_name, "std": "sample standard deviation (ddof=1)" if spec.std_ddof == 1
            else "population standard deviation (ddof=0)", "grid": spec.grid, "groups": rows, "failed": failed,
            "points": per_point}


def cell(m: dict[str, Any]) -> str:
    """A table cell: mean ± std, the mean alone without a std, n/a without runs."""
    if m["mean"] is None:
        return "n/a"
    return f"{m['mean']:.2f} ± {m['std']:.2f}" if m["std"] is not None else f"{m['mean']:.2f}"


def markdown(agg: dict[str, Any]) -> str:
    head = "| config | method | backbone | setting | n | " + " | ".join(TABLE_METRICS) + " |\n"
    head += "|---|---|---|---|---|" + "---|" * len(TABLE_METRICS) + "\n"
    body = "".join(
        f"| {g['config']} | {g['method']} | {g['backbone']}"
        + (" (different checkpoints!)" if len(g.get("backbone_sha256", [])) > 1 else "")
        + f" | {g['setting_label']} | {g['n']}"
        + (f" ({g['n_failed']} failed)" if g["n_failed"] else "") + " | "
        + " | ".join(cell(g["metrics"][k]) for k in TABLE_METRICS) + " |\n" for g in agg["groups"])
    text = f"# Sweep {agg['sweep']}\n\nmean ± {agg['std']} over seeds x task orders; accuracy in %.\n\n{head}{body}"
    names = [M.MCITLIB[k] for k in MCITLIB_METRICS]
    text += ("\n## MCITlib's columns\n\nMFT (each task just after learning it), MFN (all tasks after the last), MAA "
             "(the mean over steps of the seen tasks' mean), BWT; task means, as MCITlib's tables.\n\n"
             "| config | setting | n | " + " | ".join(names) + " |\n|---|---|---|" + "---|" * len(names) + "\n"
             + "".join(f"| {g['config']} | {g['setting_label']} | {g['n']} | "
                       + " | ".join(cell(g["metrics"][k]) for k in MCITLIB_METRICS) + " |\n" for g in agg["groups"]))
    if agg["failed"]:
        text += "\n## Points that did not finish\n\n| point | reason | log |\n|---|---|---|\n" + "".join(
            f"| {f['point']} | {f['reason']} | {f['log'] or ''} |\n" for f in agg["failed"])
    return text


def write_tables(spec: SweepSpec, agg: dict[str, Any]) -> list[Path]:
    """aggregate.{json,csv,md}, points.csv and report.html (mcit.run.html_report) in the sweep directory
    (atomically)."""
    out = spec.out_dir()
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["config", "method", "backbone", "setting", "n", "n_failed"]
               + [f"{k}_{s}" for k in METRICS for s in ("mean", "std")])
    for g in agg["groups"]:
        w.writerow([g["config"], g["method"], g["backbone"], g["setting_label"], g["n"], g["n_failed"]]
                   + [g["metrics"][k][s] for k in METRICS for s in ("mean", "std")])
    pbuf = io.StringIO()
    pw = csv.writer(pbuf)
    pw.writerow(["point", "config", "setting", "seed", "order", "status"] + METRICS)
    for r in agg["points"]:
        pw.writerow([r["point"], r["config"], r["setting"], r["seed"], r["order"], r["status"]]
                    + [r[k] for k in METRICS])
    from mcit.run.html_report import sweep_html

    files = {"aggregate.json": json.dumps(agg, indent=1), "aggregate.csv": buf.getvalue(),
             "aggregate.md": markdown(agg), "points.csv": pbuf.getvalue(),
             "report.html": sweep_html(agg, TABLE_METRICS, MCITLIB_METRICS)}
    for name, text in files.items():
        atomic_write_text(out / name, text)
    return [out / n for n in files]


# --------------------------------------------------------------------------------------------------
# Figures

def save_figure(fig, path: Path) -> None:
    """Write a matplotlib figure atomically (temp file + rename) and close it."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def figures(spec: SweepSpec, agg: dict[str, Any]) -> list[Path]:
    """PNGs beside the tables: accuracy and forgetting against each numeric grid key, each task's
    accuracy across the sequence, and the loss on the first task's data after each task."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out = spec.out_dir()
    groups = [g for g in agg["groups"] if g["n"] > 0]
    made: list[Path] = []
    for key, values in spec.grid.items():
        if len(values) < 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            continue
        lines: dict[str, list[tuple[float, dict]]] = {}
        for g in groups:
            rest = {k: v for k, v in g["setting"].items() if k != key}
            label = g["config"] + (f" ({setting_label(rest)})" if rest else "")
            lines.setdefault(label, []).append((float(g["setting"][key]), g["metrics"]))
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        titles = ("final average accuracy (%)", "forgetting (%)")
        for ax, metric, title in zip(axes, ("final_avg_acc", "forgetting"), titles):
            for label, pts in lines.items():
                pts.sort(key=lambda x: x[0])
                xs = [x for x, _ in pts]
                ys = [m[metric]["mean"] for _, m in pts]
                es = [m[metric]["std"] or 0.0 for _, m in pts]
                ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label)
            ax.set_xlabel(key.removeprefix("method."))
            ax.set_title(title)
            ax.grid(alpha=0.3)
            if sorted(values, reverse=True) == list(values):  # given high to low (eta 1.0 -> 0.8): plot so
                ax.invert_xaxis()
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{agg['sweep']}: mean ± std over seeds x orders")
        fig.tight_layout()
        path = out / f"curve_{slug(key.removeprefix('method.'))}.png"
        save_figure(fig, path)
        made.append(path)
    if groups:
        n = len(groups)
        cols = min(n, 4)
        rows = (n + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
        for ax, g in zip(axes.flat, groups):
            acc = np.asarray(g["acc_matrix_mean"])
            T = acc.shape[0]
            for i in range(T):
                ax.plot(range(i, T), acc[i:, i], marker="o", ms=3, label=f"task {i + 1}")
            ax.set_title(f"{g['config']}\n{g['setting_label']}", fontsize=8)
            ax.set_xticks(range(T), [str(t + 1) for t in range(T)])
            ax.set_xlabel("after training task")
            ax.set_ylim(0, 100)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        axes[0][0].set_ylabel("accuracy (%)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle("accuracy of each task (by position in the sequence) across the sequence, mean over runs")
        fig.tight_layout()
        path = out / "task_accuracy.png"
        save_figure(fig, path)
        made.append(path)
    with_loss = [g for g in groups if g.get("first_task_loss")]
    if with_loss:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for g in with_loss:
            mean = np.asarray(g["first_task_loss"]["mean"])
            xs = np.arange(1, len(mean) + 1)
            ax.plot(xs, mean, marker="o", label=f"{g['config']} {g['setting_label']}")
            if g["first_task_loss"]["std"] is not None:
                std = np.asarray(g["first_task_loss"]["std"])
                ax.fill_between(xs, mean - std, mean + std, alpha=0.15)
        ax.set_xticks(range(1, len(mean) + 1))
        ax.set_xlabel("after training task")
        ax.set_ylabel("loss on the first task's test data")
        ax.set_title("training interference: the first task's loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / "first_task_loss.png"
        save_figure(fig, path)
        made.append(path)
    return made
