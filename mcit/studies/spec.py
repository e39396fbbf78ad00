"""A sweep's spec and its points: seeds x task orders x config settings, each point an ordinary run directory.

A spec (YAML file or command line, see ``mcit/cli/sweep.py``) expands to *points*. A point is one of
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

Launching the points is ``mcit/studies/launch.py``; aggregating their metrics ``mcit/studies/results.py``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mcit.core.checkpoint import atomic_write_text
from mcit.core.config import (
    ConfigError,
    RunConfig,
    dump_config,
    load_config,
    parse_override,
    read_yaml_mapping,
    validate_config,
)
from mcit.core.rundir import RunDir


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


def slug(text: str) -> str:
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
            raise ConfigError(f"--orders: {tok!r} is not an order id, a range a-b or a comma-separated "
                              f"permutation") from None
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
    data: dict[str, Any] = {}
    source = "the command line"
    if path is not None:
        source = str(path)
        data = read_yaml_mapping(path, "sweep spec")
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
                    name = slug(f"{label}__{setting_label(setting)}__s{seed}_o{oid}" if setting
                                 else f"{label}__s{seed}_o{oid}")
                    if name in seen:
                        raise ConfigError(f"sweep: two points are both named {name} (repeated seed, order or setting?)")
                    seen.add(name)
                    data = cfg.model_dump(mode="json")
                    permutation = _apply_order(data, cfg, order, unit, out, base, materialize)
                    meta = {"sweep": spec.resolved_name, "config": label, "setting": setting, "seed": seed,
                            "order": oid, "order_unit": unit, "permutation": permutation}
                    data.update(name=name, run_dir=str(out / "runs" / name), meta={**cfg.meta, **meta})
                    if not data["eval"].get("cells"):  # one cell store: equal cells (zero-shot rows) answered once
                        data["eval"]["cells"] = "../../cells"  # <out>/cells, from <out>/runs/<point>
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
    from mcit.core.checkpoint import publish_dir

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
