import pytest
import yaml

from mcit.core.config import ConfigError, apply_overrides, load_config

BASE = {
    "backbone": {"path": "x"},
    "data": {"root": "d", "tasks": ["a", "b"]},
    "method": {"name": "l2p", "pool_size": 4, "top_k": 2},
}


def write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def test_valid_config_defaults_and_name(tmp_path):
    cfg = load_config(write(tmp_path, BASE, "my_run.yaml"))
    assert cfg.name == "my_run"
    assert str(cfg.resolved_run_dir()) == "runs/my_run"
    assert cfg.method.params().pool_size == 4
    assert cfg.train.deepspeed_config.endswith("zero2.json")


def test_dotted_overrides_are_typed(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["train.lr=0.01", "train.epochs=3", "method.top_k=3",
                                               "run_dir=/tmp/somewhere"])
    assert cfg.train.lr == 0.01 and cfg.train.epochs == 3
    assert cfg.method.params().top_k == 3
    assert str(cfg.resolved_run_dir()) == "/tmp/somewhere"


@pytest.mark.parametrize("overrides, fragment", [
    (["train.lrr=0.1"], "train.lrr: unknown key"),
    (["train.lr=abc"], "train.lr: Input should be a valid number"),
    (["train.epochs=0"], "train.epochs: Input should be greater than or equal to 1"),
    (["method.pool_sze=3"], "method.pool_sze: unknown key"),
    (["method.top_k=-1"], "method.top_k: Input should be greater than or equal to 1"),
    (["method.name=nope"], "unknown method 'nope'"),
    (["bogus=1"], "bogus: unknown key"),
    (["train.precision=fp8"], "train.precision: Input should be 'fp32' or 'bf16'"),
])
def test_bad_keys_give_one_line_with_key_path(tmp_path, overrides, fragment):
    path = write(tmp_path, BASE)
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(path) in msg
    assert fragment in msg


def test_missing_required_section(tmp_path):
    data = {k: v for k, v in BASE.items() if k != "backbone"}
    with pytest.raises(ConfigError, match="backbone: required key is missing"):
        load_config(write(tmp_path, data))


def test_bad_yaml_and_missing_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected key.path=value"):
        apply_overrides({}, ["train.lr"])
    with pytest.raises(ConfigError, match="not a section"):
        apply_overrides({"train": 3}, ["train.lr=1"])


def test_every_shipped_config_validates_with_its_method():
    """Every YAML under configs/ (embedded demos and the papers' benchmark configs) parses, and its
    method section validates against the method's own parameter model."""
    from pathlib import Path

    from mcit.studies import spec as S

    repo = Path(__file__).resolve().parents[2]
    paths = sorted((repo / "configs").rglob("*.yaml"))
    assert len(paths) >= 40
    for p in paths:
        if p.parent.name == "sweeps":  # sweep specs: every point they expand to validates
            assert S.expand(S.load_spec(p, {}), base=repo, materialize=False)
            continue
        cfg = load_config(p)
        cfg.method.params()


@pytest.mark.parametrize("schedule, extra, factors", [
    ("constant", {}, [1.0, 1.0, 1.0, 1.0]),
    ("multistep", {"lr_milestones": [1, 3], "lr_decay": 0.5}, [1.0, 0.5, 0.5, 0.25]),
    ("cosine", {}, [1.0, 0.8535533905932737, 0.5, 0.14644660940672627]),
])
def test_lr_schedule_is_per_epoch(tmp_path, schedule, extra, factors):
    from mcit.run.engine import lr_factor

    cfg = load_config(write(tmp_path, {**BASE, "train": {"epochs": 4, "lr_schedule": schedule, **extra}}))
    steps_per_epoch = 3
    got = [lr_factor(cfg, e * steps_per_epoch + 2, steps_per_epoch) for e in range(4)]
    assert got == pytest.approx(factors)


def test_cosine_floor_matches_timm_for_every_parameter_group(tmp_path):
    """lr_min is timm's absolute floor for every group. Reference: timm 0.6.7 CosineLRScheduler(t_initial=4,
    lr_min=1e-5, warmup_t=0, cycle_limit=1), two Adam groups at 0.0028125 and 0.00028125 (HiDe's prompt
    and 0.1 x head lr), step(e) for e = 0..4 (run outside the repository)."""
    from mcit.run.engine import lr_factor

    timm = [[0.0028125, 0.00028125], [0.0024020833771376494, 0.00024152635719842545], [0.00141125, 0.000145625],
            [0.00042041662286235035, 4.972364280157449e-05], [1e-05, 1e-05]]
    cfg = load_config(write(tmp_path, {**BASE, "train": {"epochs": 4, "lr": 0.0028125, "lr_schedule": "cosine",
                                                         "lr_min": 1e-5}}))
    for e, want in enumerate(timm):
        got = [base * lr_factor(cfg, e * 3, 3, base_lr=base) for base in (0.0028125, 0.00028125)]
        assert got == pytest.approx(want, rel=1e-12)


def test_a_run_dir_written_before_a_new_config_key_still_resumes(tmp_path):
    """RunDir.check_belongs_to compares validated configs: a config.yaml that lacks keys added to the schema
    since (they take their defaults) belongs to the same run; a changed value does not."""
    from mcit.core.config import dump_config
    from mcit.core.rundir import RunDir, RunDirError

    cfg = load_config(write(tmp_path, BASE, "r.yaml"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    old = yaml.safe_load(dump_config(cfg))
    del old["meta"], old["eval"]["first_task_loss"]  # as written by an older version
    (run_dir / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    RunDir(run_dir).check_belongs_to(cfg)
    old["train"]["lr"] = 0.5
    (run_dir / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    with pytest.raises(RunDirError, match="holds a run with a different config"):
        RunDir(run_dir).check_belongs_to(cfg)


def test_what_the_project_writes_before_the_config_never_makes_a_run_dir_foreign(tmp_path):
    """A start killed before the config is written leaves the Slurm scripts' logs and hostfiles, the run lock, a
    stop request or a half-written config: the same command starts there. Anything else is refused, named."""
    from mcit.core.rundir import RunDir, RunDirError

    cfg = load_config(write(tmp_path, BASE, "r.yaml"))
    run_dir = tmp_path / "run"
    (run_dir / "logs" / "ranks" / "job7_restart0").mkdir(parents=True)
    (run_dir / "logs" / "hostfile.7").write_text("n1 slots=1\n")
    for name in ("PREEMPT", "run.lock", ".config.yaml.tmp4242"):
        (run_dir / name).write_text("")
    RunDir(run_dir).check_belongs_to(cfg)
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match=r"holds notes.txt and no config.yaml"):
        RunDir(run_dir).check_belongs_to(cfg)


def test_input_paths_are_kept_absolute_method_paths_included(tmp_path, monkeypatch):
    """Relative input paths are relative to the launch directory and stored absolute (the run directory's
    config.yaml then reads the same files from anywhere); STAR-Prompt's method.clip_path too when it exists
    there; a hub-style id that does not exist stays as given; run_dir stays as given."""
    (tmp_path / "ckpt" / "clip").mkdir(parents=True)
    (tmp_path / "bb").mkdir()
    monkeypatch.chdir(tmp_path)
    data = {"backbone": {"path": "bb"}, "data": {"root": "d", "tasks": ["a"]}, "run_dir": "runs/x",
            "method": {"name": "star_prompt", "clip_path": "ckpt/clip"}}
    cfg = load_config(write(tmp_path, data))
    assert cfg.method.params().clip_path == str(tmp_path / "ckpt" / "clip")
    assert cfg.backbone.path == str(tmp_path / "bb") and cfg.data.root == str(tmp_path / "d")
    assert cfg.run_dir == "runs/x"
    data["method"]["clip_path"] = "openai/clip-vit-large-patch14"
    assert load_config(write(tmp_path, data)).method.params().clip_path == "openai/clip-vit-large-patch14"


@pytest.mark.parametrize("name,cls", [("adam", "Adam"), ("adamw", "AdamW"), ("sgd", "SGD")])
def test_the_optimizer_takes_the_configured_lr_decay_and_momentum(tmp_path, name, cls):
    """train.optimizer / lr / weight_decay / momentum reach the torch optimizer (values unlike torch's
    defaults, so a dropped argument shows)."""
    import torch

    from mcit.run.engine import make_optimizer

    train = {"optimizer": name, "lr": 0.0123, "weight_decay": 0.034, "momentum": 0.55}
    cfg = load_config(write(tmp_path, {**BASE, "train": train}))
    opt = make_optimizer(cfg, [torch.nn.Parameter(torch.zeros(2))])
    g = opt.param_groups[0]
    assert type(opt).__name__ == cls and g["lr"] == 0.0123 and g["weight_decay"] == 0.034
    if name == "sgd":
        assert g["momentum"] == 0.55


def test_log_report_to_takes_transformers_names_and_refuses_a_tracker_that_is_not_installed(tmp_path, monkeypatch):
    """log.report_to as transformers reads it: a list, all (the installed ones), none; a named tracker that cannot be
    imported stops the config in one line naming the key and the package (the test machine has all three:
    ``make install-test``; one is made unimportable here as Python marks a missing module)."""
    import sys

    def report_to(value):
        return load_config(write(tmp_path, {**BASE, "log": {"report_to": value}})).log.report_to

    assert report_to("none") == [] and load_config(write(tmp_path, BASE)).log.report_to == []
    assert report_to("all") == ["tensorboard", "wandb", "mlflow"]
    assert report_to(["mlflow", "wandb"]) == ["mlflow", "wandb"]
    monkeypatch.setitem(sys.modules, "mlflow", None)
    assert report_to("all") == ["tensorboard", "wandb"]
    with pytest.raises(ConfigError, match=r"log.report_to: mlflow is not installed \(pip install mlflow, or pip "
                                          r"install 'mcit\[trackers\]'\)"):
        report_to(["wandb", "mlflow"])
