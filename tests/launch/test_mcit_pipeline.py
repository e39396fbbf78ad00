"""The MCIT pipeline launched on 2 ranks: ZeRO-3, resume, LoRA rebuilds (projection under every ZeRO stage:
test_zero_projection.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from conftest import EVALUATE, FAULTY, ROOT, free_port, launch, launcher_cmd, mcit_config, run_env

from mcit.core import scorers as S

# -- the pipeline ------------------------------------------------------------------------------------------
# Fwd-Prompt with prompts of 4 tokens at lr 0.1: its 3 steps on the count task move enough answers for the lmms-eval
# comparison below to tell the two states apart (with 2-token prompts at lr 0.05 none of the 24 moved)
Z3 = {"train": {"deepspeed_config": "deepspeed_configs/zero3.json", "lr": 0.1},
      "method": {"name": "fwd_prompt", "pool_size": 4, "top_n": 2, "prompt_length": 4}}


@pytest.fixture(scope="module")
def z3_run(mcit_assets, tmp_path_factory):
    """An uninterrupted 2-rank ZeRO-3 run of the 2-task tiny-LLaVA sequence."""
    tmp = tmp_path_factory.mktemp("mcit_z3")
    cfg = mcit_config(mcit_assets, tmp, "z3", **Z3, log={"html_report": True})
    r = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    (tmp / "console.txt").write_text(r.stdout + r.stderr)
    return tmp


def test_the_console_shows_the_run_and_the_libraries_talk_to_the_rank_logs(z3_run):
    """No library warning, log record or build message on the console (the launcher's own lines aside:
    `make demo` silences those with --log_level=error); they are in logs/rank<r>.log."""
    lines = [ln for ln in (z3_run / "console.txt").read_text().replace("\r", "\n").splitlines() if ln.strip()]
    ours = [ln for ln in lines if not re.match(r"\[[-0-9: ,]+\] \[(INFO|WARNING)\] \[(launch|runner)\.py", ln)]
    noisy = [ln for ln in ours
             if re.search(r"Warning|warn\(|built successfully|Failed to load|Loading weights|^\s+\w+\(", ln)]
    assert not noisy, noisy
    assert any("task 1 (count) committed" in ln for ln in ours)
    logs = {r: (z3_run / "runs" / "z3" / "logs" / f"rank{r}.log").read_text() for r in (0, 1)}
    for text in logs.values():
        assert "built successfully" in text  # DeepSpeed's CPU communication op, printed at start-up on every rank


def test_two_process_zero3_sequence_of_the_tiny_llava(z3_run):
    run = z3_run / "runs" / "z3"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["complete"] and len(metrics["acc_matrix"]) == 2 and metrics["zero_shot"] is not None
    for tag in ("zero_shot", "after_task_0", "after_task_1"):
        rows = [json.loads(x) for x in (run / "eval" / "answers" / tag / "0.jsonl").read_text().splitlines()]
        assert len(rows) == 24 and {"prediction", "score", "answers"} <= set(rows[0])
        # the saved answers rescore to the reported accuracy without the model
        acc = 100 * sum(S.exact_match(x["prediction"], {"answer": x["answers"][0], "answers": x["answers"]})
                        for x in rows) / len(rows)
        row = metrics["zero_shot"] if tag == "zero_shot" else metrics["acc_matrix"][int(tag[-1])]
        assert acc == pytest.approx(row[0])
    events = [json.loads(x) for x in (run / "logs" / "train.jsonl").read_text().splitlines()]
    subs = [e for e in events if e.get("event") == "subspace"]
    assert [e["task"] for e in subs] == [-1, 0, 1]
    for e in subs:  # the broadcast bases are bit-identical on both ranks
        assert len(e["state_sha256_per_rank"]) == 2 and len(set(e["state_sha256_per_rank"])) == 1
    assert subs[-1]["task_rank"] >= subs[-2]["task_rank"] > 0 and subs[0]["pretrained_rank"] > 0
    # an evaluation-only pass of the ZeRO-3 run's exports on 1 process at another batch size, answering again
    # (--recompute), regenerates the same answers; without it, the run's own cells are reused (nothing generated)
    r = launch(["--run", str(run), "--task-checkpoint", "1", "--batch-size", "5", "--recompute"], entry=EVALUATE)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads((run / "eval" / "evaluate" / "after_task_1.json").read_text())
    assert row["acc"] == metrics["acc_matrix"][1] and [c["computed"] for c in row["cells"]] == [24, 24]
    for i in range(2):
        assert (run / "eval" / "evaluate" / "answers" / "after_task_1" / f"{i}.jsonl").read_text() == \
            (run / "eval" / "answers" / "after_task_1" / f"{i}.jsonl").read_text()
    # re-evaluating every row of the finished run answers nothing: each cell is the run's own (the zero-shot row
    # through the state the run kept for it); another generation cap is another key, so every cell is answered again
    t0 = time.time()
    r = launch(["--run", str(run), "--task-checkpoint", "all", "--zero-shot"], entry=EVALUATE)
    took = time.time() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    for tag in ("zero_shot", "after_task_0", "after_task_1"):
        row = json.loads((run / "eval" / "evaluate" / f"{tag}.json").read_text())
        own = json.loads((run / "eval" / f"{tag}.json").read_text())
        assert row["acc"] == own["acc"] and [(c["reused"], c["computed"]) for c in row["cells"]] == [(24, 0)] * 2
        assert [c["digest"] for c in row["cells"]] == [c["digest"] for c in own["cells"]]
        for i in range(2):
            assert (run / "eval" / "evaluate" / "answers" / tag / f"{i}.jsonl").read_text() == \
                (run / "eval" / "answers" / tag / f"{i}.jsonl").read_text()
    r = launch(["--run", str(run), "--task-checkpoint", "1", "eval.max_new_tokens=4"], entry=EVALUATE)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads((run / "eval" / "evaluate" / "after_task_1.json").read_text())
    own = json.loads((run / "eval" / "after_task_1.json").read_text())
    assert [(c["reused"], c["computed"]) for c in row["cells"]] == [(0, 24)] * 2
    assert not {c["digest"] for c in row["cells"]} & {c["digest"] for c in own["cells"]}
    print(f"\n== re-evaluating the finished run's 3 rows (6 cells, all reused) took {took:.1f} s in one process")


def test_killed_mcit_run_resumes_to_identical_answers(mcit_assets, z3_run):
    """Every rank killed after step 3 of task 1 under ZeRO-3 (checkpoint_every=2): the re-run resumes
    from step 2. That re-run is killed (SIGKILL, each rank) in the middle of the last row's first test split, right
    after committing its first chunk of answers (4 samples); the next one answers only the samples no chunk holds
    and ends with the uninterrupted run's rows and answers. The three launches report to W&B (offline), MLflow (a
    local file store) and TensorBoard: one tracker run each, every training step once with the training log's
    numbers, each row and the final metrics of metrics.json."""
    cfg = mcit_config(mcit_assets, z3_run, "killed", method=Z3["method"], train={**Z3["train"], "log_every": 1},
                      eval={"chunk_size": 4}, log={"report_to": ["tensorboard", "wandb", "mlflow"]})
    store = (z3_run / "mlruns").as_uri()
    trackers = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": store, "MLFLOW_ALLOW_FILE_STORE": "true"}
    r = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2, entry=FAULTY, MCIT_TEST_FAULT="1:3",
               **trackers)
    assert r.returncode != 0
    killed = z3_run / "runs" / "killed"
    state = json.loads((killed / "state.json").read_text())
    assert ("reference" in state["completed"] and "0/commit" in state["completed"]
            and "1/train" not in state["completed"])
    assert json.loads((killed / "checkpoints/task_1/steps/committed.json").read_text())["global_step"] == 2
    r = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2, entry=FAULTY, MCIT_TEST_EVAL_KILL="2:0:1",
               **trackers)
    assert r.returncode != 0
    state = json.loads((killed / "state.json").read_text())
    assert "1/subspace" in state["completed"] and "1/eval" not in state["completed"]
    chunks = list((killed / "eval" / "cells").rglob("chunks/*.jsonl"))
    held = {json.loads(x)["key"] for f in chunks for x in f.read_text().splitlines()}
    assert len(chunks) in (1, 2) and len(held) == 4 * len(chunks)  # one chunk of 4 per rank that got there
    r = launch(["--config", str(cfg)], launcher="deepspeed", nproc=2, **trackers)
    assert r.returncode == 0, r.stderr[-3000:]
    cells = json.loads((killed / "eval" / "after_task_1.json").read_text())["cells"]
    assert [(c["reused"], c["computed"]) for c in cells] == [(len(held), 24 - len(held)), (0, 24)]
    assert not list((killed / "eval" / "cells").rglob("chunks"))
    got = json.loads((killed / "metrics.json").read_text())
    want = json.loads((z3_run / "runs" / "z3" / "metrics.json").read_text())
    assert got["acc_matrix"] == want["acc_matrix"] and got["zero_shot"] == want["zero_shot"]
    for task in ("0", "1"):
        a = (killed / "eval" / "answers" / "after_task_1" / f"{task}.jsonl").read_text()
        assert a == (z3_run / "runs" / "z3" / "eval" / "answers" / "after_task_1" / f"{task}.jsonl").read_text()
    _trackers_hold_the_logs(killed, got, store)
    assert not (killed / "report.html").exists()  # log.html_report: false (the suite's configs), the page is not drawn


def _trackers_hold_the_logs(run, metrics: dict, store: str) -> None:
    """W&B's offline files, MLflow's file store and TensorBoard's events of a killed and resumed run: one run
    each; each training step once, with the value the training log holds for it (the resumed task's redone
    steps are in the log twice, not in the trackers); each row at the step its task ended; the final metrics."""
    import os

    from trackers_logged import mlflow_series, tensorboard_series, wandb_series

    from mcit.core.metrics import FINAL_METRICS

    logged = [r for r in map(json.loads, (run / "logs" / "train.jsonl").read_text().splitlines()) if "global_step" in r]
    first: dict[int, dict] = {}
    for r in logged:
        first.setdefault(r["global_step"], r)
    assert len(logged) > len(first)  # the resumed task logged the steps after its step checkpoint again
    assert sorted(first) == list(range(1, len(first) + 1))  # the sequence's steps, task after task
    ends = {r["task"]: g for g, r in sorted(first.items())}
    loss = [(g, r["loss"]) for g, r in sorted(first.items())]
    rows = {n: [(0, metrics["zero_shot"][i])] + [(ends[t], metrics["acc_matrix"][t][i]) for t in range(2)]
            for i, n in enumerate(metrics["tasks"])}
    final = {f"final/{k}": [(ends[1], metrics[k])] for k in FINAL_METRICS if metrics.get(k) is not None}
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    w, ids = wandb_series(run / "logs")
    m, runs = mlflow_series(store, "mcit")
    tb = tensorboard_series(run / "logs" / "tb")
    assert len(ids) == 1 and len(runs) == 1
    def same(got: list, want: list) -> bool:  # steps exactly, values to TensorBoard's float32
        return [g for g, _ in got] == [g for g, _ in want] and \
            [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)

    for name, series in (("wandb", w), ("mlflow", m), ("tensorboard", tb)):
        assert same(series["train/loss"], loss), (name, series["train/loss"], loss)
        for n, want in rows.items():
            assert same(series[f"eval/{n}"], want), (name, n, series[f"eval/{n}"], want)
        got = {k: v for k, v in series.items() if k.startswith("final/")}
        assert got.keys() == final.keys() and all(same(got[k], final[k]) for k in final), name


def test_lora_family_rebuilt_between_tasks_trains_from_its_loaded_state(mcit_assets, tmp_path):
    """The pipeline rebuilds the method after every stage and gives each task a new DeepSpeed engine.
    On 2 ranks, a rebuilt LoRA (ZeRO-2), O-LoRA and MoELoRA (ZeRO-3 with every parameter partitioned: O-LoRA
    reads its blocks for the regulariser, which must happen while DeepSpeed has gathered them) must start each
    task's engine from its loaded values, not from bookkeeping an earlier engine left on shared parameter
    objects (which corrupted the gathered fp32 state when the adapters were reused across builds); every task
    trains, and O-LoRA's earlier tasks' pairs stay bit-identical."""
    out = tmp_path / "lora.json"
    zero3 = tmp_path / "zero3.json"
    zero3.write_text(json.dumps({"zero_optimization": {"stage": 3, "overlap_comm": False,
                                                       "stage3_param_persistence_threshold": 0},
                                 "zero_allow_untested_optimizer": True}))
    cmd = [launcher_cmd("torchrun", 2), "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "tests" / "launch" / "workers" / "lora_rebuild.py"), str(mcit_assets["backbone"]),
           str(mcit_assets["shards"]), str(out), "deepspeed_configs/zero2.json", str(zero3)]
    r = subprocess.run(cmd, cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    for name in ("lora", "olora", "moelora"):
        got = res[name]
        assert got["trained"] == [True, True, True] and got["starts_from_loaded"] == [True, True], (name, got)
    # how many earlier-task blocks each task kept bit-identical (-1: one moved): 4 projections x A, B per task
    assert res["olora"]["frozen_kept"] == [0, 8, 16], res["olora"]


def _local_lmms_task(shards, where, task="count"):
    """An lmms-eval task over local files (no hub), ``mcit_<task>``: the task's test questions, their images as PNG
    files (the shard's own bytes), the question without "<image>" (lmms-eval's convention: the model places the
    image), scored by the pipeline's exact_match in the task's own process_results."""
    from mcit.data.instructions import turns
    from mcit.data.shards import iter_samples, open_split

    (where / "images").mkdir(parents=True)
    docs = []
    for s in iter_samples(open_split(shards / task / "test"), 0, 1, policy="sample"):
        rec = json.loads(s["json"])
        q, a = turns(rec["conversations"], s["__key__"])[-1]
        (where / "images" / f"{s['__key__']}.png").write_bytes(s["png"])
        docs.append({"key": s["__key__"], "image": f"images/{s['__key__']}.png",
                     "question": q.replace("<image>\n", ""), "answer": a, "answers": rec.get("answers") or [a]})
    (where / "docs.json").write_text(json.dumps(docs))
    (where / "utils.py").write_text(
        "import os\nfrom PIL import Image\nfrom mcit.core import scorers\n"
        "HERE = os.path.dirname(os.path.abspath(__file__))\n"
        "def doc_to_visual(doc):\n    return [Image.open(os.path.join(HERE, doc['image'])).convert('RGB')]\n"
        "def doc_to_text(doc, lmms_eval_specific_kwargs=None):\n    return doc['question']\n"
        "def process_results(doc, results):\n"
        "    ref = {'answer': doc['answer'], 'answers': doc['answers']}\n"
        "    return {'exact_match': scorers.exact_match(results[0], ref)}\n")
    (where / f"mcit_{task}.yaml").write_text(
        f"task: mcit_{task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: docs.json\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_visual: !function utils.doc_to_visual\n"
        "doc_to_text: !function utils.doc_to_text\ndoc_to_target: answer\n"
        "process_results: !function utils.process_results\n"
        "generation_kwargs:\n  max_new_tokens: 3\n  do_sample: false\n  until: [\"\\n\\n\"]\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 0.1\n")
    return docs


def test_lmms_eval_adapter_answers_as_the_pipeline_s_own_evaluation(z3_run, mcit_assets, tmp_path):
    """``mcit-evaluate --lmms-eval`` on the finished ZeRO-3 run, through lmms-eval's own task machinery over a local
    task holding the count task's test questions: the zero-shot state and the checkpoint after task 1 give, question
    by question, the predictions the run's own evaluation wrote (16.7% and 20.8% right, 5 of 24 answers apart), and
    lmms-eval's aggregate equals the run's row; report.md and metrics.json gain the general-ability rows. A second
    call adds a task to a row (the first kept); a third, asking for both again, reuses both evaluation cells."""
    run = z3_run / "runs" / "z3"
    docs = _local_lmms_task(mcit_assets["shards"], tmp_path / "lmms_tasks" / "mcit_count")
    r = launch(["--run", str(run), "--lmms-eval", "mcit_count", "--lmms-include", str(tmp_path / "lmms_tasks"),
                "--zero-shot", "--task-checkpoint", "1"], entry=EVALUATE)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    answers = {}
    for tag, own_row in (("zero_shot", metrics["zero_shot"]), ("after_task_1", metrics["acc_matrix"][1])):
        own = answers[tag] = {x["key"]: x["prediction"] for x in map(
            json.loads, (run / "eval" / "answers" / tag / "1.jsonl").read_text().splitlines())}
        got = [json.loads(x) for x in (run / "eval" / "general" / f"{tag}.samples.jsonl").read_text().splitlines()]
        assert len(got) == len(docs) == len(own) == 24
        assert {docs[g["doc_id"]]["key"]: g["prediction"] for g in got} == own
        result = json.loads((run / "eval" / "general" / f"{tag}.json").read_text())["results"]["mcit_count"]
        assert 100 * result["exact_match"] == pytest.approx(own_row[1], abs=1e-9)
    # the two states answer apart, so the adapter must load the checkpoint to match: 5 of the 24 answers differ here
    # (accuracies 16.7 and 20.8; equal accuracies would not show that the answers differ, nor different ones how many)
    assert sum(answers["zero_shot"][k] != answers["after_task_1"][k] for k in answers["zero_shot"]) >= 3
    assert metrics["zero_shot"][1] > 0 and metrics["acc_matrix"][1][1] > 0  # 4 and 5 right answers, not none
    assert set(metrics["general_ability"]) == {"zero_shot", "after_task_1"}
    report = (run / "report.md").read_text()
    assert "## General ability (lmms-eval)" in report and "| zero shot |" in report and "| after task 1 |" in report
    # a second call on checkpoint 1 with another task: the row gains it and keeps the first (its results and
    # samples); the zero-shot row is untouched. A third asking for both answers nothing: both cells are reused
    _local_lmms_task(mcit_assets["shards"], tmp_path / "lmms_tasks" / "mcit_colour", task="colour")
    before = (run / "eval" / "general" / "after_task_1.samples.jsonl").read_text().splitlines()
    zero_row = (run / "eval" / "general" / "zero_shot.json").read_text()
    lmms = ["--lmms-include", str(tmp_path / "lmms_tasks"), "--task-checkpoint", "1"]
    r = launch(["--run", str(run), "--lmms-eval", "mcit_colour", *lmms], entry=EVALUATE)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads((run / "eval" / "general" / "after_task_1.json").read_text())
    assert row["tasks"] == ["mcit_count", "mcit_colour"] and set(row["results"]) == {"mcit_count", "mcit_colour"}
    assert 100 * row["results"]["mcit_colour"]["exact_match"] == pytest.approx(metrics["acc_matrix"][1][0], abs=1e-9)
    got = (run / "eval" / "general" / "after_task_1.samples.jsonl").read_text().splitlines()
    assert [x for x in got if json.loads(x)["task"] == "mcit_count"] == before and len(got) == 48
    assert (run / "eval" / "general" / "zero_shot.json").read_text() == zero_row
    r = launch(["--run", str(run), "--lmms-eval", "mcit_count", "mcit_colour", *lmms], entry=EVALUATE)
    assert r.returncode == 0, r.stderr[-3000:]
    again = json.loads((run / "eval" / "general" / "after_task_1.json").read_text())
    assert all(c["reused"] for c in again["cells"].values()) and again["results"] == row["results"]
    assert (run / "eval" / "general" / "after_task_1.samples.jsonl").read_text().splitlines() == got
    assert "mcit_colour exact_match" in (run / "report.md").read_text()


def test_rescore_gives_the_rows_again_without_the_model_and_a_swapped_scorer_s_numbers(z3_run, tmp_path):
    """``mcit-evaluate --rescore`` on a copy of the finished run without its checkpoints (no model state to load)
    writes every row (the run's and the evaluation-only passes'), metrics.json and report.md again, equal to what the
    run wrote; the rows it replaced are kept under eval/rescored/. With ``--config`` giving the count task another
    scorer, the count column becomes that scorer's numbers over the stored answers, the colour column stays. A
    config that changes what was answered, and a run with an answer file missing, are refused in one line before
    anything is written."""
    import shutil

    import yaml

    from mcit.run.cells import row_reference, scorer_version

    run = tmp_path / "z3"
    shutil.copytree(z3_run / "runs" / "z3", run, ignore=shutil.ignore_patterns("checkpoints"))
    rows = {f: json.loads(f.read_text()) for f in [*run.glob("eval/*.json"), *run.glob("eval/evaluate/*.json")]}
    assert len(rows) >= 3
    metrics = json.loads((run / "metrics.json").read_text())
    r = launch(["--rescore", "--run", str(run)], entry=EVALUATE)
    assert r.returncode == 0, r.stderr[-3000:]
    for f, row in rows.items():
        now = json.loads(f.read_text())
        assert now.pop("rescored")["previous"].startswith(str(run / "eval" / "rescored"))
        assert now == {**row, "scorer_versions": [scorer_version("exact_match")] * 2}
    again = json.loads((run / "metrics.json").read_text())
    assert {k: again[k] for k in ("acc_matrix", "zero_shot", "final_avg_acc", "forgetting", "bwt")} == \
        {k: metrics[k] for k in ("acc_matrix", "zero_shot", "final_avg_acc", "forgetting", "bwt")}
    kept = next((run / "eval" / "rescored").iterdir())
    assert json.loads((kept / "metrics.json").read_text()) == metrics

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    root = cfg["data"]["root"]
    cfg["data"]["tasks"] = [{"name": n, "train": f"{root}/{n}/train", "test": f"{root}/{n}/test",
                             **({"scorer": "multiple_choice"} if n == "count" else {})} for n in ("colour", "count")]
    swapped = tmp_path / "swapped.yaml"
    swapped.write_text(yaml.safe_dump(cfg))
    r = launch(["--rescore", "--run", str(run), "--config", str(swapped)], entry=EVALUATE)
    assert r.returncode == 0, r.stderr[-3000:]
    from mcit.core import scorers as S

    moved = 0
    for f, row in rows.items():
        now = json.loads(f.read_text())
        answers = [json.loads(x) for x in (f.parent / "answers" / f.stem / "1.jsonl").read_text().splitlines()]
        want = 100 * sum(S.multiple_choice(a["prediction"], row_reference(a)) for a in answers) / len(answers)
        assert now["acc"][1] == pytest.approx(want, abs=1e-9) and now["acc"][0] == row["acc"][0]
        assert now["scorers"] == ["exact_match", "multiple_choice"]
        assert now["scorer_versions"][1] == scorer_version("multiple_choice")
        moved += now["acc"][1] != row["acc"][1]
    # the swap shows in the numbers: the tiny model's one-word counts are no option letter (every other per-sample
    # scorer that reads these references gives exact_match's numbers on these answers: 4, 5 and 5 of 24 right)
    assert moved >= 2
    assert json.loads((run / "metrics.json").read_text())["acc_matrix"][1][1] != metrics["acc_matrix"][1][1]

    cfg["train"]["lr"] = 0.5
    swapped.write_text(yaml.safe_dump(cfg))
    r = launch(["--rescore", "--run", str(run), "--config", str(swapped)], entry=EVALUATE)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "train.lr differs from the run's own config" in errors[0]

    bare = tmp_path / "bare"
    shutil.copytree(z3_run / "runs" / "z3", bare, ignore=shutil.ignore_patterns("checkpoints"))
    (bare / "eval" / "answers" / "after_task_0" / "1.jsonl").unlink()
    before = (bare / "metrics.json").read_text()
    r = launch(["--rescore", "--run", str(bare)], entry=EVALUATE)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
    assert "no stored answers for task count" in errors[0] and "after_task_0/1.jsonl" in errors[0]
    assert (bare / "metrics.json").read_text() == before and not (bare / "eval" / "rescored").exists()


def test_the_run_s_report_html_opens_offline_in_chromium_with_the_run_s_numbers(z3_run, tmp_path):
    """report.html of the finished run in headless Chromium: no console message, no request beyond the file
    itself, every number its tables show equal to metrics.json, what was forgotten listed from the stored
    answers with each question's image, a screenshot that is not blank. ``mcit-report --html`` writes the same
    page again (a run written before the page existed)."""
    import browser

    assert browser.missing() is None, browser.missing()
    run = z3_run / "runs" / "z3"
    metrics = json.loads((run / "metrics.json").read_text())
    shot = tmp_path / "run_report.png"
    page = browser.open_report(run / "report.html", shot)
    print(f"\n== screenshot of the run's report.html: {shot}")
    assert page["console"] == [] and page["requests"] == []
    shown = {k: float(v) if v else None for row in page["tables"]["metrics"] for k, v in row.items()}
    assert shown and shown == {k: metrics[k] for k in shown}
    assert set(shown) >= {"final_avg_acc", "forgetting", "bwt", "fwd", "mft", "mfn", "maa"}
    acc = {k: v for row in page["tables"]["acc"] for k, v in row.items()}
    assert [float(acc[f"zero_shot.{i}"]) for i in range(2)] == metrics["zero_shot"]
    assert [[float(acc[f"acc_matrix.{t}.{i}"]) for i in range(2)] for t in range(2)] == metrics["acc_matrix"]
    # what was forgotten: task 0's questions whose score fell between after_task_0 and after_task_1, from the answers
    before, after = ({r["key"]: r["score"] for r in map(json.loads, (run / "eval" / "answers" / tag / "0.jsonl")
                                                        .read_text().splitlines())} for tag in ("after_task_0",
                                                                                                "after_task_1"))
    fell = sorted(k for k in before if after[k] < before[k])
    rose = sorted(k for k in before if after[k] > before[k])
    assert f"{len(fell)} forgotten, {len(rose)} recovered" in page["text"]
    html = (run / "report.html").read_text()
    assert html.count('<tr class="sample">') == len(fell) + len(rose)
    assert html.count('<img alt="') == len(fell) + len(rose)  # each with its image, read from the test split
    assert page["colours"] > 100  # text, tables, figures: not a blank page
    before_html = html
    r = subprocess.run([sys.executable, "-m", "mcit.cli.report", "--html", str(run)], capture_output=True, text=True,
                       cwd=z3_run, env=run_env())
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == f"HTML report: {run / 'report.html'}", r.stderr
    assert (run / "report.html").read_text() == before_html
