"""Typed, validated run configuration.

A run is described by one YAML file plus dotted command-line overrides (``train.lr=0.01``). Every
section forbids unknown keys, and every error becomes one line that names the file and the key path,
raised before any process group, model or file in the run directory is touched.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration problem; ``str()`` is a single line meant for the user."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BackboneConfig(_Strict):
    """The frozen pre-trained model. ``path`` is a local directory in HF format (``config.json``), or, with
    ``hub: true``, a hub id (``org/name``) that transformers downloads (the machine needs network)."""

    kind: str = Field("vit", description="a registered backbone kind (mcit.models: vit, clip, and the multimodal "
                                         "LLM families llava, instructblip, qwen2_vl, qwen2_5_vl, qwen3_vl, internvl, "
                                         "llava_onevision; or one a module registers before the run)")
    path: str = Field(
        description="a local HF-format directory (config.json), a zoo checkpoint file (with a zoo tag), or a hub id "
                    "with hub: true")
    tag: str = Field("local", description="a backbone zoo tag (mcit.models.zoo: `path` may then be the original "
                                          "checkpoint file, converted once and checked), or a free-form name for "
                                          "an HF directory; recorded with the checkpoint's sha256")
    cache_dir: str = Field("data/backbones/converted", description="where converted zoo checkpoints are kept")
    hub: bool = Field(False, description="let backbone.path (and a method's auxiliary backbones) be a model-hub id "
                                         "that transformers downloads at run time; off, every path must be a local "
                                         "directory and a missing one stops pre-flight")
    tokenizer: str | None = Field(None, description="CLIP from an OpenAI file: a directory with its tokenizer files")
    quantization: Literal["none", "4bit", "8bit"] = Field(
        "none", description="load the frozen backbone in 4-bit (nf4) or 8-bit through bitsandbytes")
    max_length: int = Field(2048, ge=8, description="longest tokenised sample allowed (llava)")
    chat_format: Literal["auto", "processor", "vicuna_v1"] = Field(
        "auto", description="multimodal LLMs: how a conversation becomes tokens (mcit.models.chat): vicuna_v1 is "
                            "LLaVA-1.5's own conversation (system prompt, USER:/ASSISTANT:, </s>), processor the "
                            "checkpoint's chat template; auto: vicuna_v1 for LLaVA-1.5 tags, else processor")

    @model_validator(mode="after")
    def _chat_format(self) -> "BackboneConfig":
        if self.chat_format == "auto":  # LLaVA-1.5 tags (the zoo's llava_v1.5_7b, llava-1.5-7b, ...)
            self.chat_format = "vicuna_v1" if re.search(r"llava[-_]?v?1\.5", self.tag.lower()) else "processor"
        return self

    @field_validator("kind")
    @classmethod
    def _registered(cls, v: str) -> str:
        from mcit.core.registry import BACKBONES

        try:
            BACKBONES.get(v)
        except KeyError as e:
            raise ValueError(str(e.args[0])) from None
        return v

    @property
    def task_type(self) -> str:
        """``classification`` (image classifiers: CIL) or ``generation`` (multimodal LLMs: MCIT)."""
        from mcit.core.registry import BACKBONES

        return BACKBONES.get(self.kind).task_type


class TaskSpec(_Strict):
    """One task of the sequence: a train and a test split, each a directory with manifest.json."""

    name: str = Field(description="the task's name in tables, rows and answer files")
    train: str = Field(description="its training split: a shard directory with manifest.json (data_prep/)")
    test: str = Field(description="its test split: a shard directory with manifest.json")
    scorer: str | None = Field(None, description="instruction tasks: overrides the manifest's scorer")
    epochs: int | None = Field(None, ge=1, description="this task's training epochs (default: train.epochs); "
                                                       "MLLM-DCL's official scripts give each domain its own")
    max_new_tokens: int | None = Field(None, ge=1, description="this task's generation cap (default: "
                                                               "eval.max_new_tokens); MLLM-ACL's scripts give "
                                                               "each ability its own")


class DataConfig(_Strict):
    """The task sequence as data: an ordered list of tasks (names under ``root`` or explicit specs)."""

    root: str | None = Field(None,
        description="a benchmark directory (benchmark.json, one <task>/train and <task>/test each); tasks given by "
                    "name are found here")
    tasks: list[str | TaskSpec] = Field(
        description="the sequence, in order: task names under root, or specs with their own splits (below)")
    verify: Literal["size", "sha256"] = Field(
        "size", description="startup check of every shard against its manifest: size (fast) or sha256"
    )
    split: Literal["auto", "shard", "sample"] = Field(
        "auto", description="how a split is divided over ranks: whole shards, or every W-th sample"
    )
    shuffle_buffer: int = Field(1000, ge=1,
        description="samples held to shuffle the training stream (webdataset-style buffer; the order is seeded and the "
                    "same on every resume)")
    num_workers: int = Field(
        2, ge=0, description="loader worker processes per rank that decode, augment and collate (0: in the training "
                             "process); the batches are the same for any number")
    worker_nice: int = Field(
        0, ge=0, le=19, description="niceness of the loader workers (0: the rank's own priority): on a CPU the rank "
                                    "keeps busy, its threads come first and the workers fill what they leave "
                                    "(bench/eval_throughput.py, 2 cores: pipeline / bare generate 0.67 with 0, "
                                    "0.69-0.71 with 10, 0.74 with 19; the train stage unchanged). Off by default: on "
                                    "a node shared with other jobs, niced workers can starve")
    worker_timeout_s: float = Field(
        600.0, gt=0, description="a loader worker that delivers no batch for this long stops the run with an error "
                                 "naming the split (a worker stuck on storage, or deadlocked at its start) instead "
                                 "of a silent hang; raise it for remote shards that take longer to fetch")
    train_transform: str = Field(
        "backbone", description="preset of the training images' pipeline, normalisation included "
                                "(mcit.data.transforms.PRESETS; the README's methods table names each method's): "
                                "backbone (the default: the backbone's own inference pipeline, no augmentation), l2p, "
                                "hide_cifar, coda, coda_imagenet, vpt_nsp2_cifar, vpt_nsp2_imagenet, "
                                "vpt_nsp2_clip_cifar, vpt_nsp2_clip_imagenet, clip, star_cifar, "
                                "star_cifar_imagenet_norm, star_imagenet_r")
    normalization: Literal["preset", "backbone"] = Field(
        "preset", description="preset: the presets' own mean / std (the official code's, e.g. [0, 1] inputs in the "
                              "l2p family); backbone: the presets' resize, crop and augmentation with the backbone's "
                              "own mean / std (a backbone pre-trained on other inputs than the paper's)")
    eval_transform: str = Field("backbone", description="the preset whose evaluation pipeline test images go through; "
                                                        "its normalisation must be the training preset's")
    reference: str | None = Field(
        None, description="a split of the backbone's pre-training data (for methods that need a pre-trained subspace)")
    schedule: Literal["sequential", "joint"] = Field(
        "sequential", description="sequential: the tasks one after another (continual learning); joint: one training "
                                  "stage on every task's training data together, then one evaluation of every task "
                                  "(the multi-task upper bound: an accuracy matrix of one row, no forgetting or "
                                  "forward transfer)")
    replay: int = Field(
        0, ge=0, description="a replay buffer: this many samples of each earlier task's training split (the first in "
                             "an order seeded by `seed`, by key, the same on every rank and after a resume; kept in "
                             "the run directory's replay.json) are trained on again with every later task; 0: none")
    validation: float = Field(
        0.0, ge=0.0, lt=1.0, description="carve this fraction of each task's training split (by a hash of each "
                                          "sample's key) as its validation split: training uses the rest and every "
                                          "evaluation runs on the validation parts instead of the test splits, so a "
                                          "sweep selects settings without seeing the test split; 0: off")

    @field_validator("tasks")
    @classmethod
    def _non_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("the task sequence is empty")
        return v

    @model_validator(mode="after")
    def _replay_is_sequential(self) -> "DataConfig":
        if self.replay and self.schedule == "joint":
            raise ValueError("data.replay: the joint schedule already trains on every task's data; set replay: 0")
        return self

    def resolved_tasks(self, base: Path) -> list[TaskSpec]:
        """Task specs with local paths made absolute (relative paths are relative to ``base``); URLs and
        ``pipe:`` locations as given (a bare task name under a remote root is joined to it, unchecked here:
        pre-flight reads its manifest)."""
        from mcit.core.locations import absolute, is_remote, join

        out: list[TaskSpec] = []
        for item in self.tasks:
            if isinstance(item, str):
                if self.root is None:
                    raise ConfigError(f"data.tasks: task {item!r} is a bare name but data.root is not set")
                if is_remote(self.root):
                    out.append(TaskSpec(name=item, train=join(self.root, item, "train"),
                                        test=join(self.root, item, "test")))
                    continue
                root = Path(self.root) if Path(self.root).is_absolute() else base / self.root
                if not root.is_dir():
                    raise ConfigError(f"data.root: directory not found: {root}")
                if not (root / item).is_dir():
                    have = sorted(p.name for p in root.iterdir() if (p / "train").is_dir())
                    raise ConfigError(f"data.tasks: no task {item!r} under data.root {root} "
                                      f"(it has: {', '.join(have) or 'none'})")
                spec = TaskSpec(name=item, train=str(root / item / "train"), test=str(root / item / "test"))
            else:
                spec = item
            spec = TaskSpec(name=spec.name, scorer=spec.scorer, train=absolute(spec.train, base),
                            test=absolute(spec.test, base))
            out.append(spec)
        names = [t.name for t in out]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"data.tasks: duplicate task name(s) {sorted(dup)}")
        return out


class TrainConfig(_Strict):
    epochs: int = Field(1, ge=1, description="epochs per task (a task spec's own epochs win)")
    batch_size: int = Field(16, ge=1, description="micro batch per rank")
    grad_accum: int = Field(1, ge=1, description="micro batches per optimizer step")
    lm_loss_mean: Literal["token", "sample"] = Field(
        "token", description="an MLLM's answer-token cross-entropy: token = the sum over every answer token of "
                             "the accumulation window on every rank divided by their number (LLaVA's objective, "
                             "whatever the world size: transformers' average_tokens_across_devices); sample = each "
                             "sample's token mean, averaged over samples")
    lr: float = Field(1e-3, gt=0, description="learning rate (the schedule below restarts every task)")
    optimizer: Literal["adam", "adamw", "sgd"] = Field("adam", description="torch's optimizer, through DeepSpeed")
    weight_decay: float = Field(0.0, ge=0, description="the optimizer's weight decay")
    momentum: float = Field(0.9, ge=0, description="sgd's momentum")
    grad_clip: float = Field(0.0, ge=0, description="0 disables clipping")
    lr_schedule: Literal["constant", "cosine", "multistep", "warmup_cosine", "warmup_log"] = Field(
        "constant", description="learning-rate schedule within each task (restarts every task). constant, cosine, "
                                "multistep: per epoch, as the CIL papers' timm schedulers. Per optimizer step, as "
                                "the LLaVA trainer: warmup_cosine is transformers' get_cosine_schedule_with_warmup "
                                "(--lr_scheduler_type cosine --warmup_ratio); warmup_log is DeepSpeed's WarmupLR "
                                "(log warmup, then constant: a DeepSpeed config whose scheduler block is WarmupLR)")
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="warmup_cosine / warmup_log: warmup over "
                                                               "ceil(warmup_ratio x the task's optimizer steps), as "
                                                               "transformers' TrainingArguments.get_warmup_steps")
    lr_min: float = Field(0.0, ge=0, description="cosine: the floor every parameter group decays to (timm's "
                                                   "min_lr: 1e-5 in the HiDe-Prompt / NoRGa code bases)")
    lr_milestones: list[int] = Field(default_factory=list, description="multistep: epochs where lr *= lr_decay")
    lr_decay: float = Field(0.1, gt=0, le=1, description="multistep: the factor at each milestone")
    checkpoint_every: int = Field(50, ge=1, description="optimizer steps between step checkpoints")
    log_every: int = Field(10, ge=1,
        description="optimizer steps between training records (logs/train.jsonl and the trackers; a task's last step "
                    "always)")
    deepspeed_config: str = Field("deepspeed_configs/zero2.json",
        description="the DeepSpeed JSON (ZeRO stage, offload, precision); its batch sizes are set from this config")
    precision: Literal["fp32", "bf16"] = Field("fp32",
        description="bf16: DeepSpeed's bf16 training and the frozen backbone in bfloat16; fp32: float32 throughout")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="a NaN / inf loss (agreed by all ranks before the backward) or global gradient norm: "
                            "stop (exit 1, the last committed checkpoint kept) or skip the micro-batch (loss only)")
    max_nonfinite_steps: int = Field(10, ge=0, description="skip: stop once more micro-batches than this were skipped "
                                                           "in one task")
    progress: bool = Field(True, description="tqdm progress bars on rank 0")
    collective_timeout_s: float = Field(
        1800.0, gt=0, description="a collective that does not complete within this (a dead or stuck rank) ends the "
                                  "run with an error naming the stage")

    @model_validator(mode="after")
    def _warmup_needs_a_step_schedule(self) -> "TrainConfig":
        if self.warmup_ratio and not self.lr_schedule.startswith("warmup_"):
            raise ValueError(f"train.warmup_ratio ({self.warmup_ratio}) is read by lr_schedule warmup_cosine or "
                             f"warmup_log only (lr_schedule is {self.lr_schedule})")
        return self


class JudgeConfig(_Strict):
    """The local model that judge-based scorers ask (mcit.core.judge: MLLM-ACL Math's answer extraction)."""

    path: str | None = Field(None, description="a transformers causal-LM directory (MLLM-CL asks gpt-4o-mini)")
    max_new_tokens: int = Field(128, ge=1, description="the judge's reply cap (128 as MLLM-CL's build_judge)")
    batch_size: int = Field(8, ge=1, description="questions the judge answers at once")


class EvalSlurmConfig(_Strict):
    """The resources of a deferred run's evaluation jobs (``eval.workers: slurm``): one job per row."""

    nodes: int = Field(1, ge=1, description="--nodes of each job")
    gpus_per_node: int = Field(0, ge=0, description="--gres=gpu:N for each job (0: none asked for)")
    time: str | None = Field(None, description="--time of each job (default: the partition's)")
    partition: str | None = Field(None, description="--partition of each job (default: the cluster's)")
    sbatch_args: list[str] = Field(default_factory=list, description="more sbatch options, as given "
                                                                     "(e.g. [--account=x, --qos=y, -w, node2])")


class EvalConfig(_Strict):
    """The evaluation of every task after every task (mcit.run.evaluation; evaluation cells: mcit.run.cells)."""

    batch_size: int = Field(64, ge=1, description="test samples per forward / generate call on each rank (answers "
                                                  "do not depend on it: inference is per sample)")
    schedule: Literal["inline", "deferred"] = Field(
        "inline", description="inline: each row is evaluated in the run's own eval stage before the next task trains; "
                              "deferred: the commit of each task hands its row to an evaluation worker and training "
                              "goes on at once (mcit.run.deferred); the run ends when every row is in, with the rows, "
                              "metrics and report of an inline run")
    workers: Literal["local", "slurm"] = Field(
        "local", description="deferred: where a row's worker runs: a process on this machine (on eval.devices), or "
                             "one Slurm job per row (eval.slurm)")
    devices: str | None = Field(None, description="deferred, local workers: CUDA_VISIBLE_DEVICES of the workers (the "
                                                  "devices kept for evaluation; the run's launcher gets the others)")
    worker_nproc: int = Field(1, ge=1, description="deferred: ranks of each evaluation worker")
    worker_follow: bool = Field(
        True, description="deferred: a worker goes on with the rows committed after its own while the run's launch "
                          "lives (one start and one model load for all of them; a Slurm worker's eval.slurm.time must "
                          "then cover the run), and the run starts another only when none is alive; false: one "
                          "worker per row")
    worker_attempts: int = Field(3, ge=1, description="deferred: starts of a row's worker per launch before the run "
                                                      "stops naming the worker's log")
    poll_s: float = Field(2.0, gt=0, description="deferred: seconds between two looks at the workers' rows")
    slurm: EvalSlurmConfig = Field(default_factory=EvalSlurmConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    zero_shot: bool = Field(True, description="evaluate the untrained method first (the forward-transfer baseline)")
    max_new_tokens: int = Field(16, ge=1, description="generation cap for instruction tasks")
    mask_unseen_classes: bool = Field(
        True, description="class-incremental protocol: after task t only classes of tasks 0..t can be predicted "
                          "(tasks not yet seen then score 0); false = every class of the sequence competes")
    first_task_loss: bool = Field(
        True, description="after each task, also the method's training loss on the first task's test data "
                          "(the training-interference curve; one extra forward pass over that split)")
    chunk_size: int = Field(
        256, ge=1, description="samples each rank answers between two commits of its answers to the evaluation "
                               "cell (mcit.run.cells): a killed or preempted evaluation loses at most this many per "
                               "rank and the next pass generates only the rest")
    cells: str | None = Field(
        None, description="the directory of evaluation cells (answers keyed by method state, backbone, test split "
                          "and generation settings, computed once and reused by every evaluating path); relative to "
                          "the run directory; default <run_dir>/eval/cells. A sweep gives its runs one, so equal "
                          "cells (e.g. the zero-shot rows) are answered once")
    reuse: bool = Field(True, description="reuse complete cells and committed chunks; false answers every sample "
                                          "again (an existing complete cell is left as it is)")


class MethodConfig(BaseModel):
    """``name`` picks a registered method; every other key is validated by that method's Params."""

    model_config = ConfigDict(extra="allow")
    name: str

    @model_validator(mode="after")
    def _check_params(self) -> "MethodConfig":
        from mcit.core.registry import METHODS

        try:
            cls = METHODS.get(self.name)
        except KeyError as e:
            raise ValueError(str(e.args[0])) from None
        try:
            cls.Params.model_validate(self.model_extra or {})
        except ValidationError as err:
            ie = err.errors()[0]
            loc = ".".join(str(p) for p in ie["loc"])
            msg = "unknown key" if ie["type"] == "extra_forbidden" else ie["msg"].removeprefix("Value error, ")
            raise ValueError(f"@{loc}@ {msg}") from None
        return self

    def params(self) -> BaseModel:
        from mcit.core.registry import METHODS

        return METHODS.get(self.name).Params.model_validate(self.model_extra or {})


TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # log.report_to: its module


def tracker_installed(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(TRACKERS[name]) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules: not importable
        return False


class LogConfig(_Strict):
    """Where rank 0 reports besides logs/train.jsonl (mcit.run.trackers)."""

    report_to: list[str] | str = Field(
        "none", validate_default=True,
        description="experiment trackers, transformers' names and meaning: a list of tensorboard, wandb, mlflow; all "
                    "(every one installed); none. The config, training scalars, each committed row and the final "
                    "metrics; a resumed run continues the same tracker run")
    project: str = Field("mcit", description="W&B project / MLflow experiment (WANDB_PROJECT / "
                                             "MLFLOW_EXPERIMENT_NAME win where set)")
    html_report: bool = Field(True, description="write report.html when the run finishes (mcit.run.html_report); "
                                                "off, `mcit-report --html RUN` writes it later")

    @field_validator("report_to")
    @classmethod
    def _trackers(cls, v: list[str] | str) -> list[str]:
        """The trackers as a list: all = the installed ones; one that is named and not installed is an error here,
        before any work (pip install 'mcit[trackers]')."""
        names = [v] if isinstance(v, str) else list(v)
        if names in (["none"], []):
            return []
        if names == ["all"]:
            return [n for n in TRACKERS if tracker_installed(n)]
        for n in names:
            if n not in TRACKERS:
                raise ValueError(f"unknown tracker {n!r} (known: {', '.join(TRACKERS)}, all, none)")
            if not tracker_installed(n):
                raise ValueError(f"{n} is not installed (pip install {TRACKERS[n]}, or pip install 'mcit[trackers]')")
        return list(dict.fromkeys(names))


class RunConfig(_Strict):
    name: str = Field(description="the run's name: runs/<name>/ unless run_dir is given, and its label in tables")
    run_dir: str | None = Field(None, description="where the run writes (a resumed run: the same directory)")
    seed: int = Field(0, description="seeds the method's initialisation, the data order and the augmentation draws")
    backbone: BackboneConfig
    data: DataConfig
    method: MethodConfig
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()
    meta: dict[str, Any] = Field(
        default_factory=dict, description="labels recorded with the run and copied into metrics.json (a sweep "
                                          "puts its setting, seed and task order here); no effect on training")

    def task_epochs(self, task: int) -> int:
        """Training epochs of task ``task`` (its own ``epochs`` where the task spec gives one)."""
        spec = self.data.tasks[task]
        own = None if isinstance(spec, str) else spec.epochs
        return own or self.train.epochs

    def task_max_new_tokens(self, task: int) -> int:
        """Generation cap of task ``task`` (its own ``max_new_tokens`` where the task spec gives one)."""
        spec = self.data.tasks[task]
        own = None if isinstance(spec, str) else spec.max_new_tokens
        return own or self.eval.max_new_tokens

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name

    def with_absolute_paths(self, base: Path) -> "RunConfig":
        """The config with its input paths made absolute against ``base`` (the directory the run was launched
        from), so the copy kept in the run directory reads the same data and checkpoints from any working
        directory and after the run directory is moved. data.root, data.reference, the tasks' train / test
        and backbone.cache_dir always; backbone.path, backbone.tokenizer and train.deepspeed_config only where
        that path exists under ``base`` (else they stay as given: a hub id, or a DeepSpeed JSON of the
        repository's deepspeed_configs/), and so a method's fields marked ``input_path`` (STAR-Prompt's
        method.clip_path). run_dir is left as given: it names where this launch writes."""
        c = self.model_copy(deep=True)

        from mcit.core.locations import is_remote

        def absolute(p: str | None, only_existing: bool = False) -> str | None:
            if p is None or is_remote(p) or Path(p).is_absolute() or (only_existing and not (base / p).exists()):
                return p
            return str((base / p).resolve())

        c.data.root = absolute(c.data.root)
        c.data.reference = absolute(c.data.reference)
        c.data.tasks = [t if isinstance(t, str) else
                        t.model_copy(update={"train": absolute(t.train), "test": absolute(t.test)})
                        for t in c.data.tasks]
        c.backbone.path = absolute(c.backbone.path, only_existing=True)
        c.backbone.tokenizer = absolute(c.backbone.tokenizer, only_existing=True)
        c.backbone.cache_dir = absolute(c.backbone.cache_dir)
        c.train.deepspeed_config = absolute(c.train.deepspeed_config, only_existing=True)
        c.eval.judge.path = absolute(c.eval.judge.path, only_existing=True)
        # a method's own input paths (STAR-Prompt's CLIP): its Params fields marked json_schema_extra input_path
        from mcit.core.registry import METHODS

        extra = c.method.model_extra or {}
        for key, f in METHODS.get(c.method.name).Params.model_fields.items():
            if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("input_path") \
                    and isinstance(extra.get(key), str):
                extra[key] = absolute(extra[key], only_existing=True)
        return c


# --------------------------------------------------------------------------------------------------
# Loading

class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} at line {line} (first given at line {seen[key]})",
                    key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that rejects duplicate keys (yaml.YAMLError naming the key and both lines)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass


def yaml_problem(e: yaml.YAMLError) -> str:
    """The first line of a YAML error, the duplicate-key message kept whole."""
    problem = getattr(e, "problem", None)
    if problem and problem.startswith("duplicate key"):
        return problem
    return str(e).splitlines()[0]


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.path=value")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key path")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e.__class__.__name__})") from None
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = nxt
        node[path[-1]] = value
    return out


def _format_error(source: str, err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-after"))
    # pydantic puts the discriminating type name in loc for unions; drop the noise.
    loc = loc.replace(".str", "").replace(".TaskSpec", "")
    msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
    if e["type"] == "missing":
        msg = "required key is missing"
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"config error in {source}: {loc or '<root>'}: {msg}{more}"


def read_yaml_mapping(path: str | Path, what: str = "config") -> dict[str, Any]:
    """The one YAML reader for the project's files (run configs, sweep specs, a run directory's config): the
    file exists, parses without duplicate keys, and its top level is a mapping (an empty file is ``{}``);
    otherwise one ConfigError that names ``what`` and the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} file not found: {path}")
    try:
        data = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} error in {path}: not valid YAML ({yaml_problem(e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} error in {path}: the top level must be a mapping")
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read, override and validate a config. Raises ConfigError with a one-line message."""
    path = Path(path)
    source = str(path)
    data = read_yaml_mapping(path, "config")
    data.setdefault("name", path.stem)
    data = apply_overrides(data, overrides or [])
    return validate_config(data, source).with_absolute_paths(Path.cwd())


def validate_config(data: dict, source: str = "<config>") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        # MethodConfig's validator encodes the method Params' own key path as "@path@ message".
        m = re.search(r"@(.*?)@ (.*)", e.get("msg", ""))
        if e["loc"] and e["loc"][0] == "method" and m:
            key = f"method.{m.group(1)}" if m.group(1) else "method"
            raise ConfigError(f"config error in {source}: {key}: {m.group(2)}") from None
        raise ConfigError(_format_error(source, err)) from None


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what the run directory keeps)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
