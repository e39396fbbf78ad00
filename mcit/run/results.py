"""A run's results from its committed accuracy-matrix rows: metrics.json, and once every task is done the
heatmap and report.md; the summary the programs print. Both the staged loop and evaluation-only passes
(``--write-rows``) write them through here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mcit.core import metrics as M
from mcit.core.checkpoint import atomic_write_text, read_json, write_json
from mcit.run.plan import Plan


def rows(plan: Plan, done: int) -> tuple[list[list[float]], list[float] | None, list[int]]:
    """The first ``done`` accuracy-matrix rows, the zero-shot row (or None) and the test counts."""
    rd = plan.run
    acc = [read_json(rd.row(t))["acc"] for t in range(done)]
    zs = read_json(rd.row(None))["acc"] if rd.row(None).is_file() else None
    if plan.test:
        return acc, zs, [s.num_samples for s in plan.test]
    return acc, zs, list(read_json(rd.row(0))["total"])  # a plan built from the run directory alone (--rescore)


def write_metrics(plan: Plan, done: int) -> dict[str, Any]:
    """metrics.json from the first ``done`` rows; once every task is done also the heatmap, report.md and
    report.html."""
    cfg, rd = plan.cfg, plan.run
    acc, zs, counts = rows(plan, done)
    T = plan.num_stages
    if cfg.data.schedule == "joint":  # one row after training on every task at once
        m = M.compute_joint(acc[0], counts)
    else:
        m = M.compute([row[:done] for row in acc], counts[:done], zs[:done] if zs else None)
    first_loss = [read_json(rd.row(t)).get("first_task_loss") for t in range(done)]
    record = plan.backbone.record
    out = {"name": cfg.name, "method": cfg.method.name, "backbone": cfg.backbone.tag,
           "tasks": plan.names, "schedule": cfg.data.schedule, "rows": plan.stage_names[:done],
           "evaluated_on": "validation" if cfg.data.validation else "test", "scorers": plan.scorers,
           "test_counts": counts, "acc_unit": "percent",
           "complete": done == T, "tasks_done": done, "acc_matrix": acc, "zero_shot": zs,
           "first_task_loss": first_loss, "seed": cfg.seed, "meta": cfg.meta,
           "backbone_sha256": record.get("sha256"), "backbone_format": record.get("format"), **m}
    if plan.auxiliary:  # a method's other frozen models (STAR-Prompt's CLIP), like the backbone
        out["auxiliary_backbones"] = {name: {k: aux.record.get(k) for k in ("tag", "format", "sha256")}
                                      for name, aux in plan.auxiliary.items()}
    general = M.general_rows(rd.eval_dir())  # lmms-eval's numbers per evaluated state (mcit-evaluate --lmms-eval)
    if general:
        out["general_ability"] = dict(general)
    write_json(rd.metrics, out)
    if done == T:
        M.heatmap(rd.heatmap, plan.names, acc, f"{cfg.name} ({cfg.method.name})", rows=plan.stage_names)
        report = M.report_markdown(cfg.name, cfg.method.name, cfg.backbone.tag, plan.names, counts, acc, zs, m,
                                   out["backbone_sha256"], heatmap_file=rd.heatmap.name, rows=plan.stage_names)
        atomic_write_text(rd.report, report + M.general_markdown(general, M.general_limits(rd.eval_dir())))
        if cfg.log.html_report:
            from mcit.run.html_report import write_run_html

            try:
                write_run_html(rd.root, plan.test or None)
            except Exception as e:  # noqa: BLE001 - the run's results are written: a page it cannot draw is a warning
                print(f"warning: report.html not written ({e.__class__.__name__}: {e}); `mcit-report --html "
                      f"{rd.root}` writes it", file=sys.stderr, flush=True)
    return out


def summary_text(metrics: dict[str, Any], run_dir: Any) -> str:
    lines = [f"== {metrics['name']} · method {metrics['method']} · {run_dir} ==",
             "accuracy matrix (%), rows: after training task t; columns: task i",
             M.format_matrix(metrics["tasks"], metrics["acc_matrix"], metrics.get("zero_shot"), metrics.get("rows")),
             M.format_summary(metrics)]
    page = Path(run_dir) / "report.html"
    if page.is_file():
        lines.append(f"HTML report: {page}")
    return "\n".join(lines)
