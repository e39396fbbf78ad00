"""End-to-end runs of pipelines/run_task_sequence.py under the real launchers (CPU, gloo)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import (
    EVALUATE,
    FAULTY,
    TRAINED_LOSS,
    final_training_loss,
    http_served,
    launch,
    run_main,
    snapshot,
    tiny_config,
)

METRIC_KEYS = {"tasks", "acc_matrix", "final_avg_acc", "final_avg_acc_task_mean", "avg_incremental_acc",
               "forgetting", "bwt", "fwd"}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def reference_run(assets, work):
    """An uninterrupted 2-process DeepSpeed run of the tiny config, with 2 loader workers per rank."""
    cfg = tiny_config(assets, work, "ref", data={"num_workers": 2})
    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return cfg, work / "runs" / "ref", res


def test_two_process_deepspeed_run_writes_metrics_and_report(reference_run):
    _, run_dir, res = reference_run
    m = json.loads((run_dir / "metrics.json").read_text())
    assert METRIC_KEYS <= set(m)
    assert m["complete"] and m["tasks"] == ["task0", "task1", "task2"]
    assert len(m["acc_matrix"]) == 3 and all(len(r) == 3 for r in m["acc_matrix"])
    assert len(m["zero_shot"]) == 3
    # class-incremental protocol: a task not yet trained cannot be predicted
    assert m["acc_matrix"][0][1] == 0.0 and m["acc_matrix"][0][2] == 0.0
    assert final_training_loss(run_dir) < TRAINED_LOSS  # it learns (conftest: why not its test accuracy)
    assert (run_dir / "acc_matrix.png").read_bytes()[:4] == b"\x89PNG"
    assert "## Accuracy matrix" in (run_dir / "report.md").read_text()
    state = json.loads((run_dir / "state.json").read_text())
    assert state["finished"] and state["completed"][-1] == "2/commit"
    assert "accuracy matrix (%)" in res.stdout and "final_avg_acc=" in res.stdout
    logs = [json.loads(line) for line in (run_dir / "logs" / "train.jsonl").read_text().splitlines()]
    assert any("samples_per_s" in r for r in logs)
    # step checkpoints are dropped at commit; the per-task exports stay
    assert not list(run_dir.glob("checkpoints/task_*/steps"))
    assert all((run_dir / f"checkpoints/task_{t}/method.safetensors").is_file() for t in range(3))
    # the backbone the run used, by tag and checkpoint digest, in the run directory and the metrics
    from mcit.models.zoo import sha256_path

    record = json.loads((run_dir / "backbone.json").read_text())
    backbone = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["backbone"]["path"])
    assert record["sha256"] == m["backbone_sha256"] == sha256_path(backbone) and record["format"] == "hf"
    assert m["backbone_sha256"][:16] in (run_dir / "report.md").read_text()


def test_finished_run_reprints_summary_and_does_nothing(reference_run):
    cfg, run_dir, _ = reference_run
    before = snapshot(run_dir)
    res = launch(["--config", str(cfg)], launcher="python")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "nothing to do" in res.stdout and "accuracy matrix (%)" in res.stdout
    assert snapshot(run_dir) == before


def test_preempted_then_killed_run_resumes_to_identical_metrics(assets, work, reference_run):
    """SIGUSR1 to one rank in task 1: every rank stops after the same step, the step checkpoint is
    committed and the run exits 75 ("resume me"). The resumed run is then killed (SIGKILL, every rank)
    after step 5 of task 2, whose last committed step is 3 (checkpoint_every=3). The last re-run ends
    with the uninterrupted run's metrics."""
    _, ref_dir, _ = reference_run
    cfg = tiny_config(assets, work, "preempt", data={"num_workers": 2})  # killed with its workers running
    run_dir = work / "runs" / "preempt"
    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2, entry=FAULTY, MCIT_TEST_FAULT="1:4:1:USR1")
    assert res.returncode == 75, res.stdout[-2000:] + res.stderr[-2000:]
    assert "preempted at task 1, optimizer step 4" in res.stderr
    committed = json.loads((run_dir / "checkpoints/task_1/steps/committed.json").read_text())
    assert committed["global_step"] == 4  # checkpoint_every=3: step 4 was saved for the preemption
    # the ZeRO step checkpoint holds the method's own tensors only, never the frozen backbone
    import torch

    states = list((run_dir / "checkpoints/task_1/steps").glob("step00000004/*model_states.pt"))
    module = torch.load(states[0], map_location="cpu", weights_only=False)["module"]
    export = json.loads((ref_dir / "checkpoints/task_0/method.json").read_text())["tensors"]
    assert set(module) == set(export) and not any("backbone" in k or "encoder.layer" in k for k in module)
    (run_dir / "PREEMPT").write_text("left by the job that was preempted\n")  # cleared on resume

    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2, entry=FAULTY, MCIT_TEST_FAULT="2:5")
    assert res.returncode != 0
    assert not (run_dir / "PREEMPT").exists()
    state = json.loads((run_dir / "state.json").read_text())
    assert "2/train" not in state["completed"] and "1/commit" in state["completed"]
    committed = json.loads((run_dir / "checkpoints/task_2/steps/committed.json").read_text())
    assert committed["global_step"] == 3  # checkpoint_every=3, killed after step 5

    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads((run_dir / "metrics.json").read_text())
    ref = json.loads((ref_dir / "metrics.json").read_text())
    assert got["acc_matrix"] == ref["acc_matrix"] and got["final_avg_acc"] == ref["final_avg_acc"]


def test_loader_workers_and_remote_shards_change_no_batch_and_no_number(assets, work, reference_run):
    """The reference run reads local shards and collates in 2 worker processes per rank with l2p's random crops
    and flips. The same run with the collation in the training processes and its shards streamed (task0 and
    task2 from a loopback HTTP server as data.root, task1 through ``pipe:cat``) ends with the same matrix and
    the same logged losses. (One run for both, to keep the suite's time: tests/unit/test_loader.py and
    tests/unit/test_locations.py pin each on its own.)"""
    _, ref_dir, _ = reference_run
    shards = assets["shards"]
    with http_served(shards) as url:
        cfg = tiny_config(assets, work, "inline", data={
            "num_workers": 0, "root": url,
            "tasks": ["task0", {"name": "task1", "train": f"pipe:cat {shards}/task1/train/{{}}",
                                "test": f"pipe:cat {shards}/task1/test/{{}}"}, "task2"]})
        res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads((work / "runs" / "inline" / "metrics.json").read_text())
    ref = json.loads((ref_dir / "metrics.json").read_text())
    assert got["acc_matrix"] == ref["acc_matrix"]

    def losses(d: Path) -> list:
        return [(r["task"], r["step"], r["loss"])
                for r in map(json.loads, (d / "logs" / "train.jsonl").read_text().splitlines()) if "loss" in r]

    assert losses(work / "runs" / "inline") == losses(ref_dir) and len(losses(ref_dir)) > 10


@pytest.mark.parametrize("how", ["KILL", "STOP"])
def test_dead_or_stuck_rank_ends_the_run_within_the_timeout_naming_the_stage(assets, work, how):
    """Two processes with no launcher to clean up. Rank 1 is killed (KILL: its peer sees the connection
    drop) or frozen (STOP: alive but silent, so only the collective timeout can end the wait) after step 2
    of task 1; rank 0 stops with an error naming the stage, within train.collective_timeout_s."""
    import subprocess
    import sys
    import time

    from conftest import ROOT, free_port, need_devices, run_env

    need_devices(2)
    timeout_s = 20
    cfg = tiny_config(assets, work, f"deadrank_{how}", train={"collective_timeout_s": timeout_s})
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(FAULTY), "--config", str(cfg)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=run_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                          MASTER_PORT=port, MCIT_TEST_FAULT=f"1:2:1:{how}"))
             for r in range(2)]
    try:
        state = work / "runs" / f"deadrank_{how}" / "state.json"
        while not (state.is_file() and "0/commit" in state.read_text()):  # task 0 done: the fault is near
            assert procs[0].poll() is None, procs[0].communicate()[1][-2000:]
            time.sleep(0.2)
        t0 = time.time()
        _, err0 = procs[0].communicate(timeout=300)
        waited = time.time() - t0
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 1, err0[-2000:]
    assert "stage 1/train: a collective did not complete on rank 0" in err0
    assert waited < timeout_s + 30  # ended by the failure or the timeout, not a hang
    # the killed rank's loader workers see their parent gone and exit (torch's watchdog: every 5 s)
    deadline = time.time() + 30
    while (left := _processes_naming(cfg)) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, f"processes of the run still alive: {left}"


def _processes_naming(path: Path) -> list[int]:
    """Pids whose command line names ``path`` (a run's ranks and their forked loader workers)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(path).encode() in (proc / "cmdline").read_bytes():
                out.append(int(proc.name))
        except OSError:
            continue
    return out


def test_export_loads_without_deepspeed(reference_run, assets):
    """The per-task export (safetensors + JSON) of a 2-process ZeRO run loads into a freshly built method
    in a plain process that never imports DeepSpeed, and predicts its task."""
    import subprocess
    import sys

    from conftest import ROOT, run_env

    _, run_dir, _ = reference_run
    code = f"""
import json, sys, torch
from safetensors.torch import load_file
from mcit.core.config import load_config
from mcit.data.shards import open_split, iter_samples
from mcit.data.types import TaskSequence
from mcit.models.base import load_backbone
from mcit.core.registry import METHODS
run = {str(run_dir)!r}
desc = json.load(open(run + "/checkpoints/task_0/method.json"))
cfg = load_config(run + "/config.yaml")
bb = load_backbone("vit", {str(assets["backbone"])!r})
splits = [open_split({str(assets["shards"])!r} + f"/task{{t}}/test") for t in range(3)]
seq = TaskSequence.from_label_spaces(["task0", "task1", "task2"], [s.label_space for s in splits])
cls = METHODS.get(desc["method"])
m = cls(cls.Params(**desc["method_params"]), bb, seq)
m.load_state_dict(load_file(run + "/checkpoints/task_0/method.safetensors"))
m.eval()
collate = bb.make_collate(splits[0], 0, train=False, label_index=seq.label_to_index())
batch = collate(list(iter_samples(splits[0], 0, 1, policy="sample")))
allowed = torch.zeros(seq.num_classes, dtype=torch.bool)
allowed[list(seq.tasks[0].classes)] = True
batch.allowed_classes = allowed  # the run's protocol: after task 0 only its classes
with torch.no_grad():
    pred = m.predict(batch)
print(json.dumps({{"acc": float((pred == batch.labels).float().mean()), "deepspeed": "deepspeed" in sys.modules}}))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=run_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    m = json.loads((run_dir / "metrics.json").read_text())
    assert out["deepspeed"] is False and 100 * out["acc"] == pytest.approx(m["acc_matrix"][0][0])


def _row(run_dir: Path, tag: str) -> list[float]:
    return json.loads((run_dir / "eval" / "evaluate" / f"{tag}.json").read_text())["acc"]


def _training_state(run_dir: Path) -> dict[str, str]:
    """The run directory without what evaluate.py writes itself (its rows and its own appended logs)."""
    return {k: v for k, v in snapshot(run_dir).items() if not k.startswith(("eval/evaluate/", "logs/evaluate."))}


def test_evaluate_reproduces_the_stored_rows_on_another_world_size(reference_run):
    """The exports of a 2-process run, evaluated by 1 process (another batch size) and by 2 processes,
    give the run's accuracy-matrix rows exactly, and the training state is not touched."""
    _, run_dir, _ = reference_run
    m = json.loads((run_dir / "metrics.json").read_text())
    before = _training_state(run_dir)
    res = launch(["--run", str(run_dir), "--task-checkpoint", "all", "--zero-shot", "--batch-size", "7",
                  "--recompute"], entry=EVALUATE)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [_row(run_dir, f"after_task_{k}") for k in range(3)] == m["acc_matrix"]
    assert _row(run_dir, "zero_shot") == m["zero_shot"]
    assert "evaluated on 1 process" in res.stdout
    assert _training_state(run_dir) == before
    res = launch(["--run", str(run_dir), "--task-checkpoint", "1", "--tasks", "task0", "task2", "--recompute"],
                 entry=EVALUATE,
                 launcher="deepspeed", nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _row(run_dir, "after_task_1") == [m["acc_matrix"][1][0], m["acc_matrix"][1][2]]
    res = run_main(["--run", str(run_dir), "--task-checkpoint", "7"], entry="evaluate")  # stops before any work
    assert res.returncode == 2 and "no exported checkpoint after task 7 (exported: [0, 1, 2])" in res.stderr


def test_evaluate_fills_in_a_lost_row(reference_run, work):
    _, ref_dir, _ = reference_run
    run_dir = work / "runs" / "lost_row"
    shutil.copytree(ref_dir, run_dir)
    ref = json.loads((ref_dir / "metrics.json").read_text())
    (run_dir / "eval" / "after_task_1.json").unlink()
    (run_dir / "metrics.json").unlink()
    res = launch(["--run", str(run_dir), "--task-checkpoint", "1", "--write-rows"], entry=EVALUATE)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads((run_dir / "metrics.json").read_text())
    assert got["acc_matrix"] == ref["acc_matrix"] and got["final_avg_acc"] == ref["final_avg_acc"] and got["complete"]
    assert (run_dir / "state.json").read_text() == (ref_dir / "state.json").read_text()


def test_plain_python_single_process_with_zero3_and_a_task_s_own_epochs(assets, work):
    """ZeRO-3 in one plain process; task1 trains its own 1 epoch (data.tasks[].epochs, as MLLM-DCL's scripts
    give each domain its own; train.epochs 2) under the step-wise warm-up cosine, restarted for the task."""
    root = assets["shards"]
    tasks = [{"name": t, "train": str(root / t / "train"), "test": str(root / t / "test"), **extra}
             for t, extra in (("task0", {}), ("task1", {"epochs": 1}))]
    cfg = tiny_config(assets, work, "zero3", data={"tasks": tasks},
                      train={"deepspeed_config": "deepspeed_configs/zero3.json", "grad_accum": 2,
                             "lr_schedule": "warmup_cosine", "warmup_ratio": 0.3, "log_every": 1})
    res = launch(["--config", str(cfg)], launcher="python")
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((work / "runs" / "zero3" / "metrics.json").read_text())
    assert m["complete"] and final_training_loss(work / "runs" / "zero3") < TRAINED_LOSS
    logs = [json.loads(ln) for ln in (work / "runs" / "zero3" / "logs" / "train.jsonl").read_text().splitlines()]
    steps = {t: [r for r in logs if r.get("task") == t and "lr" in r] for t in (0, 1)}
    epochs = {t: [r["epoch"] for r in steps[t]] for t in (0, 1)}
    assert epochs[0].count(0) == epochs[0].count(1) >= 3 and set(epochs[0]) == {0, 1}
    assert set(epochs[1]) == {0} and len(epochs[1]) >= 3
    for t in (0, 1):  # the lr after each step: up from 0 over the warm-up, down to 0 at the task's own last step
        lrs = [r["lr"] for r in steps[t]]
        peak = lrs.index(max(lrs))
        assert max(lrs) == pytest.approx(0.05) and lrs[-1] == pytest.approx(0.0, abs=1e-12)
        assert lrs[:peak + 1] == sorted(lrs[:peak + 1]) and lrs[peak:] == sorted(lrs[peak:], reverse=True)


def test_torchrun_two_processes_with_zero3_cpu_offload(assets, work):
    cfg = tiny_config(assets, work, "offload", data={"tasks": ["task0", "task1"]},
                      train={"deepspeed_config": "deepspeed_configs/zero3_offload.json"})
    res = launch(["--config", str(cfg)], launcher="torchrun", nproc=2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = json.loads((work / "runs" / "offload" / "metrics.json").read_text())
    assert m["complete"] and final_training_loss(work / "runs" / "offload") < TRAINED_LOSS


def test_nonfinite_loss_stops_with_one_line_and_resumes_from_the_last_checkpoint(assets, work, reference_run):
    """Task 1's loss is made NaN at optimizer step 5 on rank 1 only (the test-only seam mcit.run.engine.on_loss):
    both ranks agree through one all-reduce and stop before the backward, rank 0 prints one line, exit 1.
    The step checkpoint committed at step 3 is untouched and task 1 is not recorded as trained; a plain
    re-run resumes from it and ends with the uninterrupted run's matrix."""
    _, ref_dir, _ = reference_run
    cfg = tiny_config(assets, work, "nan_stop")
    run_dir = work / "runs" / "nan_stop"
    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2, entry=FAULTY, MCIT_TEST_NONFINITE="1:5:1")
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    errors = [ln for ln in res.stderr.splitlines() if "error" in ln.lower() and "loss is" in ln]
    assert len(errors) == 1 and errors[0].startswith("error: task 1 step 5: loss is nan"), res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    state = json.loads((run_dir / "state.json").read_text())
    assert "0/commit" in state["completed"] and "1/train" not in state["completed"]
    steps = run_dir / "checkpoints/task_1/steps"
    committed = json.loads((steps / "committed.json").read_text())
    assert committed["global_step"] == 3 and [p.name for p in steps.iterdir() if p.is_dir()] == ["step00000003"]
    before = snapshot(steps)

    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2, entry=FAULTY, MCIT_TEST_NONFINITE="1:5:0:inf")
    # times inf: +inf or -inf by the sign of the loss (L2P's key pull makes it negative)
    assert res.returncode == 1 and re.search(r"error: task 1 step 5: loss is -?inf \(", res.stderr), res.stderr[-1000:]
    assert snapshot(steps) == before  # a second stop at the same step leaves the checkpoint as it was

    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads((run_dir / "metrics.json").read_text())
    ref = json.loads((ref_dir / "metrics.json").read_text())
    assert got["acc_matrix"] == ref["acc_matrix"]


def test_nonfinite_skip_drops_the_micro_batch_and_counts_it(assets, work):
    """train.on_nonfinite: skip: a NaN loss at task 0 step 2 is dropped (no backward, no update), logged,
    and the run finishes; with max_nonfinite_steps 0 the same NaN stops it, naming the limit."""
    cfg = tiny_config(assets, work, "nan_skip", data={"tasks": ["task0", "task1"]},
                      train={"on_nonfinite": "skip", "max_nonfinite_steps": 1})
    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2, entry=FAULTY, MCIT_TEST_NONFINITE="0:2")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    logs = [json.loads(ln) for ln in (work / "runs" / "nan_skip" / "logs" / "train.jsonl").read_text().splitlines()]
    skips = [r for r in logs if "nonfinite_skipped" in r]
    assert [(r["task"], r["step"], r["nonfinite_skipped"]) for r in skips] == [(0, 1, 1)]
    m = json.loads((work / "runs" / "nan_skip" / "metrics.json").read_text())
    assert m["complete"] and all(all(v == v for v in row) for row in m["acc_matrix"])

    cfg = tiny_config(assets, work, "nan_skip0", data={"tasks": ["task0", "task1"]},
                      train={"on_nonfinite": "skip", "max_nonfinite_steps": 0})
    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2, entry=FAULTY, MCIT_TEST_NONFINITE="0:2")
    assert res.returncode == 1 and "error: task 0 step 2: loss is nan; 1 micro-batches skipped in this task, " \
                                   "more than train.max_nonfinite_steps=0" in res.stderr, res.stderr[-2000:]


def test_failed_writes_stop_in_one_line_and_the_run_resumes(assets, work, reference_run):
    """A full disk, a read-only file system and a permission error while writing an eval row, a task
    checkpoint and the state file (OSError injected through the test-only seam mcit.core.checkpoint.on_write, on
    rank 0 of 2): one line naming the file, no temp file left, state.json still at the last completed stage,
    and plain re-runs resume to the uninterrupted run's matrix."""
    _, ref_dir, _ = reference_run
    cfg = tiny_config(assets, work, "write_fail")
    run_dir = work / "runs" / "write_fail"
    cases = [("eval/after_task_0.json", "ENOSPC", "No space left on device", "0/subspace"),
             ("checkpoints/task_1/method.safetensors", "EROFS", "Read-only file system", "1/eval"),
             ("state.json", "EACCES", "Permission denied", "1/eval")]  # the write that would record 1/commit
    for suffix, code, text, last in cases:
        res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2, entry=FAULTY,
                     MCIT_TEST_WRITE_FAIL=f"{suffix}:{code}")
        assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
        errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error")]
        assert errors == [f"error: cannot write {run_dir / suffix}: {text} ({code}); state.json still ends at "
                          f"stage {last}: free space (or fix the permissions) and re-run the same command to "
                          f"resume"], res.stderr[-3000:]
        assert "Traceback" not in res.stderr and "collective" not in res.stderr
        assert json.loads((run_dir / "state.json").read_text())["completed"][-1] == last
        assert not [p for p in run_dir.rglob(".*.tmp*")]
        if code == "EROFS":  # the step checkpoints stay until the task's export is written
            assert (run_dir / "checkpoints/task_1/steps/committed.json").is_file()
    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads((run_dir / "metrics.json").read_text())
    assert got["acc_matrix"] == json.loads((ref_dir / "metrics.json").read_text())["acc_matrix"]


def test_the_loss_is_the_mean_over_every_rank_s_samples(assets, work):
    """One SGD step over all of task 0 (281 samples; 2 ranks get whole shards: 160 and 121) gives the weights
    one process gives: the per-sample losses are summed and divided by the real samples over all ranks.
    Dividing by each rank's own count (then DeepSpeed's average) weights rank 1's samples 160/121 higher."""
    from safetensors.torch import load_file

    from mcit.data.loader import rank_counts
    from mcit.data.shards import open_split

    assert rank_counts(open_split(assets["shards"] / "task0" / "train"), 2, "auto") == [160, 121]
    got = {}
    for nproc in (1, 2):
        name = f"global_mean_{nproc}"
        cfg = tiny_config(assets, work, name, data={"tasks": ["task0"]}, eval={"zero_shot": False, "batch_size": 50},
                          train={"epochs": 1, "batch_size": 288, "optimizer": "sgd", "lr": 0.5, "progress": False,
                                 "deepspeed_config": "deepspeed_configs/zero2.json"})
        res = launch(["--config", str(cfg)], launcher="python" if nproc == 1 else "deepspeed", nproc=nproc)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        got[nproc] = load_file(str(work / "runs" / name / "checkpoints/task_0/method.safetensors"))
    import torch

    assert set(got[1]) == set(got[2]) and got[1]
    for k in got[1]:
        assert torch.allclose(got[2][k].double(), got[1][k].double(), rtol=1e-5, atol=1e-6), k


def test_backbone_with_a_nan_weight_stops_at_the_first_step(assets, work):
    """A backbone checkpoint with NaN in one weight tensor used to train every task and commit 0.0 everywhere."""
    from safetensors.torch import load_file, save_file

    bad = work / "nan_backbone"
    shutil.copytree(assets["backbone"], bad, dirs_exist_ok=True)
    f = next(bad.glob("*.safetensors"))
    tensors = load_file(str(f))
    name = next(k for k in tensors if k.endswith("attention.query.weight") or k.endswith("q_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(f), metadata={"format": "pt"})
    cfg = tiny_config(assets, work, "nan_backbone", backbone={"kind": "vit", "path": str(bad), "tag": "nan_vit"})
    res = launch(["--config", str(cfg)], launcher="python")
    assert res.returncode == 1 and "error: task 0 step 1: loss is nan" in res.stderr, res.stderr[-2000:]
    assert not (work / "runs" / "nan_backbone" / "metrics.json").exists() or \
        not json.loads((work / "runs" / "nan_backbone" / "metrics.json").read_text())["acc_matrix"]


def test_a_run_started_with_relative_paths_evaluates_after_a_move_from_another_directory(assets, work):
    """The run is launched from the repository root with data.root, backbone.path and run_dir relative to it.
    Its config.yaml keeps them absolute, so the run directory, copied elsewhere, evaluated from another
    working directory by `evaluate.py --run NEWPATH --task-checkpoint all`, gives the stored rows exactly."""
    import os
    import subprocess
    import sys

    from conftest import ROOT, run_env

    rel = lambda p: os.path.relpath(p, ROOT)  # noqa: E731
    cfg = tiny_config(assets, work, "relative", data={"root": rel(assets["shards"]), "tasks": ["task0", "task1"]},
                      backbone={"kind": "vit", "path": rel(assets["backbone"]), "tag": "tiny_test_vit"},
                      run_dir=rel(work / "runs" / "relative"))
    res = launch(["--config", str(cfg)], launcher="python")  # cwd: the repository root
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = work / "runs" / "relative"
    stored = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert stored["data"]["root"] == str(assets["shards"].resolve())
    assert stored["backbone"]["path"] == str(assets["backbone"].resolve())
    moved = work / "elsewhere" / "moved_run"
    shutil.copytree(run_dir, moved)
    shutil.rmtree(run_dir)
    other = work / "another_cwd"
    other.mkdir()
    res = subprocess.run([sys.executable, str(EVALUATE), "--run", str(moved), "--task-checkpoint", "all"], cwd=other,
                         env=run_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((moved / "metrics.json").read_text())
    assert [_row(moved, f"after_task_{k}") for k in range(2)] == m["acc_matrix"]
    assert not list(other.iterdir())  # nothing written where it was started


def _start(cfg, **env):
    import subprocess

    from conftest import ROOT, free_port, launcher_cmd, run_env

    cmd = [launcher_cmd("deepspeed", 2), "--num_gpus", "2", "--master_port", str(free_port()),
           str(FAULTY), "--config", str(cfg)]
    return subprocess.Popen(cmd, cwd=ROOT, env=run_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_for(path, timeout=180):
    import time

    end = time.time() + timeout
    while time.time() < end:
        if path.exists() and path.stat().st_size > 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"{path} did not appear")


def _wait_for_any(marker: Path, timeout: float = 180) -> None:
    """Until some rank wrote ``<marker>.<rank>`` (mcit's start-up seams: tests/launch/workers/faulty_run.py)."""
    import time

    end = time.time() + timeout
    while not list(marker.parent.glob(marker.name + ".*")):
        assert time.time() < end, f"no {marker}.<rank> after {timeout} s"
        time.sleep(0.1)


def test_one_live_launch_per_run_dir_and_a_killed_one_leaves_no_lock(assets, work, reference_run):
    """A second 2-rank launch on a run directory in use stops at once naming the first (its pid); the first
    finishes with the uninterrupted run's matrix. The first evaluates deferred (``eval.schedule: deferred``, local
    workers): its rows are answered by one worker process beside the training (it follows the commits), the
    zero-shot row while task 0 still trains, and the run ends once they are in. After a SIGKILL of every process of
    a launch -- during the process-group set-up, before the config is written, while training, inside DeepSpeed's
    op load with torch's build lock taken -- the same command takes the directory over with no manual step (a stale
    build lock removed and named) and ends with the same matrix."""
    import os
    import signal
    import time

    _, ref_dir, _ = reference_run
    ref = json.loads((ref_dir / "metrics.json").read_text())["acc_matrix"]
    cfg = tiny_config(assets, work, "locked", eval={"schedule": "deferred", "workers": "local", "poll_s": 0.5})
    run_dir = work / "runs" / "locked"
    release = work / "locked.release"
    first = _start(cfg, MCIT_TEST_PAUSE=f"0:2:120:{release}")  # asleep after task 0 step 2 until released
    _wait_for(run_dir / "logs" / "train.jsonl")
    holder = json.loads((run_dir / "run.lock").read_text())
    t0 = time.time()
    second = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2)
    took = time.time() - t0
    release.touch()
    out, err = first.communicate(timeout=600)
    assert second.returncode == 2, second.stderr[-2000:]
    line = [ln for ln in second.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and f"run directory {run_dir} is in use by another launch" in line[0]
    assert f"pid {holder['pid']}" in line[0] and holder["host"] in line[0]
    assert took < 90, took  # the launcher's start-up and one all-reduce, no training
    assert first.returncode == 0, err[-2000:]
    got = json.loads((run_dir / "metrics.json").read_text())
    want = json.loads((ref_dir / "metrics.json").read_text())
    assert got["acc_matrix"] == ref and got["zero_shot"] == want["zero_shot"]
    assert got["first_task_loss"] == want["first_task_loss"]
    events = [json.loads(x) for x in (run_dir / "logs" / "train.jsonl").read_text().splitlines()]
    trained = next(e["time"] for e in events if e.get("stage") == "0/train")
    assert (run_dir / "eval" / "zero_shot.json").stat().st_mtime < trained  # answered while task 0 trained
    recs = {tag: json.loads((run_dir / "eval" / "workers" / f"{tag}.json").read_text())
            for tag in ("zero_shot", "after_task_0", "after_task_1", "after_task_2")}
    for tag, rec in recs.items():
        assert rec["launcher"] == "local" and rec["attempt"] == 1 and f"row {tag}:" in Path(rec["log"]).read_text()
    # one worker answered every row as it came (eval.worker_follow): one start, one model load
    assert len({rec["pid"] for rec in recs.values()}) == 1
    assert [rec.get("followed") for rec in recs.values()] == [None, "zero_shot", "zero_shot", "zero_shot"]

    # The same command after a SIGKILL of the whole launch at each moment of start-up and while training; every
    # start finds what the killed one left (logs/, run.lock, torch's build lock) and goes on; the last finishes
    # with the uninterrupted matrix. DeepSpeed's ops from a copy of this environment's build directory, so the
    # stale lock made here is this test's alone.
    from mcit.core.extensions import extensions_root

    ext = work / "torch_extensions"
    shutil.copytree(extensions_root(), ext, ignore=shutil.ignore_patterns("lock", "mcit.flock"))
    cfg = tiny_config(assets, work, "locked_kill")
    run_dir = work / "runs" / "locked_kill"
    torch_lock = ext / "deepspeed_shm_comm" / "lock"

    def kill_at(moment: str) -> str:
        marker = work / f"startup_{moment}"
        victim = _start(cfg, MCIT_TEST_STARTUP_PAUSE=f"{moment}:{marker}", TORCH_EXTENSIONS_DIR=str(ext))
        _wait_for_any(marker)
        os.killpg(victim.pid, signal.SIGKILL)
        return victim.communicate(timeout=60)[1]

    kill_at("process_group")  # the group up, DeepSpeed's set-up not done
    kill_at("run_locked")  # the run directory locked, the config not written
    assert not (run_dir / "config.yaml").exists() and (run_dir / "logs").is_dir()
    victim = _start(cfg, MCIT_TEST_PAUSE="0:2:60", TORCH_EXTENSIONS_DIR=str(ext))
    _wait_for(run_dir / "logs" / "train.jsonl")  # killed while training (asleep after step 2)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=60)
    kill_at("ops_locked")  # inside the extension lock, torch's own build lock taken
    assert torch_lock.is_file()  # what hung every later launch before (FileBaton.wait, no time limit)
    t0 = time.time()
    res = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2, TORCH_EXTENSIONS_DIR=str(ext))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"removed the extension build lock {torch_lock}" in res.stderr, res.stderr[-3000:]
    assert not torch_lock.exists()
    assert json.loads((run_dir / "metrics.json").read_text())["acc_matrix"] == ref
    print(f"\n== after kills at process_group, run_locked, step 2 of task 0 and ops_locked: finished in "
          f"{time.time() - t0:.0f} s; " + next(ln for ln in res.stderr.splitlines() if "removed the extension" in ln))
