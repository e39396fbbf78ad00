#!/usr/bin/env python
"""The pipeline's evaluation of instruction tasks against bare ``generate`` calls, in one run, same answers.

Same model (the config's multimodal backbone in its zero-shot state: the method's prompts bypassed, as in the
pipeline's zero-shot row, so transformers' own ``generate`` computes the same thing), same prompts (the test
splits' samples, collated once before timing by the pipeline's own collate for the bare paths):

* pipeline: ``mcit.run.evaluation.evaluate_row`` as the eval stage runs it: shards read, decoded and
  collated by ``data.num_workers`` loader workers, the method's ``generate`` (batched greedy decoding with the
  KV cache), scoring, gathering and the answers file written.
* bare batched: ``model.generate(input_ids, pixel_values, attention_mask)`` of the transformers model on the
  pre-collated batches (``eval.batch_size``, left padding), greedy, the same ``max_new_tokens``.
* bare per question: the same ``generate`` once per question, unpadded (what a loop over a dataset's
  questions does; most MCIT code bases evaluate this way).

The three produce answers per question key; the bench stops if any answer differs. Passes alternate for
``--rounds`` rounds; the ratios are medians of per-round paired ratios: pipeline / batched (target >= 0.9)
and pipeline / per-question (target >= 5). A breakdown of the pipeline's pass says where its time goes beside
the bare batched ``generate``: inside the method's ``generate`` (the same computation as the bare call: on 2 CPU cores
the two cost the same in isolation, and the method's is slower in the pass because the loader workers take CPU
from it), before the first batch (the stream's start and the batch collated in-process), and
between batches (waiting for the loader, scoring, gathering, writing the answers): what to look at on a device
where the ratio falls short.

On a CPU, the bare paths prepare no data and the pipeline's loader workers share the cores with generation:
`make bench` runs this with one torch thread, so the workers have the other core as they have a GPU node's CPU
cores (there the ratio measures the pipeline's own feeding, gathering and writing); with torch on every core it
also measures the data preparation's CPU share (docs/benchmarks.md).

    python bench/eval_throughput.py [--config configs/tiny_mcit_fwd_prompt.yaml] [--rounds 3] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_mcit_fwd_prompt.yaml"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args()
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    os.chdir(ROOT)

    from bench.host import bench_host
    from mcit.core import distributed as dist
    from mcit.data.loader import eval_batches
    from mcit.run.evaluation import evaluate_row

    # every round answers again: a reused evaluation cell would time nothing (the chunk commits are timed)
    with bench_host(args.config, ["eval.reuse=false", *args.overrides]) as (plan, host):
        cfg, device = plan.cfg, dist.device()
        backbone, tests = host.backbone, plan.test
        collates = [host.collate(i, train=False) for i in range(len(tests))]
        method = host.build()
        B, T = cfg.eval.batch_size, cfg.eval.max_new_tokens
        n = sum(s.num_samples for s in tests)

        def collated(size: int) -> list:
            return [b.to(device) for s, c in zip(tests, collates)
                    for b in eval_batches(s, rank=0, world=1, batch_size=size, policy=cfg.data.split, collate=c)]

        batched, single = collated(B), collated(1)
        model, tok = backbone.model, backbone.tokenizer
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

        spans: list[tuple[float, float]] = []  # (start, end) of each method.generate call of the current pass
        method_generate = method.generate

        def timed_generate(batch: Any, max_new_tokens: int) -> list[str]:
            """The method's generate, its span recorded: what the pipeline spends outside it is its feeding."""
            sync()
            t = time.perf_counter()
            out = method_generate(batch, max_new_tokens)
            sync()
            spans.append((t, time.perf_counter()))
            return out

        method.generate = timed_generate
        parts: dict[str, list[float]] = {"generate": [], "first": [], "between": []}

        def pipeline() -> tuple[float, dict[str, str]]:
            spans.clear()
            with tempfile.TemporaryDirectory() as answers, host.zero_shot():
                sync()
                t0 = time.perf_counter()
                evaluate_row(host, trained=0, answers_dir=Path(answers), desc="bench")  # the eval stage's zero-shot row
                sync()
                dt = time.perf_counter() - t0
                rows = [json.loads(line) for f in sorted(Path(answers).glob("*.jsonl")) for line in open(f)]
            gen = sum(b - a for a, b in spans)
            parts["generate"].append(gen)
            parts["first"].append(spans[0][0] - t0 if spans else dt)
            parts["between"].append(dt - gen - parts["first"][-1])
            return dt, {r["key"]: r["text"] for r in rows}

        @torch.no_grad()
        def bare(batches: list) -> tuple[float, dict[str, str]]:
            out: dict[str, str] = {}
            sync()
            t0 = time.perf_counter()
            for b in batches:
                ids = b.inputs["input_ids"]
                gen = model.generate(input_ids=ids, attention_mask=b.inputs["attention_mask"],
                                     pixel_values=b.pixel_values.to(backbone.dtype), max_new_tokens=T, do_sample=False,
                                     num_beams=1, pad_token_id=int(tok.pad_token_id),
                                     eos_token_id=int(tok.eos_token_id))
                texts = tok.batch_decode(gen[:, ids.shape[1]:], skip_special_tokens=True)
                out.update({k: t.strip() for k, t in zip(b.keys, texts)})
            sync()
            return time.perf_counter() - t0, out

        pipeline()  # warm-up: first worker start, first generate
        for v in parts.values():
            v.clear()
        times: dict[str, list[float]] = {"pipeline": [], "bare batched": [], "bare per question": []}
        answers: dict[str, dict[str, str]] = {}
        for r in range(args.rounds):
            for name, run in (("pipeline", pipeline), ("bare batched", lambda: bare(batched)),
                              ("bare per question", lambda: bare(single))):
                dt, got = run()
                times[name].append(dt)
                answers[name] = got
            print(f"round {r + 1}: " + "   ".join(f"{k} {n / v[-1]:8.1f} questions/s" for k, v in times.items()),
                  flush=True)
        ref = answers["pipeline"]
        for name in ("bare batched", "bare per question"):
            diff = [k for k in ref if answers[name].get(k) != ref[k]]
            if len(answers[name]) != len(ref) or diff:
                print(f"error: {name} answers differ from the pipeline's on {len(diff)} of {len(ref)} questions "
                      f"(first: {diff[:1]})")
                return 1
        print(f"model: {cfg.backbone.kind} {cfg.backbone.tag} (LLM hidden {backbone.hidden_size}); {len(tests)} test "
              f"splits, {n} questions; eval batch {B}, max_new_tokens {T}; num_workers {cfg.data.num_workers}; "
              f"torch threads "
              f"{torch.get_num_threads()}; device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
        print(f"answers: identical on all {len(ref)} questions for the three paths "
              f"({sum(1 for v in ref.values() if v)} non-empty)")
        for name, v in times.items():
            print(f"{name:18s}: {n / statistics.median(v):8.1f} questions/s (median)")
        p, b, s = times["pipeline"], times["bare batched"], times["bare per question"]
        med = {k: statistics.median(v) for k, v in parts.items()}
        print(f"pipeline pass (median s): {statistics.median(p):.3f} = method generate {med['generate']:.3f} "
              f"(bare batched generate {statistics.median(b):.3f}) + before the first batch {med['first']:.3f} + "
              f"between batches and after the last {med['between']:.3f} "
              f"(waiting for the loader, scoring, gathering, the answers file)")
        print(f"ratio pipeline / bare batched      = {statistics.median(y / x for x, y in zip(p, b)):.3f}  "
              f"(median of the per-round paired ratios; target >= 0.9)")
        print(f"ratio pipeline / bare per question = {statistics.median(y / x for x, y in zip(p, s)):.2f}  "
              f"(target >= 5)")
        print(f"ratio bare batched / bare per question = {statistics.median(y / x for x, y in zip(b, s)):.2f}  "
              f"(what batching itself gives on this device and model: the pipeline's ceiling against per question)")
        return 0


if __name__ == "__main__":
    from mcit.core.distributed import exit_process

    exit_process(main())
