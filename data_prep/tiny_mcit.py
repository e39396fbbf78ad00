"""The embedded MCIT benchmark as instruction shards (procedural images + real sklearn digits).

Writes ``<out>/<task>/{train,test}/`` for the base mix (``base``: what the tiny LLaVA is
instruction-tuned on first) and the continual tasks (colour, count, position, digit), each with a
manifest (``kind: instruction``, scorer ``exact_match``), and ``<out>/benchmark.json``. A complete
build with the same settings is kept; an interrupted one is rebuilt (it is written under
``<out>.partial`` and renamed at the end).

    python -m data_prep.tiny_mcit --out data/shards/tiny_mcit
"""

from __future__ import annotations

import json
from pathlib import Path

from data_prep.common import builder_main
from mcit.core.checkpoint import publish_dir, staging_dir
from mcit.data import tiny_mcit as B
from mcit.data.instructions import write_instruction_split
from mcit.data.shards import open_split


def build(out: Path, *, seed: int = 0, n_train: int = 384, n_test: int = 600, n_base: int = 6000,
          n_base_test: int = 256, shard_size: int = 64, force: bool = False) -> dict:
    settings = dict(seed=seed, n_train=n_train, n_test=n_test, n_base=n_base, n_base_test=n_base_test,
                    shard_size=shard_size)
    meta_path = out / "benchmark.json"
    if meta_path.is_file() and not force:
        meta = json.loads(meta_path.read_text())
        if meta.get("settings") == settings:
            try:
                for t in ["base", *meta["tasks"]]:
                    open_split(out / t / "train")
                    open_split(out / t / "test")
                return meta
            except ValueError:
                pass  # damaged: rebuild
    tmp = staging_dir(out)
    write_instruction_split(tmp / "base" / "train", B.base_mix(n_base, seed, train=True), shard_size=shard_size * 4,
                            scorer="exact_match", extra={"task": "base"})
    write_instruction_split(tmp / "base" / "test", B.base_mix(n_base_test, seed, train=False), shard_size=shard_size,
                            scorer="exact_match", extra={"task": "base"})
    for task in B.CONTINUAL_TASKS:
        for split, n, train in (("train", n_train, True), ("test", n_test, False)):
            write_instruction_split(tmp / task / split, B.task_samples(task, n, seed, train=train),
                                    shard_size=shard_size, scorer="exact_match",
                                    extra={"task": task, "question": B.QUESTIONS[task]})
    meta = {"benchmark": "tiny_mcit", "settings": settings, "tasks": B.CONTINUAL_TASKS,
            "questions": B.QUESTIONS, "base": "base"}
    publish_dir(tmp, out, files={"benchmark.json": json.dumps(meta, indent=1)})
    return meta


def main(argv: list[str] | None = None) -> int:
    return builder_main(__doc__, build,
                        lambda a, meta: f"tiny_mcit benchmark at {a.out}: tasks {meta['tasks']} (+ base mix)",
                        argv, out="data/shards/tiny_mcit", options=("seed", "n_train", "n_test", "n_base"))


if __name__ == "__main__":
    raise SystemExit(main())
