"""The train stage's small helpers: the data seed, the rank-0 log, the step checkpoint commit."""

import json
from pathlib import Path

import pytest

from mcit.run.engine import JsonlLogger, data_seed


def test_data_seeds_differ_for_every_task_epoch_and_rank_and_fit_32_bits():
    """Every (seed, task, epoch, rank) of a long run gets its own shuffle seed (a repeated seed repeats an
    epoch's order, or gives two ranks the same one), and each fits a signed 32-bit seed (numpy's limit is
    2**32, a DataLoader worker's base seed is added to it)."""
    grid = [(s, t, e, r) for s in range(3) for t in range(12) for e in range(60) for r in range(8)]
    seeds = [data_seed(*g) for g in grid]
    assert len(set(seeds)) == len(grid)
    assert all(0 <= x < 2 ** 31 for x in seeds)
    assert all(data_seed(i * 2_654_435_761, 5, 7, 3) < 2 ** 31 for i in range(64))  # large config seeds fold in


def test_log_creates_its_folder_and_appends_across_restarts(tmp_path):
    """A resumed run opens the same log again: the folder exists then, the old lines stay, and the global steps
    continue the sequence: each segment (a task's training, or a phase of it) after the ones before, a resumed
    segment at its own offset, a step it trains again at the same global step."""
    path = tmp_path / "run" / "logs" / "train.jsonl"
    first = JsonlLogger(path)
    first.segment = "0/train"
    for s in (1, 2, 3):
        first.log({"task": 0, "step": s, "loss": 2.0 - s / 10}, step=s)
    first.segment = "1/train.first"
    first.log({"task": 1, "step": 1, "loss": 1.5}, step=1)
    first.log({"task": 1, "step": 2, "loss": 1.4}, step=2)
    again = JsonlLogger(path)  # a restart from task 1's step checkpoint 1: step 2 again, then on
    assert again.task_end == {0: 3, 1: 5} and [r["global_step"] for r in again.records] == [1, 2, 3, 4, 5]
    again.segment = "1/train.first"
    again.log({"task": 1, "step": 2, "loss": 1.4}, step=2)
    again.log({"task": 1, "step": 3, "loss": 1.25}, step=3)
    again.segment = "1/train.second"  # a second phase: after the first one's three steps
    again.log({"task": 1, "step": 1, "loss": 1.0}, step=1)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["loss"] for r in lines] == [1.9, 1.8, 1.7, 1.5, 1.4, 1.4, 1.25, 1.0]
    assert [r["global_step"] for r in lines] == [1, 2, 3, 4, 5, 5, 6, 7]
    assert again.trackers is None and not (tmp_path / "run" / "logs" / "tb").exists()  # no tracker configured


class _Engine:
    """What ``save_step`` asks of a DeepSpeed engine: ``save_checkpoint`` writes ``<dir>/<tag>/``."""

    def __init__(self, fail: OSError | None = None) -> None:
        self.fail = fail

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        if self.fail is not None:
            raise self.fail
        assert save_latest is False  # committed.json, written after every rank's part, names the step
        (Path(save_dir) / tag).mkdir(parents=True)
        (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"x")


def test_a_step_checkpoint_is_committed_by_name_and_replaces_the_previous_one(tmp_path):
    """A resume reads committed.json: tag, the epoch and micro-step to start from, the step, the world size.
    The previous step's directory goes once the new one is committed (a long task would otherwise keep
    every step's optimizer state on disk); a failed write names the file and commits nothing."""
    from mcit.core import distributed as dist
    from mcit.core.checkpoint import WriteError
    from mcit.run.engine import COMMITTED, TaskTrainer

    dist.init()
    steps = tmp_path / "steps"
    trainer = TaskTrainer(None)
    trainer.save_step(_Engine(), steps, 3, 0, 3, 2)
    trainer.save_step(_Engine(), steps, 6, 1, 0, 2)
    assert sorted(p.name for p in steps.iterdir()) == [COMMITTED, "step00000006"]
    assert json.loads((steps / COMMITTED).read_text()) == {"tag": "step00000006", "epoch": 1, "next_micro_step": 0,
                                                           "global_step": 6, "world_size": 2}
    (steps / "step00000006").rename(steps / "old")  # the same step saved again (a preemption at a checkpoint step)
    trainer.save_step(_Engine(), steps, 6, 1, 0, 2)
    assert (steps / "step00000006").is_dir()  # not removed as "the previous one"
    full = OSError(28, "No space left on device", str(steps / "step00000009" / "x.pt"))
    with pytest.raises(WriteError, match="step00000009/x.pt"):
        trainer.save_step(_Engine(full), steps, 9, 1, 3, 2)
    assert json.loads((steps / COMMITTED).read_text())["tag"] == "step00000006"


def _ds_run(tmp_path, ds: dict, *overrides: str):
    from mcit.core.config import load_config

    (tmp_path / "ds.json").write_text(json.dumps(ds))
    return load_config("configs/digits_l2p.yaml", [f"train.deepspeed_config={tmp_path / 'ds.json'}",
                                                   "train.batch_size=4", "train.grad_accum=2", "train.grad_clip=1.5",
                                                   *overrides])


def test_the_deepspeed_config_takes_batch_precision_and_clipping_from_the_run(tmp_path):
    """What DeepSpeed is given: the run's micro batch, accumulation, global batch over the ranks, clipping and
    precision (bf16 with fp32 gradient accumulation), an optimizer's "auto" lr / weight decay filled in, no
    periodic prints. A JSON value that disagrees with the run stops it naming the key; "auto" or the same
    value passes; train_batch_size must be the run's per-rank batch x the ranks."""
    from mcit.run.engine import build_ds_config

    ds = {"zero_optimization": {"stage": 2},
          "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": [0.9, 0.99]}},
          "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": 4}
    got = build_ds_config(_ds_run(tmp_path, ds, "train.precision=bf16", "train.lr=0.25"), 3)
    assert {k: got[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                                "gradient_clipping", "steps_per_print", "bf16", "data_types")} == {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 24,
        "gradient_clipping": 1.5, "steps_per_print": 1 << 30, "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"}}
    assert got["optimizer"]["params"] == {"lr": 0.25, "weight_decay": 0.0, "betas": [0.9, 0.99]}
    fp32 = build_ds_config(_ds_run(tmp_path, {}, "train.precision=fp32"), 1)
    assert fp32["bf16"] == {"enabled": False} and "data_types" not in fp32
    for key, value, source in (("train_micro_batch_size_per_gpu", 8, "train.batch_size"),
                               ("gradient_accumulation_steps", 1, "train.grad_accum"),
                               ("gradient_clipping", 1.0, "train.grad_clip")):
        with pytest.raises(ValueError, match=f"sets {key} {value!r} but the run's {source} is"):
            build_ds_config(_ds_run(tmp_path, {key: value}), 2)
    assert build_ds_config(_ds_run(tmp_path, {"train_batch_size": 16}), 2)["train_batch_size"] == 16
    for bad in (12, 24):  # 12: not a multiple of 4 x 2; 24: 3 ranks' worth on 2 ranks
        with pytest.raises(ValueError, match=f"sets train_batch_size {bad} but the run's"):
            build_ds_config(_ds_run(tmp_path, {"train_batch_size": bad}), 2)
    assert build_ds_config(_ds_run(tmp_path, {"train_batch_size": 24}), 1)["train_batch_size"] == 8  # pre-flight
