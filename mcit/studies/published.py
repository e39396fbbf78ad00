"""Published numbers beside ours: the ``published`` file format and the published / ours / Δ table.

A published file (YAML; the project's own for the seed papers' tables are in ``published/``) holds one paper's
numbers as printed::

    paper: "Mixture of Experts Meets Prompt-Based Continual Learning"
    arxiv: "2405.14124"
    rows:
      - {table: "Table 1", setting: "Split CIFAR-100, 10 tasks, ViT-B/16 Sup-21K", method: NoRGa,
         benchmark: cifar100_10, metric: final_avg_acc, value: 94.48, std: 0.13,
         where: "Table 1, row NoRGa, column FA", config: configs/cil/cifar100_10_norga.yaml}

``metric`` is one of a run's final metrics (``mcit.core.metrics.FINAL_METRICS``: final_avg_acc is the papers' FA,
avg_incremental_acc their CA, forgetting their FM); ``config`` names the shipped config that reproduces the row
(null where none does: the row is printed for reference only). ``mcit-report --published FILE RUN_OR_SWEEP ...``
matches each row to the run or the sweep group of that config (by its file name) and prints published, ours
(a run's value, a sweep's mean ± std) and Δ = ours − published. For every benchmark the report covers, each of its
rows with a config must have a run: a method the study lacks is an error, not a silent gap; rows of benchmarks the
report does not cover are left out and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mcit.core.metrics import FINAL_METRICS

FIELDS = ("table", "setting", "method", "benchmark", "metric", "value", "where", "config")


class PublishedError(ValueError):
    """A published file that cannot be used, or a row the report cannot answer; one line."""


@dataclass(frozen=True)
class Row:
    paper: str
    arxiv: str | None
    table: str
    setting: str
    method: str
    benchmark: str
    metric: str
    value: float
    std: float | None
    where: str
    config: str | None
    source: str  # the file and the row's index, for messages

    @property
    def config_name(self) -> str | None:
        return Path(self.config).stem if self.config else None


def load(path: Path) -> list[Row]:
    """The rows of a published file, each checked (its fields, a known metric, a number)."""
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise PublishedError(f"{path}: no such published file") from None
    except yaml.YAMLError as e:
        raise PublishedError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or not doc.get("paper"):
        raise PublishedError(f"{path}: expected a mapping with 'paper' and a list of 'rows'")
    out = []
    for i, r in enumerate(doc["rows"]):
        where = f"{path} row {i}"
        if not isinstance(r, dict):
            raise PublishedError(f"{where}: not a mapping")
        missing = [f for f in FIELDS if f not in r]
        if missing:
            raise PublishedError(f"{where}: missing {', '.join(missing)}")
        if r["metric"] not in FINAL_METRICS:
            raise PublishedError(f"{where} ({r['method']}, {r['table']}): unknown metric {r['metric']!r} "
                                 f"(one of: {', '.join(FINAL_METRICS)})")
        try:
            value, std = float(r["value"]), None if r.get("std") is None else float(r["std"])
        except (TypeError, ValueError):
            raise PublishedError(f"{where} ({r['method']}): value {r['value']!r} is not a number") from None
        out.append(Row(str(doc["paper"]), doc.get("arxiv"), str(r["table"]), str(r["setting"]), str(r["method"]),
                       str(r["benchmark"]), r["metric"], value, std, str(r["where"]), r["config"], where))
    return out


def ours_of(runs: list[dict[str, Any]], sweeps: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """{config name: {metric: {"mean", "std", "n"}}} of finished runs (metrics.json, by the run's name) and sweep
    groups (aggregate.json, by the group's config; one setting per config: the first)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for g in (g for agg in sweeps for g in agg["groups"] if g["n"]):
        out.setdefault(g["config"], {k: {**g["metrics"][k], "n": g["n"]} for k in FINAL_METRICS if k in g["metrics"]})
    for m in runs:
        out.setdefault(m["name"], {k: {"mean": m.get(k), "std": None, "n": 1} for k in FINAL_METRICS})
    return out


def compare(rows: list[Row], ours: dict[str, dict[str, dict[str, Any]]]) -> tuple[list[tuple[Row, dict]], int]:
    """(row, ours) for every row of a benchmark the report covers, and how many rows of other benchmarks were
    left out; a covered benchmark's row whose config has no run is an error."""
    covered = {r.benchmark for r in rows if r.config_name in ours}
    if not covered:
        names = sorted({r.config_name for r in rows if r.config_name})
        raise PublishedError(f"{rows[0].source.rsplit(' row', 1)[0]}: none of its rows' configs is among the runs "
                             f"given (it names {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}; given: "
                             f"{', '.join(sorted(ours)) or 'none'})")
    out = []
    for r in rows:
        if r.benchmark not in covered or r.config_name is None:
            continue
        if r.config_name not in ours:
            raise PublishedError(f"{r.source} ({r.method}, {r.table}, {r.benchmark}): the report has no run of "
                                 f"{r.config} (given: {', '.join(sorted(ours))})")
        out.append((r, ours[r.config_name][r.metric]))
    skipped = sum(1 for r in rows if r.benchmark not in covered)
    return out, skipped


def markdown(pairs: list[tuple[Row, dict]], skipped: int) -> str:
    head = ("| paper | table | setting | method | metric | published | ours | Δ | config |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    body = ""
    for r, o in pairs:
        pub = f"{r.value:.2f}" + (f" ± {r.std:.2f}" if r.std is not None else "")
        mine = "n/a" if o["mean"] is None else f"{o['mean']:.2f}" + (f" ± {o['std']:.2f}" if o.get("std") else "")
        delta = "n/a" if o["mean"] is None else f"{o['mean'] - r.value:+.2f}"
        body += (f"| {r.paper} ({r.arxiv}) | {r.table} | {r.setting} | {r.method} | {r.metric} | {pub} | {mine} | "
                 f"{delta} | {Path(r.config).stem if r.config else ''} |\n")
    note = f"\n{skipped} published rows of benchmarks not in this report left out.\n" if skipped else ""
    return "## Published numbers beside ours\n\nΔ = ours − published (percentage points).\n\n" + head + body + note
