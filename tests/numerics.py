#!/usr/bin/env python
"""The number-comparing tests under every CPU kernel set this machine can emulate, and each fixture's noise floor.

A comparison with official numbers passes on one CPU and fails on another when its tolerance sits inside
float32 rounding noise: MKL picks its GEMM kernels by instruction set (SSE4.2, AVX2, AVX-512, AMX), ATen its
vectorised kernels (softmax, reductions, GELU), and both split work by thread count; each rounds differently.
``make test-numerics`` runs ``tests/reference`` and the in-process tests marked ``numerics`` once per kernel set
below, each run recording every reference comparison (``tiny_inputs.compare``: the difference from the official
value, the quantity's scale, the tolerance, our values), then prints per fixture

* margin: over its quantities and every kernel set, the smallest ratio of the allowed difference to the difference
  from the official numbers (where, and under which kernel set),
* floor: its tolerance (``tiny_inputs.TOLERANCE``, else ``TOL``) over that margin, in the tolerance's own units:
  what the tolerance must sit above,
* spread: the largest difference between two kernel sets' values of one quantity, in tolerances (how much the CPU
  alone moves it).

It fails when a test fails under any kernel set, or when a fixture's margin is below ``--min-margin`` (10: the
tolerance must sit an order of magnitude above what this machine's kernel sets move, so that a CPU this
machine cannot emulate still passes). Not every variable acts everywhere: an AMD CPU ignores
MKL_ENABLE_INSTRUCTIONS (MKL runs one code path there, while MKL_CBWR=COMPATIBLE still changes it), an AVX2-only
CPU ignores ATEN_CPU_CAPABILITY=avx512; the table says which kernel sets changed anything.

A tolerance must also stay far below what a wrong implementation moves. ``--variants`` applies each wrong variant of
``tests/reference/variants/<fixture>.yaml`` (a named edit of the method's code: a sign, a missing term, the
official fault fixed the other way) to a copy of the repository, runs the fixture's reference test there with every
comparison recorded past the first failure (MCIT_REFERENCE_CONTINUE), and prints how far each variant moves its
fixture: the largest difference in tolerances (and relative to the quantity's scale). It fails when a variant passes
the test or moves less than ``--min-variant`` tolerances (10), or when an edit no longer applies (the code moved:
the variant must be rewritten, not dropped). A variant whose effect is too small for any tolerance to sit 10x from
both it and the noise floor says so in its ``resolution`` (the numbers): it must still fail, and is listed.

    python tests/numerics.py [--kernels default threads1 ...] [--out DIR] [--jobs 2] [--min-margin 10]
    python tests/numerics.py --variants [FIXTURE ...] [--out DIR] [--jobs 2] [--min-variant 10]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> environment: each instruction set MKL can be held to, with 1 and 2 threads; MKL's reproducible generic
# path (the one switch MKL honours on a non-Intel CPU); ATen's vectorised kernels at each capability; oneDNN capped
KERNELS: dict[str, dict[str, str]] = {
    "default": {},
    "threads1": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    "mkl_sse4_2": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "mkl_sse4_2_threads1": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    "mkl_avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl_avx2_threads1": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    "mkl_avx512": {"MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "mkl_avx512_threads1": {"MKL_ENABLE_INSTRUCTIONS": "AVX512", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
    "mkl_compatible": {"MKL_CBWR": "COMPATIBLE"},
    "aten_default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten_avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "dnnl_avx2": {"DNNL_MAX_CPU_ISA": "AVX2"},
}
# what the parent process may carry that would pin a kernel set for every run
KERNEL_VARS = ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ATEN_CPU_CAPABILITY", "DNNL_MAX_CPU_ISA", "OMP_NUM_THREADS",
               "MKL_NUM_THREADS")


def fixture_of(test_id: str) -> str:
    """``tests/reference/test_lwf_reference.py::test_x[p]`` -> ``lwf``."""
    stem = Path(test_id.split("::")[0]).stem
    return stem.removeprefix("test_").removesuffix("_reference")


def run_kernel_set(name: str, out: Path, jobs: int, pytest_args: list[str]) -> tuple[int, float]:
    """pytest over the number-comparing tests under kernel set ``name``; (exit status, seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_VARS}
    env.update(KERNELS[name], MCIT_REFERENCE_REPORT=str(out / f"{name}.jsonl"), DS_ACCELERATOR="cpu",
               CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "reference or numerics",
           "tests/reference", "tests/unit", *(["-n", str(jobs)] if jobs > 1 else []), *pytest_args]
    start = time.time()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return rc, time.time() - start


def load(path: Path) -> dict[tuple[str, str, int], dict]:
    """(test, quantity, occurrence) -> record; a quantity compared twice in one test keeps both."""
    rows: dict[tuple[str, str, int], dict] = {}
    seen: dict[tuple[str, str], int] = defaultdict(int)
    if path.is_file():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            k = (r["test"], r["what"])
            rows[(*k, seen[k])] = r
            seen[k] += 1
    return rows


def nominal_tolerance(fixture: str) -> float:
    """The fixture's tolerance as ``tests/reference/tiny_inputs.py`` states it (``TOLERANCE``, else ``TOL``)."""
    sys.path.insert(0, str(ROOT / "tests" / "reference"))
    import tiny_inputs

    return tiny_inputs.TOLERANCE.get(fixture, tiny_inputs.TOL)


def summarise(runs: dict[str, dict[tuple[str, str, int], dict]]) -> list[dict]:
    """One row per fixture over every kernel set: the margin (the smallest allowed / difference over its
    quantities), where, under which kernel set; the floor in the units of its tolerance (tolerance / margin); the
    spread (the largest difference between two kernel sets' values of one quantity, in tolerances)."""
    keys = set().union(*(r.keys() for r in runs.values()))
    per: dict[str, dict] = defaultdict(lambda: {"quantities": 0, "margin": math.inf, "margin_at": "", "kernel": "",
                                                "spread": 0.0, "spread_at": ""})
    for key in sorted(keys):
        recs = {k: r[key] for k, r in runs.items() if key in r}
        first = next(iter(recs.values()))
        row = per[fixture_of(first["test"])]
        row["quantities"] += 1
        where = f"{first['test'].split('::')[-1]}: {first['what']}"
        kernel = max(recs, key=lambda k: recs[k]["d"])
        margin = first["allowed"] / max(recs[kernel]["d"], 1e-300)
        if margin < row["margin"]:
            row["margin"], row["margin_at"], row["kernel"] = margin, where, kernel
        values = [r["values"] for r in recs.values() if r.get("values") is not None]
        if len(values) > 1 and all(len(v) == len(values[0]) for v in values) and first["allowed"]:
            spread = max(max(abs(a - b) for a, b in zip(v, values[0])) for v in values) / first["allowed"]
            if spread > row["spread"]:
                row["spread"], row["spread_at"] = spread, where
    out = []
    for fixture, row in sorted(per.items()):
        tol = nominal_tolerance(fixture)
        out.append({"fixture": fixture, "tolerance": tol, "floor": tol / row["margin"], **row})
    return out


def changed_by(runs: dict[str, dict], base: str = "default") -> dict[str, int]:
    """Per kernel set, how many compared quantities differ from ``base``'s in any bit (0: the switch did nothing)."""
    ref = runs.get(base, {})
    out = {}
    for name, rows in runs.items():
        out[name] = sum(1 for k, r in rows.items() if k in ref and r.get("values") != ref[k].get("values"))
    return out


VARIANTS = ROOT / "tests" / "reference" / "variants"
COPIED = ("mcit", "tests", "data_prep", "pipelines", "configs", "deepspeed_configs", "pyproject.toml")


def load_variants(fixtures: list[str]) -> list[dict]:
    """Every variant of ``fixtures`` (all when empty), each checked to apply: ``old`` occurs ``count`` times (1)."""
    import yaml

    out = []
    files = sorted(VARIANTS.glob("*.yaml")) if not fixtures else [VARIANTS / f"{f}.yaml" for f in fixtures]
    for path in files:
        if not path.is_file():
            raise SystemExit(f"error: {path}: no variants for fixture {path.stem!r}")
        for i, v in enumerate(yaml.safe_load(path.read_text()) or []):
            v = {"fixture": path.stem, "count": 1, "test": f"tests/reference/test_{path.stem}_reference.py", **v}
            edits = v.get("edits") or [{"file": v["file"], "old": v["old"], "new": v["new"],
                                        "count": v["count"]}]
            for e in edits:
                n = (ROOT / e["file"]).read_text().count(e["old"])
                if n != e.get("count", 1):
                    raise SystemExit(f"error: {path.name} variant {i} ({v['name']!r}): {e['file']} holds its `old` "
                                     f"{n} times, not {e.get('count', 1)} (the code moved: rewrite the variant)")
            out.append({**v, "edits": edits})
    return out


def run_variant(v: dict, copy: Path, out: Path, n: int) -> dict:
    """``v`` applied to ``copy``, its fixture's test run there (comparisons recorded past failures), ``copy``
    restored; how far the variant moved the fixture."""
    originals = {}
    for e in v["edits"]:
        f = copy / e["file"]
        originals.setdefault(f, f.read_text())
        f.write_text(f.read_text().replace(e["old"], e["new"]))
    report = out / f"variant_{n:03d}.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_VARS}
    env.update(MCIT_REFERENCE_REPORT=str(report), MCIT_REFERENCE_CONTINUE="1", DS_ACCELERATOR="cpu",
               CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(copy))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", v["test"],
           *(["-k", v["k"]] if v.get("k") else [])]
    try:
        res = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=900)
    finally:
        for f, text in originals.items():
            f.write_text(text)
    rows = list(load(report).values())
    def ratio(r: dict) -> float:  # a NaN (a variance of one sample) is as far as it gets
        return math.inf if math.isnan(r["d"]) or not r["allowed"] else r["d"] / r["allowed"]

    worst = max(rows, key=ratio, default=None)
    moved = ratio(worst) if worst else 0.0
    lines = (res.stdout + res.stderr).strip().splitlines()
    error = next((ln for ln in lines if ln.startswith("E ")), lines[-1] if lines else "")[1:].strip()
    # caught by the comparisons with the official numbers, or first by an exact check (a selection, a shape, an
    # answer string): then the comparisons recorded before it are all there is to measure
    caught = "comparison" if "comparisons beyond tolerance" in error else "exact check"
    return {"fixture": v["fixture"], "name": v["name"], "failed": res.returncode != 0, "caught": caught,
            "resolution": v.get("resolution"),
            "moved": moved, "relative": worst["d"] / worst["scale"] if worst and worst["scale"] else None,
            "at": worst["what"] if worst else None, "error": error[:200]}


def main_variants(fixtures: list[str], out: Path, min_variant: float, jobs: int) -> int:
    import queue
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    variants = load_variants(fixtures)
    copies: queue.Queue[Path] = queue.Queue()  # one repository copy per worker: a variant edits its copy in place
    for i in range(max(1, jobs)):
        copy = out / f"repository{i}"
        for name in COPIED:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, copy / name)
        copies.put(copy)

    def one(n: int) -> dict:
        copy = copies.get()
        try:
            return run_variant(variants[n], copy, out, n)
        finally:
            copies.put(copy)

    results = []
    print(f"{len(variants)} wrong variants over {len({v['fixture'] for v in variants})} fixtures", flush=True)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for r in pool.map(one, range(len(variants))):
            results.append(r)
            rel = f"{r['relative']:.2g}" if r["relative"] is not None else "-"
            how = f"fails ({r['caught']})" if r["failed"] else "PASSES"
            print(f"{r['fixture']:>16} | {r['name'][:60]:<60} | {how} | {r['moved']:.3g} tolerances (relative {rel}) "
                  f"at {r['at']}" + (f" | {r['error'][:100]}" if r["caught"] != "comparison" else ""), flush=True)
    (out / "variants.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'fixture':<16} {'variants':>8} {'exact':>5} {'smallest move':>14}  (tolerances; relative to scale)  "
          "which")
    # a variant an exact check catches first is held to failing; one the comparisons catch, to moving them far
    near = [r for r in results if r["caught"] == "comparison" and r["moved"] < min_variant]
    bad = [r for r in results if not r["failed"] or (r in near and not r["resolution"])]
    for fx in sorted({r["fixture"] for r in results}):
        rs = [r for r in results if r["fixture"] == fx]
        exact = sum(r["caught"] != "comparison" for r in rs)
        low = min([r for r in rs if r["caught"] == "comparison"] or rs, key=lambda r: r["moved"])
        rel = f"{low['relative']:.2g}" if low["relative"] is not None else "-"
        print(f"{fx:<16} {len(rs):>8} {exact:>5} {low['moved']:>14.3g}  ({rel})  {low['name']}")
    for r in near:
        if r["failed"] and r["resolution"]:
            print(f"fails {r['moved']:.3g} tolerances away, at the resolution: {r['fixture']}: {r['name']} "
                  f"({r['resolution']})")
    for r in bad:
        what = "passes" if not r["failed"] else "moves only {:.3g} tolerances".format(r["moved"])
        print(f"{what}: {r['fixture']}: {r['name']} ({r['error']})")
    print(f"reports: {out}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", nargs="+", choices=sorted(KERNELS), default=list(KERNELS))
    ap.add_argument("--out", type=Path, help="a new directory for the per-kernel-set reports (default: a temp dir)")
    ap.add_argument("--jobs", type=int, default=2, help="pytest workers per kernel set; variants run at once")
    ap.add_argument("--min-margin", type=float, default=10.0)
    ap.add_argument("--summary-only", action="store_true", help="summarise the reports already in --out")
    ap.add_argument("--variants", nargs="*", metavar="FIXTURE",
                    help="run the wrong variants (of these fixtures; all when none named) instead")
    ap.add_argument("--min-variant", type=float, default=10.0)
    ap.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments (-k, a file)")
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="mcit_numerics_"))
    if not args.summary_only:
        if out.exists() and any(out.iterdir()):
            print(f"error: --out {out}: exists and is not empty", file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
    if args.variants is not None:
        return main_variants(args.variants, out, args.min_variant, args.jobs)
    failed = []
    for name in args.kernels:
        if args.summary_only:
            continue
        rc, secs = run_kernel_set(name, out, args.jobs, args.pytest_args)
        tail = (out / f"{name}.log").read_text().strip().splitlines()[-1:]
        print(f"{name:>20}: rc {rc} in {secs:.0f} s  {tail[0] if tail else ''}", flush=True)
        if rc != 0:
            failed.append(name)
    runs = {name: load(out / f"{name}.jsonl") for name in args.kernels}
    runs = {k: v for k, v in runs.items() if v}
    if not runs:
        print("error: no comparisons were recorded", file=sys.stderr)
        return 1
    moved = changed_by(runs)
    print("\nquantities that differ from the default kernel set in any bit: "
          + ", ".join(f"{k} {v}" for k, v in moved.items() if k != "default"))
    rows = summarise(runs)
    print(f"\n{'fixture':<17} {'n':>4} {'tolerance':>9} {'floor':>8} {'margin':>7} {'spread':>7}  "
          "worst quantity (kernel set); floor = tolerance / margin, spread in tolerances")
    low = []
    for r in rows:
        print(f"{r['fixture']:<17} {r['quantities']:>4} {r['tolerance']:>9.1e} {r['floor']:>8.2e} {r['margin']:>7.1f} "
              f"{r['spread']:>7.3f}  {r['margin_at']} ({r['kernel']})")
        if r["margin"] < args.min_margin:
            low.append(r)
    (out / "summary.json").write_text(json.dumps({"kernels": list(runs), "changed": moved, "fixtures": rows},
                                                 indent=1, default=str))
    print(f"\nreports: {out}")
    for r in low:
        print(f"margin {r['margin']:.1f} < {args.min_margin:g} in {r['fixture']}: {r['margin_at']}")
    if failed:
        print("tests failed under: " + ", ".join(failed) + f" (logs in {out})")
    return 1 if failed or low else 0


if __name__ == "__main__":
    sys.exit(main())
