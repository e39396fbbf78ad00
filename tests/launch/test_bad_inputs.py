"""Bad input, table-driven, through the real entry points (pipelines/run_task_sequence.py, pipelines/evaluate.py,
the data_prep converters): each case exits non-zero with at most two stderr lines, no traceback, the culprit
(file, key, sample, argument) named, and the finished and the unfinished run directories byte-identical
afterwards. Most cases stop in pre-flight and run in this process through the entry point's ``main(argv)``;
the few that are found only once a process group exists (a backbone whose weights do not load, a shard whose
bytes changed but not its size, a sample missing a member) are launched as processes."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import launch, run_main, snapshot, tiny_config


@dataclass
class Bad:
    entry: str  # run_task_sequence | evaluate | data_prep.<converter>
    args: list[str]
    expect: str  # in the error line
    rc: int = 2
    launched: bool = False  # a process (a launcher) rather than main(argv) in this process
    also: list[str] = field(default_factory=list)  # more text the stderr must hold
    absent: Path | None = None  # a run directory the case must not create
    within_s: float | None = None  # must stop this fast (no network retries)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("bad")


@pytest.fixture(scope="module")
def finished(assets, work):
    """A finished 2-task run (one process) and a copy with its last stage undone (resumable: inputs get checked)."""
    cfg = tiny_config(assets, work, "done", data={"tasks": ["task0", "task1"]}, train={"epochs": 1})
    res = launch(["--config", str(cfg)], launcher="python")
    assert res.returncode == 0, res.stderr[-3000:]
    done = work / "runs" / "done"
    open_dir = work / "runs" / "open"
    shutil.copytree(done, open_dir)
    state = json.loads((open_dir / "state.json").read_text())
    state["finished"] = False
    state["completed"].remove("1/commit")
    (open_dir / "state.json").write_text(json.dumps(state))
    (open_dir / "config.yaml").write_text((open_dir / "config.yaml").read_text().replace(str(done), str(open_dir)))
    return cfg, done, open_dir


def _shards(assets, work, case) -> Path:
    out = work / f"shards_{case}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(assets["shards"], out)
    return out


def _text_file(work: Path, name: str, text: str) -> Path:
    p = work / name
    p.write_text(text)
    return p


def _config_variant(cfg: Path, work: Path, name: str, edit) -> Path:
    """``cfg`` loaded, changed by ``edit(dict)``, written as ``work/name``."""
    import yaml

    d = yaml.safe_load(cfg.read_text())
    edit(d)
    out = work / name
    out.write_text(yaml.safe_dump(d))
    return out


def build_case(case: str, assets, work: Path, cfg: Path, done: Path, open_dir: Path) -> Bad:
    over = [f"run_dir={open_dir}"]
    run = lambda args, expect, **kw: Bad("run_task_sequence", ["--config", str(cfg), *over, *args], expect, **kw)  # noqa: E731
    ev = lambda args, expect, **kw: Bad("evaluate", args, expect, **kw)  # noqa: E731
    # -- configs: types, ranges, choices, cross-field, unknown keys, duplicates, the file itself -------------
    if case == "unknown_key":
        return run(["train.learning_rate=0.1"], "train.learning_rate: unknown key")
    if case == "misspelt_section":
        return run(["trian.epochs=1"], "trian: unknown key")
    if case == "type_epochs":
        return run(["train.epochs=two"], "train.epochs: Input should be a valid integer")
    if case == "range_epochs":
        return run(["train.epochs=0"], "train.epochs: Input should be greater than or equal to 1")
    if case == "range_lr":
        return run(["train.lr=-1"], "train.lr: Input should be greater than 0")
    if case == "choice_optimizer":
        return run(["train.optimizer=rmsprop"], "train.optimizer: Input should be 'adam', 'adamw' or 'sgd'")
    if case == "unknown_method":
        return run(["method.name=no_such_method"], "unknown method 'no_such_method'")
    if case == "unknown_method_key":
        return run(["method.pool_szie=5"], "method.pool_szie: unknown key")
    if case == "l2p_top_k":
        return run(["method.top_k=20"], "method: top_k (20) exceeds pool_size (10)")
    if case == "dualprompt_layer":
        return run(["method.name=dualprompt", "method.e_layers=[0,5]", "method.g_layers=[1]"],
                   "method.e_layers: block 5 is outside the backbone's 2 blocks (0..1)")
    if case == "coda_pool":
        return run(["method.name=coda_prompt", "method.layers=[0,1]", "method.pool_size=7"],
                   "method.pool_size (7) must divide evenly over the 2 tasks")
    if case == "repeated_layers":
        return run(["method.name=coda_prompt", "method.layers=[1,1]"], "method.layers: block indices repeat: [1, 1]")
    if case == "unknown_transform":
        return run(["data.train_transform=crops"], "data.train_transform: unknown preset 'crops'", also=["l2p", "coda"])
    if case == "unknown_tracker":
        return run(["log.report_to=[wandb,comet]"], "log.report_to: unknown tracker 'comet'",
                   also=["known: tensorboard, wandb, mlflow, all, none"])
    if case == "negative_workers":
        return run(["data.num_workers=-1"], "data.num_workers: Input should be greater than or equal to 0")
    if case == "empty_tasks":
        return run(["data.tasks=[]"], "data.tasks: the task sequence is empty")
    if case == "unknown_task":
        return run(["data.tasks=[task0,task9]"], "data.tasks: no task 'task9' under data.root",
                   also=["task0, task1, task2"])
    if case == "backbone_kind":
        return run(["backbone.kind=resnet"], "backbone.kind: unknown backbone 'resnet'")
    if case == "duplicate_key":
        text = cfg.read_text()
        dup = _text_file(work, "duplicate.yaml", text.replace("train:\n", "train:\n  epochs: 5\n", 1))
        first = text[:text.index("train:\n")].count("\n") + 2
        return Bad("run_task_sequence", ["--config", str(dup), *over], f"(first given at line {first})",
                   also=["duplicate key 'epochs' at line", str(dup)])
    if case == "config_missing":
        return Bad("run_task_sequence", ["--config", str(work / "no_such.yaml")], str(work / "no_such.yaml"))
    if case == "config_not_yaml":
        bad = _text_file(work, "broken.yaml", "train: {epochs: [1,\n")
        return Bad("run_task_sequence", ["--config", str(bad)], str(bad), also=["not valid YAML"])
    if case == "config_a_list":
        bad = _text_file(work, "list.yaml", "- 1\n- 2\n")
        return Bad("run_task_sequence", ["--config", str(bad)], str(bad), also=["the top level must be a mapping"])
    if case == "config_missing_section":
        bad = _config_variant(cfg, work, "no_data.yaml", lambda d: d.pop("data"))
        return Bad("run_task_sequence", ["--config", str(bad), *over], "data: required key is missing", also=[str(bad)])
    # -- overrides -----------------------------------------------------------------------------------------
    if case == "override_without_equals":
        return run(["train.epochs"], "override 'train.epochs': expected key.path=value")
    if case == "override_bad_value":
        return run(["train.epochs=[1,"], "override 'train.epochs=[1,': value is not valid YAML")
    if case == "override_into_a_value":
        return run(["train.lr.value=1"], "'lr' is not a section")
    # -- several configs in one launch: every one checked before any trains ----------------------------------
    if case == "second_config_bad":  # the resumable run is first: it must stay as it is
        resumable = _config_variant(cfg, work, "open.yaml", lambda d: d.update(run_dir=str(open_dir)))
        bad = _text_file(work, "second_broken.yaml", "train: {epochs: [1,\n")
        return Bad("run_task_sequence", ["--config", str(resumable), "--config", str(bad)], str(bad),
                   also=["not valid YAML"])
    if case == "two_configs_one_run_dir":
        return Bad("run_task_sequence", ["--config", str(cfg), "--config", str(cfg), *over],
                   f"its run directory {open_dir} is also {cfg}'s")
    if case == "run_dir_flag_with_two_configs":
        return Bad("run_task_sequence", ["--config", str(cfg), "--config", str(cfg), "--run-dir", str(work / "x")],
                   "--run-dir names one run directory; 2 configs were given", absent=work / "x")
    # -- DeepSpeed JSONs -------------------------------------------------------------------------------------
    if case == "deepspeed_stage_7":
        ds = _text_file(work, "ds_stage7.json", json.dumps({"zero_optimization": {"stage": 7}}))
        return run([f"train.deepspeed_config={ds}"], f"train.deepspeed_config: {ds}: DeepSpeedZeroConfig stage")
    if case == "deepspeed_missing":
        return run([f"train.deepspeed_config={work / 'no_such_ds.json'}"], str(work / "no_such_ds.json"))
    if case == "deepspeed_not_json":
        ds = _text_file(work, "ds_broken.json", '{"zero_optimization": {"stage": 2')
        return run([f"train.deepspeed_config={ds}"], f"{ds} is not valid JSON")
    if case == "deepspeed_batch_conflict":
        ds = _text_file(work, "ds_batch.json", json.dumps({"train_batch_size": 7, "zero_optimization": {"stage": 2}}))
        return run([f"train.deepspeed_config={ds}"], f"{ds} sets train_batch_size 7")
    # -- run directories -----------------------------------------------------------------------------------
    if case == "run_dir_is_a_file":
        f = _text_file(work, "a_file", "not a run")
        return Bad("run_task_sequence", ["--config", str(cfg), f"run_dir={f}"],
                   f"run_dir {f} exists and is not a directory")
    if case == "run_dir_under_a_file":
        f = _text_file(work, "a_file2", "not a run")
        return Bad("run_task_sequence", ["--config", str(cfg), f"run_dir={f / 'sub'}"], str(f))
    if case == "run_dir_other_config":
        return Bad("run_task_sequence", ["--config", str(cfg), f"run_dir={done}", "train.lr=0.5"],
                   "holds a run with a different config", also=[str(done)])
    if case == "run_dir_broken_state":
        broken = work / "runs" / "broken_state"
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(open_dir, broken)
        (broken / "state.json").write_text('{"completed": [')
        return Bad("run_task_sequence", ["--config", str(cfg), f"run_dir={broken}"], str(broken / "state.json"))
    # -- shards and manifests ----------------------------------------------------------------------------------
    shards = _shards(assets, work, case)
    data = [f"data.root={shards}"]
    if case == "missing_shard":
        (shards / "task1" / "train" / "shard-000001.tar").unlink()
        return run(data, "missing shard: " + str(shards / "task1" / "train" / "shard-000001.tar"))
    if case == "truncated_shard":
        f = shards / "task1" / "test" / "shard-000000.tar"
        f.write_bytes(f.read_bytes()[:2048])
        return run(data, f"shard {f} has 2048 bytes")
    if case == "corrupted_shard_sha256":
        f = shards / "task1" / "test" / "shard-000000.tar"
        b = bytearray(f.read_bytes())
        b[1000] ^= 0xFF
        f.write_bytes(bytes(b))
        return run([*data, "data.verify=sha256"], str(f), also=["sha256"])
    if case == "pipe_without_placeholder":
        return run([f"data.root=pipe:cat {shards}/task0/train/manifest.json"], "needs {} where the file's name goes",
                   also=["pipe:cat"])
    if case == "pipe_command_fails":
        (shards / "task1" / "test" / "manifest.json").unlink()
        return run([f"data.root=pipe:cat {shards}/{{}}"],
                   f"missing manifest: cannot read pipe:cat {shards}/task1/test/manifest.json: the command exited")
    if case == "unreachable_http_root":
        return run(["data.root=http://127.0.0.1:9/shards"], "cannot read http://127.0.0.1:9/shards/task0/train/manifest"
                   ".json: curl exit 7: cannot connect to the server")
    if case == "missing_manifest":
        (shards / "task0" / "test" / "manifest.json").unlink()
        return run(data, str(shards / "task0" / "test"))
    if case == "broken_manifest":
        m = shards / "task0" / "train" / "manifest.json"
        m.write_text(m.read_text()[:50])
        return run(data, str(m))
    if case == "manifest_without_shards":
        m = shards / "task0" / "train" / "manifest.json"
        d = json.loads(m.read_text())
        d.pop("shards")
        m.write_text(json.dumps(d))
        return run(data, str(m), also=["shards"])
    if case == "manifest_count_mismatch":
        m = shards / "task0" / "train" / "manifest.json"
        d = json.loads(m.read_text())
        d["num_samples"] += 1
        m.write_text(json.dumps(d))
        return run(data, str(m), also=["num_samples"])
    if case == "missing_data_root":
        return run([f"data.root={work / 'no_such_shards'}"],
                   f"data.root: directory not found: {work / 'no_such_shards'}")
    if case == "corrupted_shard_same_size":  # only reading finds it: a fresh run, launched
        f = shards / "task0" / "train" / "shard-000000.tar"
        b = bytearray(f.read_bytes())
        b[100:140] = b"\xff" * 40  # inside the first member's tar header: not a tar any more
        f.write_bytes(bytes(b))
        return Bad("run_task_sequence", ["--config", str(cfg), f"run_dir={work / 'runs' / 'fresh_corrupt'}", *data],
                   str(f), rc=1, launched=True)
    if case == "sample_missing_member":  # a sample with an image and no label: found when decoded
        _drop_member(shards / "task0" / "train" / "shard-000000.tar", ".cls")
        return Bad("run_task_sequence", ["--config", str(cfg), f"run_dir={work / 'runs' / 'fresh_member'}", *data],
                   "shard-000000.tar", rc=1, launched=True)
    if case == "sample_label_of_another_task":  # task0's first .cls says task1's class: found when decoded
        other = json.loads((shards / "task1" / "train" / "manifest.json").read_text())["label_space"][0]
        _drop_member(shards / "task0" / "train" / "shard-000000.tar", ".cls", str(other).encode())
        return Bad("run_task_sequence", ["--config", str(cfg), f"run_dir={work / 'runs' / 'fresh_label'}", *data],
                   f"label {other} is not one of its task's", rc=1, launched=True, also=["shard-000000.tar"])
    # -- backbones -----------------------------------------------------------------------------------------
    backbone = work / f"backbone_{case}"
    shutil.rmtree(backbone, ignore_errors=True)
    shutil.copytree(assets["backbone"], backbone)
    if case == "missing_backbone":
        return run([f"backbone.path={work / 'no_such_backbone'}"],
                   f"backbone path not found: {work / 'no_such_backbone'}")
    if case == "backbone_without_config":
        (backbone / "config.json").unlink()
        return run([f"backbone.path={backbone}"], str(backbone))
    if case == "backbone_broken_config":
        (backbone / "config.json").write_text("{")
        return run([f"backbone.path={backbone}"], str(backbone))
    if case == "backbone_path_typo":  # an MLLM kind, where a missing path used to be taken for a hub id: 144 s of
        # retries, exit 1 and a run directory left behind
        fresh = work / "runs" / "fresh_typo"
        return Bad("run_task_sequence", ["--config", str(cfg), f"run_dir={fresh}", "backbone.kind=llava",
                                         "backbone.path=backbones/tiny_lava", "data.train_transform=backbone",
                                         "data.eval_transform=backbone"],
                   "backbone path not found: backbones/tiny_lava (relative to", also=["backbone.hub: true"],
                   absent=fresh, within_s=30)
    if case == "backbone_of_another_family":  # a CLIP directory given to kind llava: named, not a transformers error
        conf = json.loads((backbone / "config.json").read_text())
        (backbone / "config.json").write_text(json.dumps({**conf, "model_type": "clip"}))
        fresh = work / "runs" / "fresh_family"
        return Bad("run_task_sequence", ["--config", str(cfg), f"run_dir={fresh}", "backbone.kind=llava",
                                         f"backbone.path={backbone}", "data.train_transform=backbone",
                                         "data.eval_transform=backbone"],
                   f"backbone path {backbone} holds a 'clip' checkpoint (config.json model_type), but backbone.kind "
                   f"llava loads 'llava' checkpoints; backbone.kind clip loads this one", absent=fresh)
    if case == "report_of_unfinished_runs_only":  # a glob over runs/ that catches only runs still going
        return Bad("mcit.cli.report", [str(open_dir), str(work / "runs" / "no_such_run")], "no finished run to report",
                   also=[f"{open_dir}: unfinished (state.json ends at stage 1/eval)", "not a run directory"])
    if case == "backbone_broken_weights":  # pre-flight reads the weights' header (strict loading): exit 2, launched
        f = next(backbone.glob("*.safetensors"))
        f.write_bytes(f.read_bytes()[:100])
        return Bad("run_task_sequence", ["--config", str(cfg), f"run_dir={work / 'runs' / 'fresh_weights'}",
                                         f"backbone.path={backbone}"], str(backbone), rc=2, launched=True)
    # -- evaluate.py arguments -----------------------------------------------------------------------------
    if case == "evaluate_not_a_run":
        return ev(["--run", str(work / "no_such_run")], "is not a run directory")
    if case == "evaluate_no_checkpoint":
        return ev(["--run", str(done), "--task-checkpoint", "7"], "no exported checkpoint after task 7")
    if case == "evaluate_bad_checkpoint_arg":
        return ev(["--run", str(done), "--task-checkpoint", "last"], "--task-checkpoint")
    if case == "evaluate_unknown_task":
        return ev(["--run", str(done), "--tasks", "task7"], "unknown task 'task7'")
    if case == "evaluate_write_rows_subset":
        return ev(["--run", str(done), "--tasks", "task0", "--write-rows"], "--write-rows needs every task")
    if case == "evaluate_lmms_unknown_task":  # checked before any model loads or process group starts
        (work / "lmms_none").mkdir(exist_ok=True)
        return ev(["--run", str(done), "--lmms-eval", "no_such_task", "--lmms-include", str(work / "lmms_none")],
                  "--lmms-eval: unknown task 'no_such_task'", also=[str(work / "lmms_none")])
    if case == "evaluate_lmms_dataset_missing":  # a known task whose data is not here: before any model loads
        tasks = work / "lmms_missing"
        tasks.mkdir(exist_ok=True)
        (tasks / "gone.yaml").write_text(
            "task: gone_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
            f"{tasks / 'no_such_docs.json'}\ntest_split: test\noutput_type: generate_until\ndoc_to_text: question\n"
            "doc_to_target: answer\nmetric_list:\n  - metric: exact_match\n")
        return ev(["--run", str(done), "--lmms-eval", "gone_task", "--lmms-include", str(tasks)],
                  "lmms-eval task 'gone_task': its dataset json could not be loaded on this machine",
                  also=["no_such_docs.json", "a local lmms-eval task"])
    if case == "evaluate_batch_size_0":
        return ev(["--run", str(done), "--batch-size", "0"], "--batch-size must be at least 1, got 0")
    # -- raw data-prep files -------------------------------------------------------------------------------
    from raw_formats import cifar_raw

    if case == "cifar_missing_fine_labels":
        raw = cifar_raw(work / "cifar_nolabels", test_without=b"fine_labels")
        return Bad("data_prep.cifar100", ["--raw", str(raw), "--out", str(work / "out_c1"), "--classes-per-task", "3",
                                          "--no-progress"], f"{raw / 'test'}: unknown format (no 'fine_labels' entry)")
    if case == "cifar_missing_raw":
        return Bad("data_prep.cifar100", ["--raw", str(work / "no_cifar"), "--out", str(work / "out_c2"),
                                          "--no-progress"], str(work / "no_cifar"))
    if case == "cifar_not_a_pickle":
        raw = cifar_raw(work / "cifar_garbage")
        (raw / "train").write_bytes(b"this is not a pickle")
        return Bad("data_prep.cifar100", ["--raw", str(raw), "--out", str(work / "out_c3"), "--classes-per-task", "3",
                                          "--no-progress"], str(raw / "train"))
    if case == "llava_json_outside_images":
        images = work / "images"
        images.mkdir(exist_ok=True)
        rec = [{"id": "evil", "image": "../secret.png",
                "conversations": [{"from": "human", "value": "<image>\nq"}, {"from": "gpt", "value": "a"}]}]
        js = _text_file(work, "evil.json", json.dumps(rec))
        return Bad("data_prep.llava_json", ["--json", str(js), "--images", str(images), "--out", str(work / "out_l1"),
                                            "--no-progress"], "image path '../secret.png' leads outside --images",
                   also=["'evil'"])
    if case == "llava_json_not_json":
        js = _text_file(work, "broken_instr.json", '[{"id": 1,')
        return Bad("data_prep.llava_json", ["--json", str(js), "--images", str(work), "--out", str(work / "out_l2"),
                                            "--no-progress"], str(js))
    raise ValueError(case)


def _drop_member(tar_path: Path, ext: str, replace: bytes | None = None) -> None:
    """Rewrite a shard without the first sample's ``ext`` member, or with ``replace`` as its bytes, and update
    the manifest's size and sha256 to match (so only decoding can find it)."""
    import tarfile

    members = []
    with tarfile.open(tar_path) as tf:
        dropped = False
        for m in tf.getmembers():
            data = tf.extractfile(m).read()
            if not dropped and m.name.endswith(ext):
                dropped = True
                if replace is None:
                    continue
                m.size, data = len(replace), replace
            members.append((m, data))
    import io

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for m, data in members:
            tf.addfile(m, io.BytesIO(data))
    tar_path.write_bytes(buf.getvalue())
    manifest = tar_path.parent / "manifest.json"
    d = json.loads(manifest.read_text())
    for s in d["shards"]:
        if s["file"] == tar_path.name:
            s["bytes"] = len(buf.getvalue())
            s["sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()
    manifest.write_text(json.dumps(d))  # the sample without a label still counts: found when decoded


CASES = [
    "second_config_bad", "two_configs_one_run_dir", "run_dir_flag_with_two_configs",
    "unknown_key", "misspelt_section", "type_epochs", "range_epochs", "range_lr", "choice_optimizer", "unknown_method",
    "unknown_method_key", "l2p_top_k", "dualprompt_layer", "coda_pool", "repeated_layers", "empty_tasks",
    "unknown_transform", "negative_workers", "unknown_tracker",
    "unknown_task", "backbone_kind", "duplicate_key", "config_missing", "config_not_yaml", "config_a_list",
    "config_missing_section", "override_without_equals", "override_bad_value", "override_into_a_value",
    "deepspeed_stage_7", "deepspeed_missing", "deepspeed_not_json", "deepspeed_batch_conflict", "run_dir_is_a_file",
    "run_dir_under_a_file", "run_dir_other_config", "run_dir_broken_state", "missing_shard", "truncated_shard",
    "corrupted_shard_sha256", "pipe_without_placeholder", "pipe_command_fails", "unreachable_http_root",
    "missing_manifest", "broken_manifest", "manifest_without_shards",
    "manifest_count_mismatch", "missing_data_root", "corrupted_shard_same_size", "sample_missing_member",
    "sample_label_of_another_task",
    "missing_backbone", "backbone_without_config", "backbone_broken_config", "backbone_broken_weights",
    "backbone_path_typo", "backbone_of_another_family", "report_of_unfinished_runs_only",
    "evaluate_not_a_run", "evaluate_no_checkpoint", "evaluate_bad_checkpoint_arg", "evaluate_unknown_task",
    "evaluate_write_rows_subset", "evaluate_batch_size_0", "evaluate_lmms_unknown_task",
    "evaluate_lmms_dataset_missing", "cifar_missing_fine_labels",
    "cifar_missing_raw",
    "cifar_not_a_pickle", "llava_json_outside_images", "llava_json_not_json",
]


def test_the_table_is_large_enough():
    assert len(CASES) == len(set(CASES)) >= 40


@pytest.mark.parametrize("case", CASES)
def test_bad_input_stops_in_one_line_naming_the_culprit(case, assets, work, finished):
    cfg, done, open_dir = finished
    bad = build_case(case, assets, work, cfg, done, open_dir)
    before = snapshot(done), snapshot(open_dir)
    t0 = time.monotonic()
    if bad.launched:
        res = launch(bad.args, launcher="python")
    else:
        res = run_main(bad.args, entry=bad.entry)
    took = time.monotonic() - t0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    shown = "\n".join(lines[-20:])
    assert res.returncode == bad.rc, f"exit {res.returncode}\n{shown}"
    assert "Traceback" not in res.stderr, shown
    errors = [ln for ln in lines if ln.startswith("error")]
    assert len(errors) == 1 and bad.expect in errors[0], shown
    assert len(lines) <= 2, shown
    for text in bad.also:
        assert text in res.stderr, shown
    assert (snapshot(done), snapshot(open_dir)) == before
    assert bad.absent is None or not bad.absent.exists(), f"{bad.absent} was created"
    assert bad.within_s is None or took < bad.within_s, f"took {took:.0f} s"
    print(f"CASE {case} (exit {res.returncode}): {errors[0]}")  # `pytest -rP ... | grep CASE`: the note's list
