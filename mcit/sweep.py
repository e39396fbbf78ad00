"""Experiment suites: seeds x task orders x config settings, each point an ordinary run directory.

A spec (YAML file or command line, see ``pipelines/sweep.py``) expands to *points*. A point is one of
the spec's configs with overrides -- its setting (grid values), ``seed``, the task sequence in the
point's order, ``meta`` recording all three, ``run_dir`` -- validated like any config and written to
``<out>/configs/<point>.yaml``; the ordinary pipeline runs it into ``<out>/runs/<point>``. So every
point resumes, can be evaluated alone, and a point whose run finished is never run again:
re-submitting a sweep runs only what is missing (failed, killed, newly added seeds).

Task orders: order id 0 is the config's own order; id k > 0 is ``numpy.random.RandomState(k)``'s
permutation; explicit permutations are lists. ``order_unit: task`` permutes the config's tasks;
``class`` permutes the classes of a class-incremental sequence and regroups them into tasks of the
original sizes (the usual "class order" of CIL papers): the regrouped shards are written once per
order under ``<out>/data/`` by reading the source shards.

Aggregation reads every point's metrics.json and reports each metric as mean and standard deviation
over the seeds and orders of each (config, setting); points that did not finish are listed with the
reason, never dropped silently.
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mcit.checkpoint import atomic_write_text
from mcit.config import ConfigError, RunConfig, dump_config, load_config, parse_override, \
    load_yaml, validate_config, yaml_problem
from mcit.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
METRICS = ["final_avg_acc", "final_avg_acc_task_mean", "avg_incremental_acc", "avg_incremental_acc_sample_weighted",
           "forgetting", "forgetting_mammoth", "bwt", "fwd"]
TABLE_METRICS = ["final_avg_acc", "avg_incremental_acc", "forgetting", "bwt", "fwd"]  # the Markdown table


class SweepSpec(BaseModel):
    """What a sweep runs. Paths are relative to the directory the sweep is started from (the repo root)."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, description="default: the first config's name + '_sweep'")
    configs: list[str] = Field(min_length=1, description="run configs; one table row group per config")
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    orders: list[int | list[int]] = Field(
        default_factory=lambda: [0], min_length=1,
        description="order ids (0: the config's order, k: seeded shuffle k) or explicit permutations")
    order_unit: Literal["auto", "task", "class"] = Field(
        "auto", description="what an order permutes; auto: classes for image classifiers, tasks otherwise")
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="key.path -> values (cartesian product)")
    settings: list[dict[str, Any]] = Field(
        default_factory=list, description="explicit settings (key.path -> value each), crossed with the grid")
    overrides: list[str] = Field(default_factory=list, description="key.path=value applied to every point")
    out: str | None = Field(None, description="sweep directory (default runs/sweeps/<name>)")
    std_ddof: int = Field(1, ge=0, le=1, description="1: sample standard deviation; 0: population")

    @field_validator("grid")
    @classmethod
    def _non_empty_values(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for k, vals in v.items():
            if not vals:
                raise ValueError(f"grid key {k!r} has no values")
        return v

    @property
    def resolved_name(self) -> str:
        return self.name or f"{Path(self.configs[0]).stem}_sweep"

    def out_dir(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / "sweeps" / self.resolved_name


@dataclass
class Point:
    name: str
    config: str  # the config's name (table row group)
    setting: dict[str, Any]
    seed: int
    order: str  # order id: "0", "3", "p1" (explicit permutation 1)
    cfg: RunConfig
    config_path: Path
    run_dir: Path
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def setting_label(self) -> str:
        return setting_label(self.setting)


def setting_label(setting: dict[str, Any]) -> str:
    """``method.eta=0.9, train.lr=0.01`` -> ``eta=0.9+train.lr=0.01`` (the method's keys lose "method.")."""
    if not setting:
        return "default"
    return "+".join(f"{k.removeprefix('method.')}={_fmt(v)}" for k, v in setting.items())


def _fmt(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", text)


# --------------------------------------------------------------------------------------------------
# Spec parsing helpers (CLI)

def parse_orders(tokens: list[str]) -> list[int | list[int]]:
    """``0-5`` (ids 0..5), ``3``, or ``4,3,2,1,0`` (an explicit permutation)."""
    out: list[int | list[int]] = []
    for tok in tokens:
        try:
            if "," in tok:
                out.append([int(x) for x in tok.split(",") if x.strip()])
            elif re.fullmatch(r"\d+-\d+", tok):
                a, b = (int(x) for x in tok.split("-"))
                if b < a:
                    raise ValueError
                out.extend(range(a, b + 1))
            else:
                out.append(int(tok))
        except ValueError:
            raise ConfigError(f"--orders: {tok!r} is not an order id, a range a-b or a comma-separated permutation") from None
    return out


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """``method.eta=1.0,0.95,0.9`` -> {"method.eta": [1.0, 0.95, 0.9]} (each value parsed as YAML)."""
    import yaml

    grid: dict[str, list[Any]] = {}
    for text in items:
        if "=" not in text:
            raise ConfigError(f"--grid {text!r}: expected key.path=v1,v2,...")
        key, _, raw = text.partition("=")
        values = [yaml.safe_load(v) for v in raw.split(",")] if raw.strip() else []
        if not values:
            raise ConfigError(f"--grid {text!r}: no values")
        parse_override(f"{key}=0")  # checks the key path
        grid[key.strip()] = values
    return grid


def load_spec(path: Path | None, cli: dict[str, Any]) -> SweepSpec:
    """A spec file (optional) with the command line's values on top; one-line errors."""
    import yaml

    data: dict[str, Any] = {}
    source = "the command line"
    if path is not None:
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"sweep spec not found: {path}")
        try:
            data = load_yaml(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"sweep spec {path}: not valid YAML ({yaml_problem(e)})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"sweep spec {path}: the top level must be a mapping")
    for k, v in cli.items():
        if v is None:
            continue
        if k == "grid":
            data["grid"] = {**(data.get("grid") or {}), **v}
        elif k == "overrides":
            data["overrides"] = list(data.get("overrides") or []) + list(v)
        else:
            data[k] = v
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(p) for p in e["loc"])
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        raise ConfigError(f"sweep spec error in {source}: {loc or '<root>'}: {msg}") from None


# --------------------------------------------------------------------------------------------------
# Expansion

def _settings(spec: SweepSpec) -> list[dict[str, Any]]:
    keys = list(spec.grid)
    combos = [dict(zip(keys, vals)) for vals in itertools.product(*(spec.grid[k] for k in keys))] or [{}]
    explicit = spec.settings or [{}]
    return [{**e, **g} for e in explicit for g in combos]


def _order_id(order: int | list[int], index: int) -> str:
    return str(order) if isinstance(order, int) else f"p{index}"


def _permutation(order: int | list[int], items: list[Any], what: str) -> list[Any]:
    """``items`` in the order's arrangement: id 0 as given, id k shuffled by RandomState(k), a list as given
    (a permutation of the indices for tasks, of the labels for classes)."""
    if isinstance(order, int):
        if order < 0:
            raise ConfigError(f"sweep orders: order id {order} is negative")
        if order == 0:
            return list(items)
        perm = np.random.RandomState(order).permutation(len(items))
        return [items[int(i)] for i in perm]
    if what == "task":
        if sorted(order) != list(range(len(items))):
            raise ConfigError(f"sweep orders: {order} is not a permutation of the task indices 0..{len(items) - 1}")
        return [items[i] for i in order]
    if sorted(order) != sorted(items):
        raise ConfigError(f"sweep orders: {order} is not a permutation of the sequence's class labels {sorted(items)}")
    return list(order)


def expand(spec: SweepSpec, *, base: Path | None = None, materialize: bool = True) -> list[Point]:
    """Every point of the spec, validated (one-line ConfigError on the first problem). ``materialize``:
    write class-order shards that do not exist yet (else such points keep the source data)."""
    base = base or Path.cwd()
    out = spec.out_dir()
    points: list[Point] = []
    seen: set[str] = set()
    for cfg_path in spec.configs:
        cfg0 = load_config(cfg_path, spec.overrides)
        unit = spec.order_unit
        if unit == "auto":
            unit = "class" if cfg0.backbone.task_type == "classification" else "task"
        if unit == "class" and cfg0.backbone.task_type != "classification":
            raise ConfigError(f"sweep order_unit class: config {cfg_path} is not class-incremental "
                              f"(backbone.kind {cfg0.backbone.kind}); use order_unit task")
        for setting in _settings(spec):
            setting_overrides = [f"{k}={json.dumps(v)}" for k, v in setting.items()]
            for oi, order in enumerate(spec.orders):
                oid = _order_id(order, oi)
                for seed in spec.seeds:
                    try:
                        cfg = load_config(cfg_path, spec.overrides + setting_overrides + [f"seed={seed}"])
                    except ConfigError as e:
                        raise ConfigError(f"{e} (sweep setting {setting_label(setting)})") from None
                    label = cfg0.name
                    name = _slug(f"{label}__{setting_label(setting)}__s{seed}_o{oid}" if setting
                                 else f"{label}__s{seed}_o{oid}")
                    if name in seen:
                        raise ConfigError(f"sweep: two points are both named {name} (repeated seed, order or setting?)")
                    seen.add(name)
                    data = cfg.model_dump(mode="json")
                    permutation = _apply_order(data, cfg, order, unit, out, base, materialize)
                    meta = {"sweep": spec.resolved_name, "config": label, "setting": setting, "seed": seed,
                            "order": oid, "order_unit": unit, "permutation": permutation}
                    data.update(name=name, run_dir=str(out / "runs" / name), meta={**cfg.meta, **meta})
                    pcfg = validate_config(data, f"{cfg_path} (sweep point {name})")
                    points.append(Point(name, label, setting, seed, oid, pcfg, out / "configs" / f"{name}.yaml",
                                        out / "runs" / name, meta))
    return points


def _apply_order(data: dict, cfg: RunConfig, order: int | list[int], unit: str, out: Path, base: Path,
                 materialize: bool) -> list:
    """Rewrite ``data['data']`` for the order; returns what was permuted (task names or class labels)."""
    if unit == "task":
        names = [t if isinstance(t, str) else t["name"] for t in data["data"]["tasks"]]
        arranged = _permutation(order, list(range(len(names))), "task")
        data["data"]["tasks"] = [data["data"]["tasks"][i] for i in arranged]
        return [names[i] for i in arranged]
    from mcit.data.shards import open_split

    specs = cfg.data.resolved_tasks(base)
    spaces = [open_split(s.train, "size").label_space for s in specs]
    classes = [c for space in spaces for c in space]
    arranged = _permutation(order, classes, "class")
    if arranged == classes:
        return arranged
    sizes = [len(s) for s in spaces]
    dest = regroup_dir(out, specs, arranged)
    if materialize:
        regroup(specs, sizes, arranged, dest)
    data["data"]["root"] = None
    data["data"]["tasks"] = [{"name": f"task{j}", "train": str(dest / f"task{j}" / "train"),
                              "test": str(dest / f"task{j}" / "test"), "scorer": None} for j in range(len(sizes))]
    return arranged


# --------------------------------------------------------------------------------------------------
# Class orders: regrouped shards

def regroup_dir(out: Path, specs: list, class_order: list[int]) -> Path:
    key = json.dumps({"sources": [[s.train, s.test] for s in specs], "order": class_order})
    return out / "data" / f"classes_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def regroup(specs: list, sizes: list[int], class_order: list[int], dest: Path) -> None:
    """Write tasks ``task<j>`` of ``sizes[j]`` classes each, taken in ``class_order`` from the source
    tasks' shards (train and test). Written to a temporary directory and renamed: all or nothing."""
    import shutil

    from mcit.data.shards import open_split, write_split

    if (dest / "benchmark.json").is_file():
        return
    tmp = dest.with_name(dest.name + f".partial{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    bounds = np.cumsum([0] + sizes)
    for kind in ("train", "test"):
        splits = [open_split(getattr(s, kind), "size") for s in specs]
        shard_size = max(max(sp.shard_counts or [1]) for sp in splits)
        names = {int(k): v for sp in splits for k, v in (sp.manifest.get("class_names") or {}).items()}
        for j in range(len(sizes)):
            wanted = set(class_order[bounds[j]:bounds[j + 1]])
            samples = []
            for sp in splits:
                if not wanted & set(sp.label_space):
                    continue
                for i in range(len(sp.shard_counts)):
                    for s in sp.shard_samples(i):
                        label = int(s["cls"].decode() if isinstance(s["cls"], bytes) else s["cls"])
                        if label in wanted:
                            samples.append({k: v for k, v in s.items() if k != "__url__"})
            write_split(tmp / f"task{j}" / kind, samples, shard_size=shard_size, label_space=sorted(wanted),
                        class_names={c: names[c] for c in wanted if c in names},
                        extra={"task": f"task{j}", "class_order": class_order,
                               "sources": [sp.location for sp in splits]})
    atomic_write_text(tmp / "benchmark.json", json.dumps(
        {"class_order": class_order, "task_sizes": sizes, "sources": [[s.train, s.test] for s in specs]}, indent=1))
    from mcit.checkpoint import publish_dir

    publish_dir(tmp, dest, replace=False)  # another sweep process may have published the same order first


# --------------------------------------------------------------------------------------------------
# Writing the points, status

def finished(point: Point) -> bool:
    return RunDir(point.run_dir).finished_metrics() is not None


def write_points(spec: SweepSpec, points: list[Point]) -> None:
    """Each point's config file (checked against an existing run first) and ``<out>/sweep.json``."""
    out = spec.out_dir()
    for p in points:
        RunDir(p.run_dir).check_belongs_to(p.cfg)  # RunDirError: the run there has another config
        text = dump_config(p.cfg)
        if not p.config_path.is_file() or p.config_path.read_text() != text:
            atomic_write_text(p.config_path, text)
    atomic_write_text(out / "sweep.json", json.dumps({
        "spec": spec.model_dump(mode="json"), "name": spec.resolved_name,
        "points": [{"name": p.name, "config": p.config, "setting": p.setting, "seed": p.seed, "order": p.order,
                    "config_path": str(p.config_path), "run_dir": str(p.run_dir), "meta": p.meta} for p in points]},
        indent=1))


def record_attempt(out: Path, entry: dict[str, Any]) -> None:
    """Append one launch record to ``<out>/attempts.jsonl`` (the latest per point explains a failure)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "attempts.jsonl", "a") as f:
        f.write(json.dumps({**entry, "time": time.time()}) + "\n")


def last_attempts(out: Path) -> dict[str, dict]:
    p = out / "attempts.jsonl"
    if not p.is_file():
        return {}
    last: dict[str, dict] = {}
    for line in p.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill: ignore it
        last[e["point"]] = e
    return last


# --------------------------------------------------------------------------------------------------
# Launching

def local_command(point: Point, launcher: str, nproc: int) -> list[str]:
    from mcit.distributed import free_port

    entry = str(ROOT / "pipelines" / "run_task_sequence.py")
    if launcher == "deepspeed":
        return [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
                "--master_port", str(free_port()), entry, "--config", str(point.config_path)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port()), entry, "--config", str(point.config_path)]
    if launcher == "python":
        return [sys.executable, "-u", entry, "--config", str(point.config_path)]
    raise ValueError(f"unknown launcher {launcher!r}")


def run_local(spec: SweepSpec, points: list[Point], *, launcher: str = "deepspeed", nproc: int = 1,
              echo=print) -> dict[str, int]:
    """Run every unfinished point, one after another, each through ``launcher``; a failed point is
    recorded and the sweep goes on. Returns {point: exit code} of what ran."""
    out = spec.out_dir()
    todo = [p for p in points if not finished(p)]
    echo(f"sweep {spec.resolved_name}: {len(points)} points, {len(points) - len(todo)} finished, "
         f"{len(todo)} to run ({launcher}, {nproc} process(es) each)")
    codes: dict[str, int] = {}
    for i, p in enumerate(todo, 1):
        log = out / "logs" / f"{p.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = local_command(p, launcher, nproc)
        t0 = time.time()
        with open(log, "a") as f:
            f.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=Path.cwd(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait()
            except KeyboardInterrupt:  # stop the whole launcher tree; the run resumes on the next sweep
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
                record_attempt(out, {"point": p.name, "launcher": launcher, "rc": "interrupted", "log": str(log)})
                raise
        codes[p.name] = rc
        record_attempt(out, {"point": p.name, "launcher": launcher, "rc": rc, "log": str(log),
                             "seconds": round(time.time() - t0, 1)})
        status = "done" if rc == 0 and finished(p) else f"FAILED (exit {rc}; log {log})"
        echo(f"[{i}/{len(todo)}] {p.name}: {status} in {time.time() - t0:.1f} s")
    return codes


def submit_slurm(spec: SweepSpec, points: list[Point], *, throttle: int | None = None, sbatch_args: list[str] = (),
                 env: dict[str, str] | None = None, echo=print) -> tuple[str | None, list[Point]]:
    """One array job over the unfinished points (``pipelines/slurm/sweep_array.sbatch``, ``%throttle``
    tasks at a time). Returns (job id, the points in array-index order); (None, []) when all finished."""
    out = spec.out_dir().resolve()
    todo = [p for p in points if not finished(p)]
    if not todo:
        echo(f"sweep {spec.resolved_name}: all {len(points)} points finished; nothing to submit")
        return None, []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    listing = out / "slurm" / f"array-{stamp}-{os.getpid()}.txt"
    atomic_write_text(listing, "".join(f"{p.config_path.resolve()}\n" for p in todo))
    array = f"0-{len(todo) - 1}" + (f"%{throttle}" if throttle else "")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", "--parsable", f"--array={array}", f"--job-name=mcit-sweep-{spec.resolved_name}",
           f"--output={out / 'logs' / 'slurm-%A_%a.out'}", *sbatch_args,
           str(ROOT / "pipelines" / "slurm" / "sweep_array.sbatch"), str(listing)]
    res = subprocess.run(cmd, cwd=Path.cwd(), env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"sbatch failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
    job = res.stdout.strip().split(";")[0]
    for i, p in enumerate(todo):
        record_attempt(out, {"point": p.name, "launcher": "slurm", "job": f"{job}_{i}", "rc": None,
                             "log": str(out / "logs" / f"slurm-{job}_{i}.out")})
    echo(f"sweep {spec.resolved_name}: submitted array job {job} ({len(todo)} points, --array={array}); "
         f"{len(points) - len(todo)} already finished")
    return job, todo


def wait_slurm(job: str, *, env: dict[str, str] | None = None, poll_s: float = 2.0, echo=print) -> None:
    """Block until no task of array job ``job`` is left in the queue (requeued tasks included)."""
    last = None
    while True:
        res = subprocess.run(["squeue", "-h", "-r", "-j", job, "-o", "%i %T"], env=env, capture_output=True, text=True)
        lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
        if res.returncode != 0 and "Invalid job id" not in res.stderr:
            raise RuntimeError(f"squeue failed: {res.stderr.strip()[-300:]}")
        if not lines:
            return
        if len(lines) != last:
            echo(f"array job {job}: {len(lines)} task(s) queued or running")
            last = len(lines)
        time.sleep(poll_s)


# --------------------------------------------------------------------------------------------------
# Aggregation

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
    if agg["failed"]:
        text += "\n## Points that did not finish\n\n| point | reason | log |\n|---|---|---|\n" + "".join(
            f"| {f['point']} | {f['reason']} | {f['log'] or ''} |\n" for f in agg["failed"])
    return text


def write_tables(spec: SweepSpec, agg: dict[str, Any]) -> list[Path]:
    """aggregate.{json,csv,md} and points.csv in the sweep directory (atomically)."""
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
        pw.writerow([r["point"], r["config"], r["setting"], r["seed"], r["order"], r["status"]] + [r[k] for k in METRICS])
    files = {"aggregate.json": json.dumps(agg, indent=1), "aggregate.csv": buf.getvalue(),
             "aggregate.md": markdown(agg), "points.csv": pbuf.getvalue()}
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
        for ax, metric, title in zip(axes, ("final_avg_acc", "forgetting"), ("final average accuracy (%)", "forgetting (%)")):
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
        path = out / f"curve_{_slug(key.removeprefix('method.'))}.png"
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
