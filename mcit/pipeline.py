"""The staged task-sequence loop with resume.

Stages, in order: ``zero_shot`` (evaluate the untrained method: the forward-transfer baseline), then
for each task t: ``t/train`` -> ``t/subspace`` -> ``t/eval`` -> ``t/commit``. Every stage is
collective (all ranks enter it), rank 0 alone writes files, and ``state.json`` (written last, by
rename) is the commit point: a re-run of the same command skips every stage it lists and loads the
method state the last stage left in ``checkpoints/current.safetensors``. The train stage also keeps
DeepSpeed step checkpoints, so a run killed mid-task resumes from its last step.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcit import distributed as dist
from mcit import metrics as M
from mcit import preemption
from mcit.checkpoint import load_state, read_json, save_state, write_json
from mcit.config import ConfigError, RunConfig, dump_config
from mcit.data.shards import Split, open_split
from mcit.engine import JsonlLogger, TaskTrainer, build_ds_config, resolve_ds_config_path
from mcit.evaluation import evaluate_tasks
from mcit.methods.base import Method, TaskSequence
from mcit.registry import METHODS

STAGES = ("train", "subspace", "eval", "commit")
STATE = "state.json"


class RunDirError(ValueError):
    """The run directory belongs to a different run; one line."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a dead or stuck rank); names the stage."""


def _is_collective_failure(e: BaseException) -> bool:
    if isinstance(e, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "timed out", "connection closed", "connection reset",
                                   "broken pipe", "socket"))


@dataclass
class Plan:
    """Everything checked before any process group or model exists."""

    cfg: RunConfig
    run_dir: Path
    names: list[str]
    train: list[Split]
    test: list[Split]
    sequence: TaskSequence
    scorers: list[str] | None = None  # instruction tasks: the scorer of each task
    reference: Split | None = None  # data.reference, when the method needs it
    backbone_dir: str = ""  # the transformers directory loaded (a converted zoo checkpoint or backbone.path)
    backbone_record: dict[str, Any] | None = None  # tag, format, source, sha256 (mcit.models.zoo.resolve)


def preflight(cfg: RunConfig, base: Path | None = None, *, run_dir: Path | None = None) -> Plan:
    """Validate every input the run will read: DeepSpeed JSON, backbone directory, every shard.

    Raises a one-line error (ConfigError / DataError / BackboneError) naming the file or key. With
    ``run_dir`` (evaluation of an existing run) the run directory is taken as given, not checked.
    """
    from mcit.config import CLASSIFICATION_KINDS
    from mcit.models.clip import check_clip_dir
    from mcit.models.mllm import check_model_source
    from mcit.models.vit import check_checkpoint_dir

    base = base or Path.cwd()
    ds_path = resolve_ds_config_path(cfg.train.deepspeed_config)
    if not ds_path.is_file():
        raise ConfigError(f"train.deepspeed_config: file not found: {cfg.train.deepspeed_config}")
    try:
        build_ds_config(cfg, 1)
    except json.JSONDecodeError as e:
        raise ConfigError(f"train.deepspeed_config: {ds_path} is not valid JSON ({e})") from None
    generative = cfg.backbone.kind not in CLASSIFICATION_KINDS
    bb = cfg.backbone
    if generative and not Path(bb.path).exists():  # a hub id (machines with network): nothing to hash
        backbone_dir, record = bb.path, {"tag": bb.tag, "format": "hub", "source": bb.path, "sha256": None,
                                         "loaded_from": bb.path}
    else:
        from mcit.models.zoo import resolve

        path, record = resolve(bb.kind, bb.tag, bb.path, bb.cache_dir, bb.tokenizer)
        backbone_dir = str(path)
    if generative:
        check_model_source(backbone_dir)
    elif bb.kind == "clip":
        check_clip_dir(backbone_dir)
    else:
        check_checkpoint_dir(backbone_dir)
    specs = cfg.data.resolved_tasks(base)
    train = [open_split(s.train, cfg.data.verify) for s in specs]
    test = [open_split(s.test, cfg.data.verify) for s in specs]
    for s, split in [(s, sp) for s, tr, te in zip(specs, train, test) for sp in (tr, te)]:
        is_instr = split.manifest.get("kind") == "instruction"
        if is_instr != generative:
            raise ConfigError(f"data.tasks: task {s.name!r}: {split.directory} holds "
                              f"{'instruction' if is_instr else 'classification'} samples, but backbone.kind "
                              f"{cfg.backbone.kind} needs {'instruction' if generative else 'classification'} data")
    scorers = None
    if generative:
        from mcit import scorers as S

        scorers = [s.scorer or te.manifest.get("scorer") or "exact_match" for s, te in zip(specs, test)]
        for s, name in zip(specs, scorers):
            if name not in S.SCORERS:
                raise ConfigError(f"data.tasks: task {s.name!r}: unknown scorer {name!r}; known: {', '.join(sorted(S.SCORERS))}")
    reference = None
    method_cls = METHODS.get(cfg.method.name)
    try:
        method_cls.check_inputs(cfg.method.params())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if method_cls.reference_required(cfg.method.params()):
        if cfg.data.reference is None:
            raise ConfigError(f"data.reference: method {cfg.method.name} needs a split of the backbone's pre-training "
                              f"data for its pre-trained subspace (set data.reference)")
        ref = Path(cfg.data.reference)
        reference = open_split(ref if ref.is_absolute() else (base / ref).resolve(), cfg.data.verify)
    for s, tr, te in zip(specs, train, test):
        extra = set(te.label_space) - set(tr.label_space)
        if extra:
            raise ConfigError(f"data.tasks: task {s.name!r}: test labels {sorted(extra)} do not occur in its train split")
    names = [s.name for s in specs]
    class_names = {int(k): v for tr in train for k, v in (tr.manifest.get("class_names") or {}).items()}
    sequence = TaskSequence.from_label_spaces(names, [tr.label_space for tr in train], class_names)
    if run_dir is None:  # a training run: its directory must be new or hold this exact config
        run_dir = cfg.resolved_run_dir()
        check_run_dir(cfg, run_dir)
    recorded = run_dir / "backbone.json"
    started = json.loads(recorded.read_text()).get("sha256") if recorded.is_file() else None
    if started and record.get("sha256") and started != record["sha256"]:
        raise RunDirError(f"backbone checkpoint {bb.path} is not the one run {run_dir} started with (sha256 "
                          f"{started} in {recorded}, now {record['sha256']})")
    return Plan(cfg, run_dir, names, train, test, sequence, scorers, reference, backbone_dir, record)


def check_run_dir(cfg: RunConfig, run_dir: Path) -> None:
    """Refuse to mix two runs: an existing run directory must hold this exact resolved config."""
    existing = run_dir / "config.yaml"
    if existing.is_file() and not _same_config(existing, cfg):
        raise RunDirError(
            f"run directory {run_dir} holds a run with a different config ({existing}); "
            f"use another run_dir (e.g. run_dir={run_dir}_2) or restore the original config")
    # logs/ alone may be there already: the Slurm job scripts put the launcher's per-rank logs in it
    if run_dir.exists() and not existing.is_file() and any(p.name != "logs" for p in run_dir.iterdir()):
        raise RunDirError(f"run directory {run_dir} exists, is not empty and has no config.yaml; refusing to write into it")


def _same_config(existing: Path, cfg: RunConfig) -> bool:
    """The run directory's config.yaml, validated again (keys added to the schema since it was written
    take their defaults), equals ``cfg``."""
    import yaml

    from mcit.config import validate_config

    try:
        old = validate_config(yaml.safe_load(existing.read_text()) or {}, str(existing))
    except (ConfigError, yaml.YAMLError):
        return False
    return dump_config(old) == dump_config(cfg)


class Pipeline:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.cfg = plan.cfg
        self.run_dir = plan.run_dir
        self.state: dict[str, Any] = {"completed": [], "method_state": None}
        self.logger: JsonlLogger | None = None
        self.backbone: torch.nn.Module | None = None
        self.method: Method | None = None

    # -- bookkeeping --------------------------------------------------------------------------------
    def _load_state(self) -> None:
        p = self.run_dir / STATE
        if p.is_file():
            self.state = read_json(p)

    def _mark(self, key: str, **extra: Any) -> None:
        self.state["completed"].append(key)
        self.state.update(extra)
        self.state["updated"] = time.time()
        if dist.is_main():
            write_json(self.run_dir / STATE, self.state)
            self.logger.log({"event": "stage", "stage": key, "time": time.time()})
        dist.barrier()

    def _say(self, text: str) -> None:
        if dist.is_main():
            print(text, file=sys.stderr, flush=True)

    # -- building -----------------------------------------------------------------------------------
    def _build_method(self) -> Method:
        cls = METHODS.get(self.cfg.method.name)
        torch.manual_seed(self.cfg.seed)  # same initial prompts on every rank and every rebuild
        return cls(self.cfg.method.params(), self.backbone, self.plan.sequence)

    def _reload(self, state: dict[str, torch.Tensor]) -> None:
        self.method = self._build_method()
        self.method.load_state_dict(state)
        self.method.to(dist.device())

    def _collate(self, t: int, *, train: bool, split: Split | None = None) -> Any:
        split = split or (self.plan.train[t] if train else self.plan.test[t])
        return self.backbone.make_collate(split, t, train=train, label_index=self.plan.sequence.label_to_index())

    def _save_current(self, key: str) -> str:
        rel = "checkpoints/current.safetensors"
        if dist.is_main():
            save_state(self.run_dir / rel, self.method.state_dict(), {"after_stage": key})
        dist.barrier()
        return rel

    # -- stages -------------------------------------------------------------------------------------
    def _eval_row(self, desc: str, trained: int, tag: str, tasks: list[int] | None = None,
                  answers_root: Path | None = None) -> dict[str, Any]:
        """Accuracy on ``tasks`` (default every task) after ``trained`` tasks (0 = zero-shot: every
        class allowed). Generated answers go to ``answers_root/<tag>`` (default eval/answers)."""
        tasks = list(range(len(self.plan.test))) if tasks is None else tasks
        tests = [self.plan.test[i] for i in tasks]
        collates = [self._collate(i, train=False) for i in tasks]
        if self.plan.scorers is not None:
            from mcit.evaluation import evaluate_generation

            scorers = [self.plan.scorers[i] for i in tasks]
            res = evaluate_generation(
                self.method, tests, batch_size=self.cfg.eval.batch_size, policy=self.cfg.data.split,
                collates=collates, scorers=scorers, max_new_tokens=self.cfg.eval.max_new_tokens,
                answers_dir=(answers_root or self.run_dir / "eval" / "answers") / tag,
                progress=self.cfg.train.progress, desc=desc, file_ids=tasks)
            return {"score_sum": [c for c, _ in res], "total": [n for _, n in res],
                    "acc": [100.0 * c / max(n, 1) for c, n in res], "scorers": scorers}
        allowed = None
        if self.cfg.eval.mask_unseen_classes and trained > 0:
            allowed = torch.zeros(self.plan.sequence.num_classes, dtype=torch.bool)
            for task in self.plan.sequence.tasks[:trained]:
                allowed[list(task.classes)] = True
        res = evaluate_tasks(self.method, tests, batch_size=self.cfg.eval.batch_size, policy=self.cfg.data.split,
                             collates=collates, allowed_classes=allowed, progress=self.cfg.train.progress, desc=desc)
        return {"correct": [c for c, _ in res], "total": [n for _, n in res],
                "acc": [100.0 * c / max(n, 1) for c, n in res]}

    def stage_zero_shot(self) -> None:
        with self.method.zero_shot():
            row = self._eval_row("zero-shot eval", 0, "zero_shot")
        if dist.is_main():
            write_json(self.run_dir / "eval" / "zero_shot.json", row)
        self._mark("zero_shot")

    def stage_train(self, t: int, phase: str = "") -> None:
        key = f"{t}/train" + (f".{phase}" if phase else "")
        self.method.set_task(t)
        self.method.set_phase(phase)
        step_dir = self.run_dir / "checkpoints" / f"task_{t}" / ("steps" + (f".{phase}" if phase else ""))
        if self.method.trainable_parameters():
            cfg = self.cfg
            overrides = self.method.phase_train(phase)
            if overrides:  # this phase's own epochs / lr / optimizer (validated like the config)
                train = type(cfg.train).model_validate({**cfg.train.model_dump(), **overrides})
                cfg = cfg.model_copy(update={"train": train})
            trainer = TaskTrainer(cfg, self.logger, self.run_dir)
            state = trainer.train(self.method, t, self.plan.train[t], self._collate(t, train=True), step_dir)
            self._reload(state)
            self.method.set_phase(phase)
        else:  # nothing to train (zero-shot CLIP): the task's hooks still run, no engine is built
            self.method.before_task(t)
        self.method.set_task(t)
        self.method.after_task(t)
        self._mark(key, method_state=self._save_current(key))

    def _stream_statistics(self, split: Split, collate: Any, t: int) -> None:
        """Every rank streams its part of ``split`` through ``method.statistics``; the sums are
        all-reduced, rank 0 finalizes (task ``t``, -1 = reference set) and broadcasts the state."""
        from mcit.data.loader import eval_batches

        sums: dict[str, torch.Tensor] | None = None
        rows: dict[str, list[torch.Tensor]] = {}
        with torch.no_grad():
            for batch in eval_batches(split, rank=dist.rank(), world=dist.world_size(),
                                      batch_size=self.cfg.eval.batch_size, policy=self.cfg.data.split,
                                      collate=collate):
                stats = self.method.statistics(batch.to(dist.device()))
                if stats is None:
                    continue
                for k in [k for k in stats if k.startswith("cat:")]:
                    rows.setdefault(k, []).append(stats.pop(k).detach().cpu())
                if sums is None:
                    sums = {k: v.detach().double().cpu().clone() for k, v in stats.items()}
                else:
                    for k, v in stats.items():
                        sums[k] += v.detach().double().cpu()
        # Every rank must take part in the reductions, even one that saw no batch.
        sums = sums if sums is not None else ({} if rows else None)
        keys = dist.broadcast_object(sorted(sums) if sums is not None else None)
        shapes = dist.broadcast_object({k: tuple(v.shape) for k, v in sums.items()} if sums else None)
        if keys is None:
            return
        sums = {k: (sums[k] if sums and k in sums else torch.zeros(shapes[k], dtype=torch.float64)) for k in keys}
        for k in keys:
            dist.all_reduce_sum(sums[k])
        # "cat:" statistics: every rank's rows, concatenated in rank order (rank 0 finalizes)
        local = {k: torch.cat(v) for k, v in rows.items()}
        for part in dist.gather_objects(local) if dist.world_size() > 1 else [local]:
            for k, v in part.items():
                sums[k] = torch.cat([sums[k], v]) if k in sums else v
        if dist.is_main():
            self.method.finalize_statistics(sums, t)
        state = dist.broadcast_object({k: v.cpu() for k, v in self.method.state_dict().items()}
                                      if dist.is_main() else None)
        self.method.load_state_dict(state)
        # Every rank must now hold the same bases, bit for bit: check it rather than assume it.
        digests = dist.gather_objects(state_digest(self.method.state_dict()))
        if len(set(digests)) != 1:
            raise RuntimeError(f"subspace stage of task {t}: the method state differs between ranks after the broadcast")
        if dist.is_main():
            report = self.method.subspace_report() if hasattr(self.method, "subspace_report") else {}
            self.logger.log({"event": "subspace", "task": t, **report, "state_sha256_per_rank": digests,
                             "time": time.time()})

    def stage_reference(self) -> None:
        """Statistics of data.reference before the first task (e.g. Fwd-Prompt's pre-trained subspace)."""
        self.method.set_task(0)
        split = self.plan.reference
        self._stream_statistics(split, self._collate(0, train=True, split=split), -1)
        self._mark("reference", method_state=self._save_current("reference"))

    def stage_subspace(self, t: int, phase: str = "") -> None:
        """Stream the task's statistics on every rank, sum over ranks, finalize on rank 0, broadcast."""
        key = f"{t}/subspace" + (f".{phase}" if phase else "")
        self.method.set_task(t)
        self.method.set_phase(phase)
        if type(self.method).statistics is not Method.statistics:
            self._stream_statistics(self.plan.train[t], self._collate(t, train=True), t)
        self._mark(key, method_state=self._save_current(key))

    def _first_task_loss(self) -> float | None:
        """The method's training loss on the first task's test split under the current state (the
        training-interference curve: how much each later task moves the first task's loss)."""
        if not self.cfg.eval.first_task_loss:
            return None
        from mcit.evaluation import evaluate_loss

        split = self.plan.test[0]
        return evaluate_loss(self.method, split, task=0, batch_size=self.cfg.eval.batch_size,
                             policy=self.cfg.data.split, collate=self._collate(0, train=True, split=split))

    def stage_eval(self, t: int) -> None:
        self.method.set_task(t)  # also when a resumed run starts at this stage
        row = self._eval_row(f"task {t} eval", t + 1, f"after_task_{t}")
        row["first_task_loss"] = self._first_task_loss()
        if dist.is_main():
            write_json(self.run_dir / "eval" / f"after_task_{t}.json", row)
        self._mark(f"{t}/eval")

    def stage_commit(self, t: int) -> None:
        if dist.is_main():
            task_dir = self.run_dir / "checkpoints" / f"task_{t}"
            save_state(task_dir / "method.safetensors", self.method.state_dict(),
                       {"task": t, "task_name": self.plan.names[t], "method": self.cfg.method.name})
            write_json(task_dir / "method.json", {
                "task": t, "task_name": self.plan.names[t], "method": self.cfg.method.name,
                "method_params": self.cfg.method.params().model_dump(), "backbone": self.plan.backbone_record,
                "tensors": {k: list(v.shape) for k, v in self.method.state_dict().items()}})
            self.write_metrics(done=t + 1)
            for steps in task_dir.glob("steps*"):
                shutil.rmtree(steps, ignore_errors=True)
        dist.barrier()
        self._mark(f"{t}/commit")

    # -- results ------------------------------------------------------------------------------------
    def rows(self, done: int) -> tuple[list[list[float]], list[float] | None, list[int]]:
        acc = [read_json(self.run_dir / "eval" / f"after_task_{t}.json")["acc"] for t in range(done)]
        zs_path = self.run_dir / "eval" / "zero_shot.json"
        zs = read_json(zs_path)["acc"] if zs_path.is_file() else None
        counts = [s.num_samples for s in self.plan.test]
        return acc, zs, counts

    def write_metrics(self, done: int) -> dict[str, Any]:
        acc, zs, counts = self.rows(done)
        T = len(self.plan.names)
        sub = [row[:done] for row in acc]
        m = M.compute(sub, counts[:done], zs[:done] if zs else None)
        first_loss = [read_json(self.run_dir / "eval" / f"after_task_{t}.json").get("first_task_loss")
                      for t in range(done)]
        out = {"name": self.cfg.name, "method": self.cfg.method.name, "backbone": self.cfg.backbone.tag,
               "tasks": self.plan.names, "test_counts": counts, "acc_unit": "percent",
               "complete": done == T, "tasks_done": done, "acc_matrix": acc, "zero_shot": zs,
               "first_task_loss": first_loss, "seed": self.cfg.seed, "meta": self.cfg.meta,
               "backbone_sha256": (self.plan.backbone_record or {}).get("sha256"),
               "backbone_format": (self.plan.backbone_record or {}).get("format"), **m}
        write_json(self.run_dir / "metrics.json", out)
        if done == T:
            M.heatmap(self.run_dir / "acc_matrix.png", self.plan.names, acc, f"{self.cfg.name} ({self.cfg.method.name})")
            (self.run_dir / "report.md").write_text(
                M.report_markdown(self.cfg.name, self.cfg.method.name, self.cfg.backbone.tag, self.plan.names,
                                  counts, acc, zs, m, out["backbone_sha256"]))
        return out

    # -- the loop -----------------------------------------------------------------------------------
    def build_model(self) -> None:
        """Load the frozen backbone and build the method from the config (the same on every rank)."""
        from mcit.config import CLASSIFICATION_KINDS
        from mcit.models.vit import load_backbone

        dtype = torch.bfloat16 if self.cfg.train.precision == "bf16" else torch.float32
        bb = self.cfg.backbone
        options = {} if bb.kind in CLASSIFICATION_KINDS else {"quantization": bb.quantization,
                                                               "max_length": bb.max_length}
        self.backbone = load_backbone(bb.kind, self.plan.backbone_dir or bb.path, dtype, **options)
        if bb.quantization == "none":  # bitsandbytes places quantized weights itself
            self.backbone = self.backbone.to(dist.device())
        self.method = self._build_method().to(dist.device())

    def stages(self) -> list[str]:
        """The stages of one task: train and subspace per phase of the method, then eval and commit."""
        phases = METHODS.get(self.cfg.method.name).phases
        per_phase = [f"{s}.{p}" if p else s for p in phases for s in STAGES[:2]]
        return per_phase + list(STAGES[2:])

    def run(self) -> dict[str, Any]:
        if dist.is_main():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if not (self.run_dir / "config.yaml").is_file():
                from mcit.checkpoint import atomic_write_text

                atomic_write_text(self.run_dir / "config.yaml", dump_config(self.cfg))
            if self.plan.backbone_record and not (self.run_dir / "backbone.json").is_file():
                write_json(self.run_dir / "backbone.json", self.plan.backbone_record)
        dist.barrier()
        self._load_state()
        self.logger = JsonlLogger(self.run_dir / "logs" / "train.jsonl" if dist.is_main() else None,
                                  self.run_dir / "logs" / "tb")
        self.build_model()
        if self.state.get("method_state"):
            self.method.load_state_dict(load_state(self.run_dir / self.state["method_state"]))
            self._say(f"resuming {self.run_dir}: {len(self.state['completed'])} stages done")
        keys = (["reference"] if self.plan.reference is not None else []) + (
            ["zero_shot"] if self.cfg.eval.zero_shot else []) + [
            f"{t}/{s}" for t in range(len(self.plan.names)) for s in self.stages()]
        if dist.is_main():
            preemption.clear(self.run_dir)  # a request that stopped an earlier job is done with
        dist.barrier()
        for key in keys:
            if key in self.state["completed"]:
                continue
            if preemption.agreed(self.run_dir):
                raise preemption.Preempted(f"before stage {key} (stages up to it committed)")
            try:
                if key in ("zero_shot", "reference"):
                    getattr(self, f"stage_{key}")()
                    continue
                t, stage = key.split("/")
                stage, _, phase = stage.partition(".")
                getattr(self, f"stage_{stage}")(int(t), *([phase] if phase else []))
            except RuntimeError as e:
                if _is_collective_failure(e):
                    raise CollectiveError(f"stage {key}: a collective did not complete on rank {dist.rank()} "
                                          f"({str(e).strip().splitlines()[0][:300]}); another rank died or hangs "
                                          f"(train.collective_timeout_s={self.cfg.train.collective_timeout_s:g})") from None
                raise
            if stage == "commit" and dist.is_main():
                acc, _, _ = self.rows(int(t) + 1)
                self._say(f"task {t} ({self.plan.names[int(t)]}) committed: acc on seen tasks "
                          + " ".join(f"{a:.1f}" for a in acc[-1][: int(t) + 1]))
        self.state["finished"] = True
        if dist.is_main():
            write_json(self.run_dir / STATE, self.state)
        dist.barrier()
        if self.logger:
            self.logger.close()
        return read_json(self.run_dir / "metrics.json")


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's names, dtypes, shapes and bytes."""
    import hashlib

    h = hashlib.sha256()
    for k in sorted(state):
        v = state[k].detach().cpu().contiguous()
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}".encode())
        h.update(v.reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()


def summary_text(metrics: dict[str, Any], run_dir: Path) -> str:
    lines = [f"== {metrics['name']} · method {metrics['method']} · {run_dir} ==",
             "accuracy matrix (%), rows: after training task t; columns: task i",
             M.format_matrix(metrics["tasks"], metrics["acc_matrix"], metrics.get("zero_shot")),
             M.format_summary(metrics)]
    return "\n".join(lines)


def finished_metrics(run_dir: Path) -> dict[str, Any] | None:
    p = run_dir / STATE
    if p.is_file() and read_json(p).get("finished") and (run_dir / "metrics.json").is_file():
        return read_json(run_dir / "metrics.json")
    return None
