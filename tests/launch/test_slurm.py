"""The project's own Slurm job scripts, unchanged, on a real Slurm (Debian's slurm-wlm on localhost, two
simulated nodes): one node with 2 ranks, two nodes with one rank each (deepspeed and srun + torchrun),
and a job that gets USR1 mid-training, commits a step checkpoint, requeues itself and finishes with the
uninterrupted run's metrics. Skipped, with the reason, where Slurm cannot be installed or run."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, TRAINED_LOSS, final_training_loss, run_env, tiny_config

CLUSTER = Path(__file__).parent / "slurm" / "cluster.sh"


@pytest.fixture(scope="module")
def slurm():
    """Install slurm-wlm if needed (skip, with the reason, where that is impossible), then bring a 2-node
    cluster up; a cluster that installs but does not come up is a failure, not a skip."""
    import tempfile

    if shutil.which("slurmctld") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            pytest.skip("a localhost Slurm needs root and Debian's apt-get to install slurm-wlm")
        inst = subprocess.run("DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm || "
                              "(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm)",
                              shell=True, capture_output=True, text=True, timeout=900)
        if shutil.which("slurmctld") is None:
            pytest.skip(f"slurm-wlm could not be installed: {inst.stderr.strip()[-300:]}")
    d = Path(tempfile.mkdtemp(prefix="mcit-slurm-", dir="/tmp"))  # munged needs o+x on every parent
    up = subprocess.run(["bash", str(CLUSTER), "up", str(d), "2"], capture_output=True, text=True, timeout=600)
    if up.returncode != 0:  # stop what did start and drop the /etc/hosts lines before failing
        subprocess.run(["bash", str(CLUSTER), "down", str(d)], capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, f"localhost Slurm did not come up: {up.stdout[-1000:]} {up.stderr[-2000:]}"
    env = run_env(SLURM_CONF=up.stdout.strip().splitlines()[-1], MCIT_PYTHON=sys.executable)
    for k in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(k)  # a test run inside a Slurm job must not leak that job's variables
    try:
        yield {"env": env, "dir": d}
    finally:
        subprocess.run(["bash", str(CLUSTER), "down", str(d)], capture_output=True, text=True, timeout=300)
        if not os.environ.get("MCIT_KEEP_SLURM_DIR"):
            shutil.rmtree(d, ignore_errors=True)


def _sbatch(slurm, script: str, config: Path, *opts: str, **env: str) -> int:
    out = subprocess.run(["sbatch", "--parsable", "--output", str(slurm["dir"] / "slurm-%j.out"), *opts,
                          str(ROOT / "pipelines" / "slurm" / script), str(config)], cwd=ROOT,
                         env={**slurm["env"], **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().split(";")[0])


def _job(slurm, job: int) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", str(job)], env=slurm["env"], capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def _wait(slurm, job: int, timeout: float = 400, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        info = _job(slurm, job)
        if info.get("JobState") in until:
            return info
        time.sleep(0.5)
    raise AssertionError(f"job {job} still {_job(slurm, job).get('JobState')} after {timeout} s:\n"
                         + _log(slurm, job)[-3000:])


def _log(slurm, job: int) -> str:
    p = slurm["dir"] / f"slurm-{job}.out"
    return p.read_text() if p.is_file() else ""


def _metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture(scope="module")
def slurm_config(assets, tmp_path_factory):
    """2 tasks, 3 epochs: long enough (about 65 optimizer steps) to be signalled mid-training; progress on (plain
    lines in slurm-<id>.out)."""
    work = tmp_path_factory.mktemp("slurm_runs")
    return lambda name: tiny_config(assets, work, name, data={"tasks": ["task0", "task1"]},
                                    train={"epochs": 3, "log_every": 1, "progress": True}), work


@pytest.fixture(scope="module")
def one_node_run(slurm, slurm_config):
    """The one-node run, submitted twice with the same command: the first job cancelled with a plain ``scancel``
    as soon as the script has started (its logs/ exist, the run's config not yet), which must leave it
    CANCELLED, not requeued; the second finishes there. Its matrix is the uninterrupted one: the two-node runs
    below (never interrupted) must match it."""
    make, work = slurm_config
    run_dir = work / "runs" / "one_node"
    cancelled = _sbatch(slurm, "one_node.sbatch", make("one_node"), MCIT_GPUS_PER_NODE="2")
    t0 = time.time()
    while not (run_dir / "logs" / "ranks" / f"job{cancelled}_restart0").is_dir():
        assert time.time() - t0 < 120, _log(slurm, cancelled)
        time.sleep(0.1)
    assert not (run_dir / "config.yaml").exists()
    r = subprocess.run(["scancel", str(cancelled)], env=slurm["env"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    while "not requeued" not in _log(slurm, cancelled):  # the batch script has ended: it did not requeue
        assert time.time() - t0 < 120, _log(slurm, cancelled)
        time.sleep(0.2)
    time.sleep(1)
    info = _job(slurm, cancelled)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), (info, _log(slurm, cancelled))
    assert not (run_dir / "config.yaml").exists()  # killed before the run wrote its config
    job = _sbatch(slurm, "one_node.sbatch", make("one_node"), MCIT_GPUS_PER_NODE="2")
    info = _wait(slurm, job)
    assert info["JobState"] == "COMPLETED", _log(slurm, job)[-3000:]
    return job, run_dir, cancelled


def test_one_node_script_runs_the_sequence(slurm, one_node_run):
    """Also: the cancelled first job (fixture) said why it did not requeue, and slurm-<id>.out of the finished
    job holds rank 0's progress lines (not a terminal: plain lines, mcit.core.progress) and the committed rows."""
    job, run_dir, cancelled = one_node_run
    m = _metrics(run_dir)
    assert m["complete"] and final_training_loss(run_dir) < TRAINED_LOSS
    log = _log(slurm, job)
    assert f"job {job} (restart 0)" in log and "1 node(s) x 2 rank(s)" in log and "mcit: run finished" in log
    ranks = run_dir / "logs" / "ranks" / f"job{job}_restart0"
    assert len(list(ranks.glob("*"))) >= 2  # one log per rank
    assert "cancelled (TERM without a time-limit warning)" in _log(slurm, cancelled)
    assert f"requeueing job {cancelled}" not in _log(slurm, cancelled)
    for t in range(2):
        assert re.search(rf"^task {t} train: 100% (\d+)/\1 \[.*step/s, loss=\d", log, re.M), log[-3000:]
        assert re.search(rf"^task {t} \(task{t}\) committed: acc on seen tasks(?: \d+\.\d){{{t + 1}}}$",
                         log, re.M), log[-3000:]
        assert re.search(rf"^task {t} eval: 100% (\d+)/\1 \[.*sample/s", log, re.M), log[-3000:]
    print(f"\n== job {job} (one node, 2 ranks) after job {cancelled} was cancelled before its config: acc_matrix "
          f"{m['acc_matrix']}, final_avg_acc {m['final_avg_acc']:.2f}\n" + "\n".join(
              ln for ln in log.splitlines() if " train: " in ln or "committed" in ln))


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_multi_node_script_on_two_nodes_matches_one_node(slurm, slurm_config, one_node_run, launcher):
    """2 nodes x 1 rank: the same world size as the one-node run, so the same data order and metrics."""
    make, work = slurm_config
    job = _sbatch(slurm, "multi_node.sbatch", make(f"two_nodes_{launcher}"), "-N", "2", MCIT_LAUNCHER=launcher)
    info = _wait(slurm, job)
    assert info["JobState"] == "COMPLETED", _log(slurm, job)[-3000:]
    assert info["NodeList"] == "n[1-2]" and "2 node(s) x 1 rank(s), master n1" in _log(slurm, job)
    got = _metrics(work / "runs" / f"two_nodes_{launcher}")
    assert got["acc_matrix"] == _metrics(one_node_run[1])["acc_matrix"]  # = the cancelled-then-resubmitted run
    print(f"\n== job {job} ({launcher}, NodeList {info['NodeList']}): acc_matrix {got['acc_matrix']}, "
          f"final_avg_acc {got['final_avg_acc']:.2f}")


def test_usr1_mid_training_checkpoints_requeues_and_resumes(slurm, assets, slurm_config, one_node_run):
    """The run (node n1, 2 ranks) evaluates deferred (``eval.schedule: deferred``, Slurm workers pinned to n2 with
    ``eval.slurm.sbatch_args``): an evaluation job on n2 answers each committed checkpoint's row while the run
    trains on, following the commits. Mid-training the run gets USR1, commits a step checkpoint and requeues
    itself; the evaluation job is cancelled at the same moment, in the zero-shot row. The requeued job (the same
    command, launched again) submits one job again, which answers that row and follows on to the others, and ends
    with the inline one-node run's matrix and zero-shot row (and its first-task losses, up to the order of a float
    sum)."""
    _, work = slurm_config
    run_dir = work / "runs" / "preempted"
    cfg = tiny_config(assets, work, "preempted", data={"tasks": ["task0", "task1"]},
                      train={"epochs": 3, "log_every": 1, "progress": True},
                      eval={"schedule": "deferred", "workers": "slurm", "poll_s": 0.5,
                            "slurm": {"sbatch_args": ["-w", "n2"]}})
    job = _sbatch(slurm, "one_node.sbatch", cfg, "-w", "n1", MCIT_GPUS_PER_NODE="2")
    log_file = run_dir / "logs" / "train.jsonl"
    t0 = time.time()
    while not (log_file.is_file() and '"step": 3' in log_file.read_text()):  # task 0 is training
        assert time.time() - t0 < 300 and _job(slurm, job).get("JobState") in ("PENDING", "RUNNING"), _log(slurm, job)
        time.sleep(0.1)
    sig = subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], env=slurm["env"], capture_output=True,
                         text=True)
    assert sig.returncode == 0, sig.stderr
    first = json.loads((run_dir / "eval" / "workers" / "zero_shot.json").read_text())["job"]
    subprocess.run(["scancel", first], env=slurm["env"], check=True)  # the zero-shot row's job, mid-way
    assert _wait(slurm, int(first))["JobState"] == "CANCELLED", _log(slurm, int(first))
    info = _wait(slurm, job, until=("PENDING", "COMPLETED", "FAILED", "CANCELLED"))
    while info.get("Restarts") == "0" and info["JobState"] != "FAILED":
        time.sleep(0.5)
        info = _job(slurm, job)
    assert info["Restarts"] == "1", _log(slurm, job)[-3000:]
    log = _log(slurm, job)
    assert "got a stop signal" in log and "exits with return code = 75" in log and f"requeueing job {job}" in log
    rank0 = "".join(p.read_text() for p in (run_dir / "logs" / "ranks" / f"job{job}_restart0").glob("*rank0*"))
    m = re.search(r"preempted at task (\d+), optimizer step (\d+) \(step checkpoint committed\)", rank0)
    assert m, rank0[-3000:]
    committed = json.loads((run_dir / f"checkpoints/task_{m.group(1)}/steps/committed.json").read_text())
    assert committed["global_step"] == int(m.group(2))
    info = _wait(slurm, job)  # the requeued job starts by itself (after cred_expire, 10 s here)
    assert info["JobState"] == "COMPLETED", _log(slurm, job)[-3000:]
    log = _log(slurm, job)
    assert f"job {job} (restart 1)" in log and "mcit: run finished" in log
    got, want = _metrics(run_dir), _metrics(one_node_run[1])
    assert got["acc_matrix"] == want["acc_matrix"] and got["zero_shot"] == want["zero_shot"]
    # the first-task loss is a float sum whose order follows the ranks and batches (one worker process here, two
    # ranks there): the same up to the last bits (measured: 4.5e-9 apart with batches of 1)
    assert got["first_task_loss"] == pytest.approx(want["first_task_loss"], rel=1e-6)
    events = [json.loads(x) for x in log_file.read_text().splitlines()]
    trained = next(e["time"] for e in events if e.get("stage") == "1/train")
    started = time.mktime(time.strptime(_job(slurm, int(first))["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    assert started <= trained  # the zero-shot row's job ran on n2 while the run trained on n1
    recs = {tag: json.loads((run_dir / "eval" / "workers" / f"{tag}.json").read_text())
            for tag in ("zero_shot", "after_task_0", "after_task_1")}
    for tag, rec in recs.items():
        assert _job(slurm, int(rec["job"])).get("NodeList") == "n2", rec
        assert rec["attempt"] == (2 if tag == "zero_shot" else 1), rec  # started again once, by the requeued job
    assert len({rec["job"] for rec in recs.values()}) == 1 and rec["job"] != first  # one job followed the commits
    print(f"\n== job {job}: USR1 at task {m.group(1)} step {m.group(2)}, Restarts={info['Restarts']}, "
          f"acc_matrix {_metrics(run_dir)['acc_matrix']}\n" + "\n".join(
              line for line in log.splitlines() if line.startswith("mcit:") or "return code" in line))


def test_evaluate_under_srun_on_two_nodes_reproduces_the_rows(slurm, one_node_run):
    """pipelines/evaluate.py started by ``srun -N2 -n2`` directly (ranks from SLURM_PROCID): the
    one-node run's rows, answered again (--recompute: not the run's own cells) on two nodes."""
    _, run_dir, _ = one_node_run
    r = subprocess.run(["srun", "-N", "2", "-n", "2", sys.executable, str(ROOT / "pipelines" / "evaluate.py"),
                        "--run", str(run_dir), "--task-checkpoint", "all", "--recompute"], cwd=ROOT, env=slurm["env"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "evaluated on 2 process(es)" in r.stdout
    rows = [json.loads((run_dir / "eval" / "evaluate" / f"after_task_{k}.json").read_text()) for k in range(2)]
    assert [row["acc"] for row in rows] == _metrics(run_dir)["acc_matrix"] and rows[0]["world_size"] == 2


def test_sweep_runs_as_a_job_array_and_resubmits_only_unfinished_points(slurm, assets, tmp_path_factory):
    """L2P x 2 seeds x 2 class orders as one array job (``%2`` throttle) of pipelines/slurm/sweep_array.sbatch
    (two methods, one group each, are covered by the local sweep in test_sweep_launch.py); the table equals
    the mean / std recomputed from the runs; one point's run is then removed and the same command submits
    an array of exactly that point."""
    from conftest import check_aggregate_against_runs, sweep_spec

    tmp = tmp_path_factory.mktemp("slurm_sweep")
    spec = sweep_spec(assets, tmp, configs=[str(tmp / "l2p.yaml")])
    cmd = [sys.executable, "-m", "pipelines.sweep", "--spec", str(spec), "--launch", "slurm", "--throttle", "2",
           "--wait"]
    # each array task starts its point with torchrun (the scripts' other launcher; the deepspeed one is
    # covered above and by the local sweep): one interpreter fewer per point on these 2 cores
    env = {**slurm["env"], "MCIT_GPUS_PER_NODE": "1", "MCIT_LAUNCHER": "torchrun"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = tmp / "sweep"
    logs = "".join(p.read_text() for p in sorted((out / "logs").glob("slurm-*.out")))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:] + logs[-3000:]
    job = re.search(r"submitted array job (\d+) \(4 points, --array=0-3%2\)", r.stdout)
    assert job, r.stdout
    arrays = sorted(out.glob("logs/slurm-*_*.out"))
    assert len(arrays) == 4 and all("mcit: run finished" in p.read_text() for p in arrays)
    assert f"array task {job.group(1)}_3:" in logs and "launcher torchrun" in logs
    agg = check_aggregate_against_runs(out, 4)
    assert [(g["n"], g["seeds"], g["orders"]) for g in agg["groups"]] == [(4, [0, 1], ["0", "1"])]
    # re-submission: only the point whose run is gone
    shutil.rmtree(out / "runs" / "l2p__s1_o1")
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert re.search(r"submitted array job \d+ \(1 points, --array=0-0%2\); 3 already finished", again.stdout)
    check_aggregate_against_runs(out, 4)
    print("\n" + (out / "aggregate.md").read_text())


