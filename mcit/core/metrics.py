"""Accuracy matrix -> continual-learning metrics, the heatmap and the report.

``acc[t][i]`` is the accuracy (percent) on task i after training task t, for every i (tasks not yet
seen included); ``zero_shot[i]`` is the accuracy on task i before any training. Definitions:

* final_avg_acc: accuracy over all test samples after the last task (sample-weighted);
  final_avg_acc_task_mean: the mean of the last row. Code bases report either; we report both.
* avg_incremental_acc: mean over t of the task-mean accuracy on tasks 0..t after task t
  (and the sample-weighted variant).
* forgetting (Chaudhry et al. 2018): mean over i < T-1 of max_{t in [i, T-2]} acc[t][i] - acc[T-1][i];
  negative when the last task improved an old one.
* forgetting_mammoth: mammoth's ``utils.metrics.forgetting``, whose maximum runs over every row
  including the last (t in [i, T-1]), so each task's term is clamped at 0: compare with mammoth's tables.
* bwt (Lopez-Paz & Ranzato 2017): mean over i < T-1 of acc[T-1][i] - acc[i][i].
* fwd (Lopez-Paz & Ranzato 2017): mean over i > 0 of acc[i-1][i] - zero_shot[i].
* MCITlib's columns (Guo et al. 2025, the numbers its tables report): mft, the mean of the diagonal (each task
  just after learning it); mfn, the mean of the last row (= final_avg_acc_task_mean); maa, the mean over t of
  the mean of acc[t][0..t] (= avg_incremental_acc); and its BWT, which is ``bwt`` above. All task means, not
  sample-weighted; the upper triangle is never read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def compute(acc: list[list[float]], counts: list[int], zero_shot: list[float] | None = None) -> dict[str, Any]:
    a = np.asarray(acc, dtype=float)
    T = a.shape[0]
    if a.shape != (T, T):
        raise ValueError(f"accuracy matrix must be square (T x T), got {a.shape}")
    n = np.asarray(counts, dtype=float)
    last = a[T - 1]
    out: dict[str, Any] = {
        "final_avg_acc": float((last * n).sum() / n.sum()),
        "final_avg_acc_task_mean": float(last.mean()),
        "avg_incremental_acc": float(np.mean([a[t, : t + 1].mean() for t in range(T)])),
        "avg_incremental_acc_sample_weighted": float(
            np.mean([(a[t, : t + 1] * n[: t + 1]).sum() / n[: t + 1].sum() for t in range(T)])),
    }
    out["mft"] = float(np.mean(np.diag(a)))
    out["mfn"] = out["final_avg_acc_task_mean"]
    out["maa"] = out["avg_incremental_acc"]
    if T > 1:
        out["forgetting"] = float(np.mean([a[i : T - 1, i].max() - a[T - 1, i] for i in range(T - 1)]))
        out["forgetting_mammoth"] = float(np.mean([a[i:, i].max() - a[T - 1, i] for i in range(T - 1)]))
        out["bwt"] = float(np.mean([a[T - 1, i] - a[i, i] for i in range(T - 1)]))
    else:
        out["forgetting"] = 0.0
        out["forgetting_mammoth"] = 0.0
        out["bwt"] = 0.0
    if zero_shot is not None and T > 1:
        z = np.asarray(zero_shot, dtype=float)
        out["fwd"] = float(np.mean([a[i - 1, i] - z[i] for i in range(1, T)]))
    else:
        out["fwd"] = None
    return out


def compute_joint(row: list[float], counts: list[int]) -> dict[str, Any]:
    """The multi-task bound's metrics: one row after training on every task at once, so only its averages; the
    sequence metrics (incremental accuracy, forgetting, BWT, forward transfer) do not exist for it."""
    a, n = np.asarray(row, dtype=float), np.asarray(counts, dtype=float)
    return {"final_avg_acc": float((a * n).sum() / n.sum()), "final_avg_acc_task_mean": float(a.mean()),
            "avg_incremental_acc": None, "avg_incremental_acc_sample_weighted": None, "mft": None,
            "mfn": float(a.mean()), "maa": None, "forgetting": None, "forgetting_mammoth": None, "bwt": None,
            "fwd": None}


def format_matrix(tasks: list[str], acc: list[list[float]], zero_shot: list[float] | None = None,
                  rows: list[str] | None = None) -> str:
    """Plain-text table: rows = after training task t (``rows``, default ``tasks``), columns = evaluated task i."""
    w = max(8, max(len(t) for t in tasks) + 1)
    lines = ["after \\ on".ljust(12) + "".join(t.rjust(w) for t in tasks)]
    if zero_shot is not None:
        lines.append("zero-shot".ljust(12) + "".join(f"{v:{w}.2f}" for v in zero_shot))
    for t, row in enumerate(acc):
        lines.append((rows or tasks)[t].ljust(12) + "".join(f"{v:{w}.2f}" for v in row))
    return "\n".join(lines)


MCITLIB = {"mft": "MFT", "mfn": "MFN", "maa": "MAA", "bwt": "BWT"}  # MCITlib's column names
# A run's final metrics (``compute``'s keys), in the order reports show them
FINAL_METRICS = ("final_avg_acc", "final_avg_acc_task_mean", "avg_incremental_acc",
                 "avg_incremental_acc_sample_weighted", "forgetting", "forgetting_mammoth", "bwt", "fwd", "mft", "mfn",
                 "maa")


def format_summary(m: dict[str, Any]) -> str:
    keys = ["final_avg_acc", "final_avg_acc_task_mean", "avg_incremental_acc", "forgetting", "bwt", "fwd"]
    line = "  ".join(f"{k}={m[k]:.2f}" if m.get(k) is not None else f"{k}=n/a" for k in keys)
    if "mft" not in m:  # metrics written before MCITlib's columns existed
        return line
    return line + "\nMCITlib: " + "  ".join(f"{v}={m[k]:.2f}" if m.get(k) is not None else f"{v}=n/a"
                                           for k, v in MCITLIB.items())


def heatmap(path: Path, tasks: list[str], acc: list[list[float]], title: str, rows: list[str] | None = None) -> None:
    """PNG heatmap of the accuracy matrix (matplotlib, non-interactive backend)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    a = np.asarray(acc, dtype=float)
    fig, ax = plt.subplots(figsize=(1.2 + 0.8 * len(tasks), 1.6 + 0.7 * a.shape[0]))
    im = ax.imshow(a, vmin=0, vmax=100, cmap="viridis")
    ax.set_xticks(range(len(tasks)), tasks, rotation=45, ha="right")
    ax.set_yticks(range(a.shape[0]), [f"after {t}" for t in (rows or tasks)[: a.shape[0]]])
    ax.set_xlabel("evaluated on")
    for t in range(a.shape[0]):
        for i in range(a.shape[1]):
            ax.text(i, t, f"{a[t, i]:.0f}", ha="center", va="center", color="w" if a[t, i] < 60 else "k",
                    fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    ax.set_title(title)
    fig.tight_layout()
    import io

    from mcit.core.checkpoint import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def report_markdown(name: str, method: str, backbone: str, tasks: list[str], counts: list[int],
                    acc: list[list[float]], zero_shot: list[float] | None, m: dict[str, Any],
                    backbone_sha256: str | None = None, heatmap_file: str = "acc_matrix.png",
                    rows: list[str] | None = None) -> str:
    head = "| after \\ on | " + " | ".join(tasks) + " |\n|---|" + "---|" * len(tasks) + "\n"
    table = ""
    if zero_shot is not None:
        table += "| zero-shot | " + " | ".join(f"{v:.2f}" for v in zero_shot) + " |\n"
    for t, row in enumerate(acc):
        table += f"| {(rows or tasks)[t]} | " + " | ".join(f"{v:.2f}" for v in row) + " |\n"
    names = {k: f"{k} ({MCITLIB[k]})" if k in MCITLIB else k for k in m}
    metric_rows = "".join(f"| {names[k]} | {'n/a' if v is None else f'{v:.2f}'} |\n" for k, v in m.items())
    sha = f" (sha256 `{backbone_sha256[:16]}`)" if backbone_sha256 else ""
    return (f"# {name}\n\nmethod: `{method}` · backbone: `{backbone}`{sha} · test samples per task: {counts}\n\n"
            f"## Accuracy matrix (%)\n\n{head}{table}\n![accuracy matrix]({heatmap_file})\n\n"
            f"## Metrics\n\n| metric | value |\n|---|---|\n{metric_rows}")


def general_rows(eval_dir: Path) -> list[tuple[str, dict[str, dict[str, float]]]]:
    """The general-ability rows a run holds (``eval/general/<row>.json``, written by mcit.run.general_ability):
    zero-shot first, then by task."""
    import json

    where = eval_dir / "general"
    if not where.is_dir():
        return []
    found = []
    for f in where.glob("*.json"):
        d = json.loads(f.read_text())
        k = d.get("checkpoint")
        found.append((-1 if k is None else int(k), f.stem, d.get("results") or {}))
    return [(tag, res) for _, tag, res in sorted(found)]


def general_limits(eval_dir: Path) -> dict[str, dict[str, int]]:
    """Per general-ability row, the result names (tasks and their subtasks) that were answered with a sample limit
    (lmms-eval's first N questions), and N."""
    import json

    out: dict[str, dict[str, int]] = {}
    where = eval_dir / "general"
    for f in sorted(where.glob("*.json")) if where.is_dir() else []:
        d = json.loads(f.read_text())
        limits = d.get("limits") or {t: d.get("limit") for t in d.get("tasks") or []}
        cells = d.get("cells") or {}
        for task, n in limits.items():
            if n is not None:
                for name in {task, *(cells.get(task) or {}).get("names", [])}:
                    out.setdefault(f.stem, {})[name] = int(n)
    return out


def general_markdown(rows: list[tuple[str, dict[str, dict[str, float]]]],
                     limits: dict[str, dict[str, int]] | None = None) -> str:
    """report.md's general-ability table: one row per evaluated state, one column per task and metric; a number
    answered on the first N questions only (``--lmms-limit``) is marked, with N, under the table."""
    if not rows:
        return ""
    limits = limits or {}
    cols = sorted({(t, m) for _, res in rows for t, ms in res.items() for m in ms})
    head = "| row | " + " | ".join(f"{t} {m}" for t, m in cols) + " |\n|---|" + "---|" * len(cols) + "\n"

    def cell(tag: str, res: dict, t: str, m: str) -> str:
        if t not in res or m not in res[t]:
            return "n/a"
        return f"{res[t][m]:.4g}" + (" †" if t in limits.get(tag, {}) else "")

    body = "".join(f"| {tag.replace('_', ' ')} | " + " | ".join(cell(tag, res, t, m) for t, m in cols) + " |\n"
                   for tag, res in rows)
    marked = [f"{tag.replace('_', ' ')}: " + ", ".join(f"{t} (first {n})" for t, n in sorted(limits[tag].items()))
              for tag, _ in rows if limits.get(tag)]
    note = ("\n† answered on the first N questions only (`--lmms-limit`), not comparable with a full pass: "
            + "; ".join(marked) + ".\n") if marked else ""
    return ("\n## General ability (lmms-eval)\n\nThe base model's general ability through the sequence: lmms-eval's "
            "numbers (its metrics' own scale) for the zero-shot state and after each evaluated task "
            "(`mcit-evaluate --lmms-eval`).\n\n" + head + body + note)
