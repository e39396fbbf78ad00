#!/usr/bin/env python
"""The embedded benchmarks as a measuring instrument: how far a method's number moves with the seed and with the
CPU's kernels, and where that spread comes from.

Every claim the README makes about the methods (and every default the selection sweeps chose) is read off the
embedded benchmarks, so their noise bounds what those claims can say. This script measures it on one machine:

* **kernel sets** emulated by the environment variables the libraries read at start-up (``KERNEL_SETS``:
  ATen's vector ISA, MKL's instruction set, oneDNN's ISA). Each set pre-trains its own embedded backbones and
  runs every method's seed 0 on them. Pre-training runs on portable kernels whatever the caller's
  (``data_prep.common.portable_kernels``), so every set's backbones should be the same bytes: the report lists
  their sha256, and a kernel set's difference is then continual training's alone;
* **seeds**: every method over ``--seeds`` under the machine's own kernels;
* **source** (``--split-source``): seed 0 under each other kernel set on the *native* backbones, so a kernel
  set's difference splits into the part the pre-training brings and the part continual training adds (for
  builders that do not pin their kernels; with identical backbones these runs repeat the kernel sets' own).

The runs are ordinary sweeps (``pipelines.sweep``, resumable: re-running the same command finishes what a kill
left), one per (kernel set, backbones) under ``OUT/sweeps/``; the configs are the spec's with the backbone paths
pointed at that kernel set's backbones (``OUT/configs/``). The report (``OUT/instrument.md`` and ``.json``)
gives per method: final average accuracy over seeds (mean ± std, ddof 1), seed 0 per kernel set and their range,
forgetting, the zero-shot row per kernel set, the tasks and rows the spread sits in, and the check against the
targets (``TARGETS``).

    python -m bench.instrument --benchmark mcit [--methods lora fwd_prompt] [--seeds 0 1 2]
           [--kernel-sets native avx2 default] [--split-source] [--out runs/instrument/mcit] [--doc docs/X.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# What each emulated kernel set sets before a process starts: ATen's dispatch ISA, MKL's code path (Intel CPUs
# only: on AMD it has no effect and the ATen / oneDNN settings carry the difference) and oneDNN's ISA cap.
KERNEL_SETS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "DNNL_MAX_CPU_ISA": "SSE41"},
}

# What the caller's environment may carry that would pin one kernel set for every run (tests/numerics.py strips the
# same variables for its kernel sets).
KERNEL_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "DNNL_MAX_CPU_ISA", "OMP_NUM_THREADS",
               "MKL_NUM_THREADS")

# The bar for an instrument that resolves the methods (points of final average accuracy).
TARGETS = {"seed_std": 2.0, "kernel_range": 2.0, "zero_shot_range": 1.0, "seq_forgetting": 20.0}


@dataclass(frozen=True)
class Benchmark:
    """One embedded benchmark: its sweep spec (configs and seeds), the backbones its configs load, how each is
    pre-trained (``python -m <builder> ... --out DIR``) and which method must forget."""

    spec: str
    backbones: dict[str, list[str]]
    forgetting_method: str
    shards: tuple[str, ...]


BENCHMARKS: dict[str, Benchmark] = {
    "mcit": Benchmark(
        spec="configs/sweeps/tiny_mcit_seeds.yaml",
        backbones={"tiny_llava": ["data_prep.pretrain_tiny_llava", "--shards", "data/shards/tiny_mcit"],
                   "tiny_clip_procedural": ["data_prep.pretrain_clip"]},
        forgetting_method="lora", shards=("tiny_mcit",)),
    "cil": Benchmark(
        spec="configs/sweeps/cil_seeds.yaml",
        backbones={"tiny_vit_procedural": ["data_prep.pretrain_vit"],
                   "tiny_clip_procedural": ["data_prep.pretrain_clip"]},
        forgetting_method="seq", shards=("digits",)),
}


def kernel_env(kernel_set: str, threads: int = 1) -> dict[str, str]:
    """The environment of a process under ``kernel_set``: the set's variables, one OpenMP thread per rank (the
    Makefile's runs), no GPU, the venv's programs first on PATH (the launcher starts ``python`` by name)."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_VARS}
    env.update(KERNEL_SETS[kernel_set])
    env.update(OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return env


def rewrite_config(text: str, backbones_dir: Path) -> str:
    """A config's text with every embedded backbone path (``data/backbones/<name>``) under ``backbones_dir``."""
    return text.replace("data/backbones/", f"{backbones_dir.as_posix().rstrip('/')}/")


def build_shards(bench: Benchmark) -> None:
    """The benchmark's shards (PIL and numpy only: the same bytes under every kernel set, so shared)."""
    for name in bench.shards:
        if name == "digits":
            from data_prep.digits import build

            build(ROOT / "data/shards/digits")
        elif name == "tiny_mcit":
            from data_prep.tiny_mcit import build as build_mcit

            build_mcit(ROOT / "data/shards/tiny_mcit")


def needed_backbones(bench: Benchmark, configs: list[Path]) -> list[str]:
    """The benchmark's backbones the configs load (as ``data/backbones/<name>``, the backbone or an auxiliary)."""
    texts = [(ROOT / c).read_text() for c in configs]
    return [name for name in bench.backbones if any(f"data/backbones/{name}" in t for t in texts)]


def build_backbones(bench: Benchmark, names: list[str], kernel_sets: list[str], out: Path,
                    jobs: int) -> dict[str, dict[str, Any]]:
    """The backbones ``names`` pre-trained under every kernel set, ``jobs`` at a time (each build runs
    ``PRETRAIN_THREADS`` threads: two builds on two cores would share them and spin); a finished build with the same
    settings is kept (the builders' own rule). Returns each build's ``pretraining.json``."""
    tasks = [(ks, name, bench.backbones[name]) for ks in kernel_sets for name in names]

    def one(task: tuple[str, str, list[str]]) -> tuple[str, str, dict[str, Any]]:
        ks, name, cmd = task
        dest = out / "backbones" / ks / name
        log = out / "logs" / f"pretrain_{ks}_{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as fh:
            rc = subprocess.call([sys.executable, "-m", *cmd, "--out", str(dest)], cwd=ROOT, env=kernel_env(ks),
                                 stdout=fh, stderr=subprocess.STDOUT)
        if rc != 0:
            raise SystemExit(f"pre-training {name} under kernel set {ks} failed (exit {rc}); see {log}")
        return ks, name, json.loads((dest / "pretraining.json").read_text())

    infos: dict[str, dict[str, Any]] = {ks: {} for ks in kernel_sets}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for ks, name, info in pool.map(one, tasks):
            infos[ks][name] = info
            print(f"backbone {name} under {ks}: {pretraining_summary(info)}", flush=True)
    return infos


def pretraining_summary(info: dict[str, Any]) -> str:
    """One line of a backbone's own held-out numbers and the ISA it was built with."""
    keys = ("base_val_exact_match", "val_accuracy", "val_zero_shot_accuracy", "vision_attribute_val_acc")
    parts = [f"{info.get('environment', {}).get('cpu_capability', '?')}"]
    for k in keys:
        v = info.get(k)
        if isinstance(v, dict):
            parts.append(k + " " + " ".join(f"{a}={100 * x:.1f}" for a, x in v.items()))
        elif v is not None:
            parts.append(f"{k} {100 * v:.2f}")
    return ", ".join(parts)


@dataclass(frozen=True)
class Sweep:
    """One sweep of the measurement: runs under ``kernel_set`` with the backbones pre-trained under ``backbones``."""

    label: str
    kernel_set: str
    backbones: str
    seeds: tuple[int, ...]


def plan(kernel_sets: list[str], seeds: list[int], split_source: bool) -> list[Sweep]:
    """The sweeps: every seed on the first kernel set; seed ``seeds[0]`` on every other, on its own backbones and
    (``split_source``) on the first set's."""
    first, rest = kernel_sets[0], kernel_sets[1:]
    out = [Sweep(first, first, first, tuple(seeds))]
    out += [Sweep(ks, ks, ks, (seeds[0],)) for ks in rest]
    if split_source:
        out += [Sweep(f"{ks}-on-{first}", ks, first, (seeds[0],)) for ks in rest]
    return out


def write_configs(configs: list[Path], out: Path, backbones: str) -> list[Path]:
    dest = out / "configs" / backbones
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for c in configs:
        target = dest / c.name
        text = rewrite_config((ROOT / c).read_text(), (out / "backbones" / backbones).resolve())
        if not target.is_file() or target.read_text() != text:
            target.write_text(text)
        written.append(target)
    return written


def run_sweep(sweep: Sweep, configs: list[Path], out: Path, nproc: int, bench_name: str) -> Path:
    """One resumable sweep (``pipelines.sweep``) under the kernel set's environment; its directory."""
    sdir = out / "sweeps" / sweep.label
    cmd = [sys.executable, "-m", "pipelines.sweep", "--name", f"instrument_{bench_name}_{sweep.label}",
           "--out", str(sdir), "--nproc", str(nproc), "--seeds", *map(str, sweep.seeds)]
    for c in write_configs(configs, out, sweep.backbones):
        cmd += ["--config", str(c)]
    print(f"== sweep {sweep.label}: kernel set {sweep.kernel_set}, backbones of {sweep.backbones}, "
          f"seeds {list(sweep.seeds)}, {len(configs)} configs", flush=True)
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=ROOT, env=kernel_env(sweep.kernel_set))
    if rc != 0:
        raise SystemExit(f"sweep {sdir} failed (exit {rc}); re-run the same command to resume it")
    print(f"== sweep {sweep.label} done in {time.time() - t0:.0f} s", flush=True)
    return sdir


def read_run(sdir: Path, config_name: str, seed: int) -> dict[str, Any] | None:
    path = sdir / "runs" / f"{config_name}__s{seed}_o0" / "metrics.json"
    if not path.is_file():
        return None
    m = json.loads(path.read_text())
    return m if m.get("complete") else None


def display_name(config_name: str) -> str:
    """A config's name without the benchmark's prefix (``tiny_mcit_lora`` -> ``lora``, ``digits_seq`` -> ``seq``)."""
    for prefix in ("tiny_mcit_", "digits_"):
        if config_name.startswith(prefix):
            return config_name[len(prefix):]
    return config_name


def _std(values: list[float]) -> float | None:
    return statistics.stdev(values) if len(values) > 1 else None


def _range(values: list[float]) -> float | None:
    return max(values) - min(values) if len(values) > 1 else None


def summarise(runs: dict[str, dict[int, dict[str, Any]]], *, seed_label: str, kernel_labels: list[str],
              source_labels: dict[str, str], seed0: int) -> dict[str, Any]:
    """One method's numbers from its runs' metrics (``runs[sweep label][seed]``): the seeds' final average
    accuracy, seed 0 per kernel set, forgetting, the zero-shot rows, and where the spread sits.

    ``kernel_labels``: the sweeps of seed 0 per kernel set (the first is the seeds' sweep);
    ``source_labels``: kernel set -> the sweep of that set on the first set's backbones."""
    seeds = runs.get(seed_label, {})
    finals = {s: m["final_avg_acc"] for s, m in sorted(seeds.items())}
    per_kernel = {ks: runs[ks][seed0]["final_avg_acc"] for ks in kernel_labels if seed0 in runs.get(ks, {})}
    forgetting = [m["forgetting"] for m in seeds.values() if m.get("forgetting") is not None]
    zero_shot = {ks: runs[ks][seed0].get("zero_shot") for ks in kernel_labels
                 if seed0 in runs.get(ks, {}) and runs[ks][seed0].get("zero_shot")}
    zs_means = {ks: statistics.fmean(row) for ks, row in zero_shot.items()}
    zs_cell_range = None
    if len(zero_shot) > 1:
        cols = list(zip(*zero_shot.values()))
        zs_cell_range = max(max(c) - min(c) for c in cols)
    any_run = next(iter(seeds.values()), None) or next((r[seed0] for r in runs.values() if seed0 in r), None)
    tasks = list(any_run["tasks"]) if any_run else []
    # Which tasks: the spread of each task's final accuracy over the seeds and over the kernel sets.
    final_rows = {s: m["acc_matrix"][-1] for s, m in seeds.items()}
    kernel_rows = {ks: runs[ks][seed0]["acc_matrix"][-1] for ks in per_kernel}
    task_seed_std = {t: _std([row[i] for row in final_rows.values()]) for i, t in enumerate(tasks)}
    task_kernel_range = {t: _range([row[i] for row in kernel_rows.values()]) for i, t in enumerate(tasks)}
    # Which rows: the spread over seeds of each row's average over the tasks seen so far.
    row_seed_std = []
    if seeds:
        n_rows = min(len(m["acc_matrix"]) for m in seeds.values())
        for r in range(n_rows):
            seen = r + 1 if any_run.get("schedule", "sequential") == "sequential" else None
            vals = [statistics.fmean(m["acc_matrix"][r][:seen]) for m in seeds.values()]
            row_seed_std.append(_std(vals))
    # Pre-training or continual training: each kernel set on its own backbones against the same set on the
    # first set's backbones (both differ from the first set's run by that set's continual-training rounding;
    # the first also by its backbones).
    source = {}
    base = per_kernel.get(kernel_labels[0]) if kernel_labels else None
    for ks, label in source_labels.items():
        m = runs.get(label, {}).get(seed0)
        if m is None or ks not in per_kernel or base is None:
            continue
        source[ks] = {"continual_only": m["final_avg_acc"] - base,
                      "pretraining": per_kernel[ks] - m["final_avg_acc"],
                      "total": per_kernel[ks] - base}
    return {
        "tasks": tasks, "final_avg_acc": finals,
        "mean": statistics.fmean(finals.values()) if finals else None, "seed_std": _std(list(finals.values())),
        "seed_min": min(finals.values()) if finals else None, "seed_max": max(finals.values()) if finals else None,
        "per_kernel": per_kernel, "kernel_range": _range(list(per_kernel.values())),
        "forgetting_mean": statistics.fmean(forgetting) if forgetting else None, "forgetting_std": _std(forgetting),
        "zero_shot": zero_shot, "zero_shot_mean": zs_means, "zero_shot_range": _range(list(zs_means.values())),
        "zero_shot_cell_range": zs_cell_range, "task_seed_std": task_seed_std, "task_kernel_range": task_kernel_range,
        "row_seed_std": row_seed_std, "source": source,
    }


def verdict(s: dict[str, Any]) -> list[str]:
    """The targets a method's summary misses (empty: it meets them all, as far as measured)."""
    missed = []
    if s["seed_std"] is not None and s["seed_std"] > TARGETS["seed_std"]:
        missed.append(f"seed std {s['seed_std']:.2f} > {TARGETS['seed_std']:g}")
    if s["kernel_range"] is not None and s["kernel_range"] > TARGETS["kernel_range"]:
        missed.append(f"kernel range {s['kernel_range']:.2f} > {TARGETS['kernel_range']:g}")
    return missed


def _f(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def report(bench_name: str, bench: Benchmark, summaries: dict[str, dict[str, Any]], backbones: dict[str, Any],
           kernel_sets: list[str], seeds: list[int], command: str, seconds: float) -> str:
    """The markdown report."""
    import torch

    first = kernel_sets[0]
    lines = [f"# The embedded {bench_name.upper()} benchmark as an instrument", "",
             f"Measured by `{command}` ({seconds / 60:.0f} min). Machine: {os.cpu_count()} CPUs, torch "
             f"{torch.__version__}, native ATen ISA {torch.backends.cpu.get_cpu_capability()}. Kernel sets: "
             + "; ".join(f"`{ks}` = " + (" ".join(f"{k}={v}" for k, v in KERNEL_SETS[ks].items()) or "nothing forced")
                         for ks in kernel_sets) + ".",
             f"Seeds {seeds} under `{first}`; seed {seeds[0]} under every kernel set, each on the backbones it "
             "pre-trained itself. Std: sample standard deviation (ddof 1). Targets: seed std ≤ "
             f"{TARGETS['seed_std']:g}, kernel range ≤ {TARGETS['kernel_range']:g}, zero-shot average range ≤ "
             f"{TARGETS['zero_shot_range']:g} (points of final average accuracy).", "",
             "## Backbones per kernel set", "", "| kernel set | backbone | built with | held-out numbers | sha256 |",
             "|---|---|---|---|---|"]
    for ks in kernel_sets:
        for name, info in backbones.get(ks, {}).items():
            lines.append(f"| {ks} | {name} | {info.get('environment', {}).get('cpu_capability', '?')} | "
                         f"{pretraining_summary(info).split(', ', 1)[-1]} | {info.get('sha256', '')[:12]} |")
    ks_cols = " | ".join(f"seed {seeds[0]} {ks}" for ks in kernel_sets)
    lines += ["", "## Final average accuracy", "",
              f"| method | mean ± std over seeds | min–max | {ks_cols} | kernel range | forgetting | misses |",
              "|---|---|---|" + "---|" * len(kernel_sets) + "---|---|---|"]
    for name, s in summaries.items():
        per_k = " | ".join(_f(s["per_kernel"].get(ks)) for ks in kernel_sets)
        forg = "–" if s["forgetting_mean"] is None else f"{s['forgetting_mean']:.2f} ± {_f(s['forgetting_std'])}"
        miss = "; ".join(verdict(s)) or "none"
        lines.append(f"| {name} | {_f(s['mean'])} ± {_f(s['seed_std'])} | {_f(s['seed_min'])}–{_f(s['seed_max'])} | "
                     f"{per_k} | {_f(s['kernel_range'])} | {forg} | {miss} |")
    zs = {n: s for n, s in summaries.items() if s["zero_shot"]}
    if zs:
        lines += ["", "## Zero-shot rows (the pre-trained backbone before any task)", "",
                  "| method | " + " | ".join(kernel_sets) + " | range of the average | largest cell range |",
                  "|---|" + "---|" * len(kernel_sets) + "---|---|"]
        for name, s in zs.items():
            cells = " | ".join(
                ("/".join(f"{v:.1f}" for v in s["zero_shot"][ks]) + f" (avg {s['zero_shot_mean'][ks]:.2f})")
                if ks in s["zero_shot"] else "–" for ks in kernel_sets)
            lines.append(f"| {name} | {cells} | {_f(s['zero_shot_range'])} | {_f(s['zero_shot_cell_range'])} |")
    lines += ["", "## Where the spread sits", "",
              "Per task: std over seeds of its final accuracy / range over kernel sets. Per row: std over seeds of "
              "the average over the tasks seen after that task.", "",
              "| method | per task (seed std / kernel range) | per row (seed std) |", "|---|---|---|"]
    for name, s in summaries.items():
        tasks = ", ".join(f"{t} {_f(s['task_seed_std'][t], 1)}/{_f(s['task_kernel_range'][t], 1)}" for t in s["tasks"])
        rows = ", ".join(_f(v, 1) for v in s["row_seed_std"])
        lines.append(f"| {name} | {tasks} | {rows} |")
    src = {n: s for n, s in summaries.items() if s["source"]}
    if src:
        lines += ["", f"## Pre-training or continual training (seed {seeds[0]})", "",
                  f"Each kernel set's difference from `{first}` = continual training alone (its runs on `{first}`'s "
                  "backbones) + the part its own pre-training adds.", "",
                  "| method | " + " | ".join(f"{ks}: continual / pre-training / total" for ks in kernel_sets[1:])
                  + " |",
                  "|---|" + "---|" * (len(kernel_sets) - 1)]
        for name, s in src.items():
            cells = " | ".join(
                (f"{s['source'][ks]['continual_only']:+.2f} / {s['source'][ks]['pretraining']:+.2f} / "
                 f"{s['source'][ks]['total']:+.2f}") if ks in s["source"] else "–" for ks in kernel_sets[1:])
            lines.append(f"| {name} | {cells} |")
    fm = [s for n, s in summaries.items() if n == bench.forgetting_method]
    if fm and fm[0]["forgetting_mean"] is not None:
        ok = fm[0]["forgetting_mean"] >= TARGETS["seq_forgetting"]
        lines += ["", f"Sequential `{bench.forgetting_method}` forgets {fm[0]['forgetting_mean']:.2f} ± "
                      f"{_f(fm[0]['forgetting_std'])} points (target ≥ {TARGETS['seq_forgetting']:g}: "
                      f"{'met' if ok else 'missed'})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--benchmark", choices=sorted(BENCHMARKS), required=True)
    ap.add_argument("--methods", nargs="+", default=None,
                    help="configs of the spec to run, by method name or config name (default: all)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--kernel-sets", nargs="+", choices=sorted(KERNEL_SETS), default=["native", "avx2", "default"])
    ap.add_argument("--split-source", action="store_true",
                    help="also run each other kernel set on the first set's backbones")
    ap.add_argument("--nproc", type=int, default=2, help="ranks per run")
    ap.add_argument("--out", type=Path, default=None, help="default runs/instrument/<benchmark>")
    ap.add_argument("--doc", type=Path, default=None, help="also copy the report here")
    ap.add_argument("--report-only", action="store_true", help="only (re)write the report from finished runs")
    args = ap.parse_args(argv)
    t0 = time.time()
    bench = BENCHMARKS[args.benchmark]
    out = (args.out or ROOT / "runs" / "instrument" / args.benchmark).resolve()
    from mcit.core.checkpoint import atomic_write_text
    from mcit.core.config import load_config, read_yaml_mapping

    spec = read_yaml_mapping(ROOT / bench.spec)
    configs = [Path(c) for c in spec["configs"]]
    names = {c: load_config(ROOT / c, []) for c in configs}
    if args.methods:
        known = {c: (display_name(cfg.name), cfg.name) for c, cfg in names.items()}
        unknown = [m for m in args.methods if not any(m in k for k in known.values())]
        if unknown:
            raise SystemExit(f"{bench.spec}: no config for {', '.join(unknown)} (it has "
                             f"{', '.join(k[0] for k in known.values())})")
        configs = [c for c in configs if set(known[c]) & set(args.methods)]
    sweeps = plan(args.kernel_sets, args.seeds, args.split_source)
    if not args.report_only:
        build_shards(bench)
        from data_prep.common import PRETRAIN_THREADS

        build_backbones(bench, needed_backbones(bench, configs), args.kernel_sets, out,
                        jobs=max(1, args.nproc // PRETRAIN_THREADS))
        for sw in sweeps:
            run_sweep(sw, configs, out, args.nproc, args.benchmark)
    backbones: dict[str, Any] = {}
    for ks in args.kernel_sets:
        for name in bench.backbones:
            p = out / "backbones" / ks / name / "pretraining.json"
            if p.is_file():
                from mcit.data.shards import sha256_file

                info = json.loads(p.read_text())
                weights = p.parent / "model.safetensors"
                info["sha256"] = sha256_file(weights) if weights.is_file() else ""
                backbones.setdefault(ks, {})[name] = info
    summaries: dict[str, dict[str, Any]] = {}
    for c in configs:
        cfg = names[c]
        runs = {sw.label: {s: m for s in sw.seeds if (m := read_run(out / "sweeps" / sw.label, cfg.name, s))}
                for sw in sweeps}
        summaries[display_name(cfg.name)] = summarise(
            runs, seed_label=sweeps[0].label, kernel_labels=args.kernel_sets,
            source_labels={sw.kernel_set: sw.label for sw in sweeps if sw.backbones != sw.kernel_set},
            seed0=args.seeds[0])
    measured = out / "measured.json"  # the measuring command and its wall time (a --report-only pass keeps them)
    if not args.report_only:
        command = "python -m bench.instrument " + " ".join(argv if argv is not None else sys.argv[1:])
        atomic_write_text(measured, json.dumps({"command": command, "seconds": time.time() - t0}))
    done = json.loads(measured.read_text()) if measured.is_file() else {"command": "?", "seconds": 0.0}
    text = report(args.benchmark, bench, summaries, backbones, args.kernel_sets, args.seeds, done["command"],
                  done["seconds"])
    atomic_write_text(out / "instrument.md", text)
    atomic_write_text(out / "instrument.json", json.dumps({"summaries": summaries, "targets": TARGETS,
                                                            "kernel_sets": args.kernel_sets, "seeds": args.seeds},
                                                           indent=1))
    if args.doc:
        atomic_write_text(args.doc, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
