"""Tables and figures of a study made of sweeps: the selection rule, the seeds table, the plots under docs/.

    mcit-study --selection runs/sweeps/tiny_mcit_tuning_prompts runs/sweeps/tiny_mcit_tuning_lora \\
        runs/sweeps/tiny_mcit_fwd_prompt_ablation --final runs/sweeps/tiny_mcit_seeds --out docs/mcit_study

Selection sweeps evaluate on a validation carve (``data.validation``); the final sweep runs each method's chosen
defaults on the test split. The rule that picks a method's defaults (written in each config's comments): among
the settings of that config in the selection sweeps, the one with the highest mean validation ``final_avg_acc``
over the seeds; where it beats the config's own setting by less than the larger of the two standard deviations,
the config's own setting stays (a gap inside the seed noise is no evidence).

Plasticity is the mean of the accuracy matrix's diagonal (each task right after it was learned): what a method
can still learn, the other side of forgetting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mcit.core import metrics as M
from mcit.core.checkpoint import atomic_write_text
from mcit.core.config import load_config
from mcit.studies.results import cell, save_figure

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["final_avg_acc", "plasticity", "forgetting", "bwt", "fwd"]


def load(sweep_dir: Path) -> dict[str, Any]:
    path = sweep_dir / "aggregate.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found (has the sweep run and aggregated?)")
    return json.loads(path.read_text())


def plasticity_values(group: dict[str, Any], sweep_dir: Path) -> list[float]:
    """Per-run plasticity (for its spread over seeds), read from the runs' metrics.json."""
    out = []
    for p in group["points"]:
        m = sweep_dir / "runs" / p / "metrics.json"
        if m.is_file():
            acc = np.asarray(json.loads(m.read_text())["acc_matrix"], dtype=float)
            if acc.shape[0] == acc.shape[1] > 1:
                out.append(float(np.diag(acc).mean()))
    return out


def own_setting(config: str, setting: dict[str, Any], configs_dir: Path) -> bool:
    """Whether ``setting`` is the config's own values (``configs/<config>.yaml``)."""
    path = configs_dir / f"{config}.yaml"
    if not path.is_file():
        return False
    raw = load_config(path).model_dump()
    for key, value in setting.items():
        node: Any = raw
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != value:
            return False
    return True


def rows_of(sweeps: list[Path]) -> list[dict[str, Any]]:
    """One row per (config, setting) of every sweep, with the metrics' mean/std and plasticity added."""
    rows = []
    for d in sweeps:
        agg = load(d)
        for g in agg["groups"]:
            if not g["n"]:
                continue
            pv = plasticity_values(g, d)
            metrics = {**g["metrics"], "plasticity": {
                "mean": float(np.mean(pv)) if pv else None,
                "std": float(np.std(pv, ddof=1)) if len(pv) > 1 else None, "values": pv}}
            rows.append({"sweep": agg["sweep"], "config": g["config"], "method": g["method"], "setting": g["setting"],
                         "label": g["setting_label"], "n": g["n"], "metrics": metrics,
                         "acc": g.get("acc_matrix_mean"), "tasks": g.get("tasks")})
    return rows


def select(rows: list[dict[str, Any]], configs_dir: Path) -> dict[str, dict[str, Any]]:
    """The rule (module docstring): per config, the chosen row."""
    chosen: dict[str, dict[str, Any]] = {}
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        best = max(mine, key=lambda r: r["metrics"]["final_avg_acc"]["mean"])
        own = next((r for r in mine if own_setting(config, r["setting"], configs_dir)), None)
        if own is not None and own is not best:
            gap = best["metrics"]["final_avg_acc"]["mean"] - own["metrics"]["final_avg_acc"]["mean"]
            noise = max(best["metrics"]["final_avg_acc"]["std"] or 0.0, own["metrics"]["final_avg_acc"]["std"] or 0.0)
            if gap < noise:
                best = own
        chosen[config] = best
    return chosen


def table(rows: list[dict[str, Any]], chosen: dict[str, dict[str, Any]] | None = None) -> str:
    head = "| config | setting | n | " + " | ".join(COLUMNS) + " |\n|---|---|---|" + "---|" * len(COLUMNS) + "\n"
    body = ""
    for r in rows:
        mark = " **(chosen)**" if chosen and chosen.get(r["config"]) is r else ""
        body += (f"| {r['config'].removeprefix('tiny_mcit_')} | {r['label']}{mark} | {r['n']} | "
                 + " | ".join(cell(r["metrics"][k]) for k in COLUMNS) + " |\n")
    return head + body


def zero_shot_row(final: Path) -> dict[str, Any] | None:
    """Mean ± std over the final sweep's runs of the zero-shot row's sample-weighted average."""
    vals = []
    for m in sorted((final / "runs").glob("*/metrics.json")):
        d = json.loads(m.read_text())
        if d.get("zero_shot") and d.get("schedule", "sequential") == "sequential":
            vals.append(M.compute_joint(d["zero_shot"], d["test_counts"])["final_avg_acc"])
    if not vals:
        return None
    return {"config": "zero_shot", "label": "pre-trained backbone", "n": len(vals), "metrics": {
        "final_avg_acc": {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else None},
        **{k: {"mean": None} for k in COLUMNS[1:]}}}


def figures(selection: list[dict[str, Any]], final: list[dict[str, Any]], out: Path,
            prefix: str = "mcit_study") -> list[Path]:
    """The figures, named ``<prefix>_<figure>.png`` in ``out`` (a study's own, so two studies beside each other in
    docs/ keep theirs)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    made = []
    seq = [r for r in final if r.get("acc") and len(r["acc"]) > 1]
    if seq:  # the accuracy-matrix grid of the final (test-split) runs
        cols = min(len(seq), 7)  # rows of at most 7 matrices
        rows = -(-len(seq) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.1 * cols, 3.2 * rows), squeeze=False)
        for ax in axes.flat[len(seq):]:
            ax.axis("off")
        for ax, r in zip(axes.flat, seq):
            a = np.asarray(r["acc"], dtype=float)
            ax.imshow(a, vmin=0, vmax=100, cmap="viridis")
            for t in range(a.shape[0]):
                for i in range(a.shape[1]):
                    ax.text(i, t, f"{a[t, i]:.0f}", ha="center", va="center", fontsize=7,
                            color="white" if a[t, i] < 60 else "black")
            ax.set_title(r["config"].removeprefix("tiny_mcit_"), fontsize=9)
            ax.set_xticks(range(a.shape[1]), r["tasks"], rotation=45, ha="right", fontsize=7)
            ax.set_yticks(range(a.shape[0]), [f"after {t}" for t in r["tasks"]], fontsize=7)
        fig.suptitle("accuracy matrices (%), test split, mean over seeds")
        fig.tight_layout()
        made.append(_saved(fig, out / f"{prefix}_matrices.png"))

    fp = [r for r in selection if r["method"] == "fwd_prompt"]
    eps_keys = ("method.eps_task", "method.eps_pretrained")
    if fp:  # eta/eps trade-off: the ablation's energy settings against the default point
        default = next((r for r in fp if own_setting(r["config"], r["setting"], ROOT / "configs")), None)
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        for ax, key in zip(axes, eps_keys):
            pts = [(r["setting"][key], r) for r in fp if set(r["setting"]) == {key}]
            if default is not None:
                params = load_config(ROOT / "configs" / f"{default['config']}.yaml").method.model_dump()
                pts.append((params[key.removeprefix("method.")], default))
            pts.sort(key=lambda x: x[0])
            for metric, style in (("plasticity", "o-"), ("forgetting", "s--"), ("final_avg_acc", "^-")):
                ys = [p[1]["metrics"][metric]["mean"] for p in pts]
                es = [p[1]["metrics"][metric]["std"] or 0.0 for p in pts]
                ax.errorbar([p[0] for p in pts], ys, yerr=es, fmt=style, capsize=3, label=metric)
            ax.set_xlabel(key.removeprefix("method.") + " (more energy kept: more locked directions)")
            ax.set_ylabel("% (validation)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle("Fwd-Prompt: subspace energy against plasticity and forgetting (mean ± std, 3 seeds)")
        fig.tight_layout()
        made.append(_saved(fig, out / f"{prefix}_eps.png"))

    pts = [r for r in selection if r["metrics"]["plasticity"]["mean"] is not None]
    if pts:  # forgetting against plasticity, every selection point
        fig, ax = plt.subplots(figsize=(7.5, 5))
        methods = list(dict.fromkeys(r["method"] for r in pts))
        colours = plt.get_cmap("tab10")
        for k, method in enumerate(methods):
            mine = [r for r in pts if r["method"] == method]
            ax.errorbar([r["metrics"]["plasticity"]["mean"] for r in mine],
                        [r["metrics"]["forgetting"]["mean"] for r in mine],
                        xerr=[r["metrics"]["plasticity"]["std"] or 0 for r in mine],
                        yerr=[r["metrics"]["forgetting"]["std"] or 0 for r in mine],
                        fmt="o", capsize=2, color=colours(k), label=method)
            for r in mine:
                ax.annotate(r["label"], (r["metrics"]["plasticity"]["mean"], r["metrics"]["forgetting"]["mean"]),
                            fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("plasticity: mean accuracy right after learning each task (%)")
        ax.set_ylabel("forgetting (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("forgetting vs plasticity, validation carve, mean ± std over 3 seeds")
        fig.tight_layout()
        made.append(_saved(fig, out / f"{prefix}_plasticity_forgetting.png"))
    return made


def _saved(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    return path


def write_study(selection_sweeps: list[Path], final_sweep: Path | None, out: Path | None,
                published: list[Path] | None = None) -> tuple[str, list[Path]]:
    """The study's Markdown (selection table with the chosen settings, then the test-split table) and, with
    ``out``, ``<out>.md``, the figures beside it (``<out name>_matrices.png``, ...) and ``<out>.html`` (the tables,
    sortable, and the figures in one page: ``mcit.run.html_report``); returns (text, files written). ``published``:
    published files (``mcit.studies.published``) whose numbers go beside the final sweep's."""
    selection = rows_of(selection_sweeps)
    chosen = select(selection, ROOT / "configs") if selection else {}
    text = ""
    if selection:
        text += "## Selection (validation carve)\n\n" + table(selection, chosen) + "\n"
    final = rows_of([final_sweep]) if final_sweep else []
    if final:
        zs = zero_shot_row(final_sweep)
        text += "## Test split, chosen defaults\n\n" + table(([zs] if zs else []) + final) + "\n"
    pairs: list = []
    if published and final_sweep is not None:  # the published numbers beside the test-split table
        from mcit.studies import published as P

        ours = P.ours_of([], [load(final_sweep)])
        for f in published:
            pairs += P.compare(P.load(f), ours)[0]
        text += "\n" + P.markdown(pairs, 0)
    made: list[Path] = []
    if out is not None:
        from mcit.run.html_report import published_html, study_html

        atomic_write_text(out.with_suffix(".md"), text)
        made = figures(selection, final, out.parent, prefix=out.name)
        sections = []
        if selection:
            sections.append(("Selection (validation carve)", selection, {id(r) for r in chosen.values()}))
        if final:
            sections.append(("Test split, chosen defaults", ([zs] if zs else []) + final, set()))
        atomic_write_text(out.with_suffix(".html"),
                          study_html(f"Study {out.name}", sections, COLUMNS, made, published_html(pairs)))
        made.append(out.with_suffix(".html"))
    return text, made
