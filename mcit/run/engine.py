"""DeepSpeed training of one task over the method's trainable parameters.

The frozen backbone never enters DeepSpeed (it is not a submodule of the method), so ZeRO shards,
checkpoints and all-reduces only prompts, keys and heads. Step checkpoints every
``train.checkpoint_every`` optimizer steps make a killed task resume at its last step: the data order
is a pure function of (seed, task, epoch, rank), so the resumed epoch skips exactly what was consumed.
The engine calls no method hook: ``mcit.run.lifecycle`` does, around ``TaskTrainer.train``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from mcit.core import distributed as dist
from mcit.core import preemption
from mcit.core.checkpoint import WriteError, atomic_write_text
from mcit.core.config import RunConfig
from mcit.data.loader import Epoch, LoaderOptions, global_valid, micro_steps_per_epoch, rank_counts, train_epochs
from mcit.data.shards import Split
from mcit.methods.base import Method
from mcit.run.ds_config import build_ds_config

COMMITTED = "committed.json"


def make_optimizer(cfg: RunConfig, params: list) -> torch.optim.Optimizer:
    """The run's torch optimizer over ``params`` (tensors, or groups with their own ``lr``)."""
    t = cfg.train
    if t.optimizer == "adam":
        return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay)
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)


def data_seed(seed: int, task: int, epoch: int, rank: int) -> int:
    return (seed * 1_000_003 + task * 10_007 + epoch * 101 + rank) % (2**31)


class JsonlLogger:
    """Rank 0's training log, ``logs/train.jsonl``, and the run's experiment trackers (``mcit.run.trackers``).

    Each training record gets a ``global_step``: the optimizer steps of the whole sequence, segment after segment
    (a segment is one task's training, or one phase of it: ``segment`` is set by the pipeline), so the trackers
    draw one curve over the sequence. The offsets are rebuilt from the file when a run resumes; a step already
    in the file (a resumed task training again from its last step checkpoint) goes to the file again but not to
    the trackers."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.trackers: Any = None  # mcit.run.trackers.Trackers, set by the pipeline on rank 0
        self.segment = ""
        self.order: list[str] = []  # the segments in the order they first logged
        self.ends: dict[str, int] = {}  # each segment's last step
        self.task_end: dict[int, int] = {}  # each task's last global step (a row's step in the trackers)
        self.records: list[dict[str, Any]] = []  # the training records of earlier launches, one per global step
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            seen: set[int] = set()
            if path.is_file():
                for line in path.read_text().splitlines():
                    try:
                        r = json.loads(line)
                    except ValueError:  # a line cut by a kill
                        continue
                    if "global_step" in r:
                        self._place(r)
                        if r["global_step"] not in seen:
                            seen.add(r["global_step"])
                            self.records.append(r)

    def _place(self, record: dict[str, Any]) -> int:
        seg = str(record.get("segment", record.get("task")))
        if seg not in self.order:
            self.order.append(seg)
        offset = sum(self.ends.get(s, 0) for s in self.order[:self.order.index(seg)])
        step = int(record["step"])
        self.ends[seg] = max(self.ends.get(seg, 0), step)
        g = offset + step
        task = int(record["task"])
        self.task_end[task] = max(self.task_end.get(task, 0), g)
        return g

    @property
    def last_step(self) -> int:
        """The last global step logged (0 before any)."""
        return max(self.task_end.values(), default=0)

    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        """Append one record (a training record, ``step`` given: with its segment and global step, then to the
        trackers). A log that cannot be written (full disk) is not a reason to lose the run: one warning,
        logging stops, and the next checkpoint or state write stops the run naming the file."""
        if self.path is None:
            return
        if step is not None and "task" in record:
            record = {**record, "step": record.get("step", step), "segment": self.segment or str(record["task"])}
            record["global_step"] = self._place(record)
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            print(f"warning: cannot append to {self.path} ({e.strerror}); the training log stops here",
                  file=sys.stderr, flush=True)
            self.path = None
            return
        if self.trackers is not None and "global_step" in record:
            self.trackers.train_record(record)

    def close(self) -> None:
        """The trackers' runs finished (also when the launch is failing: a tracker's own error is a warning then,
        not the news)."""
        if self.trackers is not None:
            trackers, self.trackers = self.trackers, None
            try:
                trackers.close()
            except Exception as e:  # noqa: BLE001
                print(f"warning: closing the experiment trackers: {e.__class__.__name__}: {e}", file=sys.stderr,
                      flush=True)


StepCallback = Callable[[int, int, Any], None]
_step_callbacks: list[StepCallback] = []


class NonFiniteError(RuntimeError):
    """Training produced a NaN / inf loss or gradient norm; ``str()`` is the one line the user sees."""


class _NonFiniteLoss(Exception):
    def __init__(self, value: float) -> None:
        super().__init__(value)
        self.value = value


LossSeam = Callable[[int, int, torch.Tensor], torch.Tensor]
_loss_seams: list[LossSeam] = []


def on_loss(fn: LossSeam) -> LossSeam:
    """Register ``fn(task, optimizer_step, loss) -> loss``, applied on every rank to each micro-batch's loss
    just before the non-finite check. A test-only seam (tests/launch/workers/faulty_run.py makes a chosen
    step's loss NaN with it); nothing registers one in a normal run."""
    _loss_seams.append(fn)
    return fn


def nonfinite_word(x: float) -> str:
    return "nan" if math.isnan(x) else "inf" if x > 0 else "-inf"


def on_optimizer_step(fn: StepCallback) -> StepCallback:
    """Register ``fn(task, global_step, engine)``, called on every rank after each optimizer step (after the
    step checkpoint, before the preemption check). Nothing registers one in a normal run; tests use it to
    kill or signal ranks at an exact step (tests/launch/workers/faulty_run.py) and to read the weights the
    next forward will use (tests/launch/workers/zero_equivalence.py); bench/train_stage_throughput.py times
    the steps with it."""
    _step_callbacks.append(fn)
    return fn


def full_fp32(p: torch.nn.Parameter) -> torch.Tensor:
    """The full fp32 value of a trainable parameter: ZeRO's master copy, or the parameter itself."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(p)
    return (full if full is not None else p).detach().float()


def _snapshot_masters(method: Method) -> dict[str, torch.Tensor]:
    return {n: full_fp32(p).clone() for n, p in method.named_parameters() if p.requires_grad}


def _project_updates(method: Method, old: dict[str, torch.Tensor]) -> None:
    """Replace each update (new - old) by the method's projection of it, in the fp32 master weights
    and in the copy the next forward reads (ZeRO-3: this rank's partition of it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    for n, p in method.named_parameters():
        if n not in old:
            continue
        full = safe_get_full_fp32_param(p)  # None without a ZeRO / bf16 master copy; collective at ZeRO-3
        kept = method.project_update(n, (full if full is not None else p).detach().float() - old[n])
        if kept is None:
            continue
        value = old[n] + kept
        if full is not None:
            safe_set_full_fp32_param(p, value)  # the optimizer's master copy
        with torch.no_grad():
            if hasattr(p, "ds_tensor"):  # ZeRO-3: write this rank's partition (the next gather reads it)
                part = p.ds_tensor
                n_part = part.numel()
                start = n_part * _z3_partition_index(p)
                flat = value.reshape(-1)[start:start + n_part].to(part.dtype)
                part.data.view(-1)[: flat.numel()].copy_(flat)
                if p.data.numel() == value.numel():
                    # kept gathered (at most stage3_param_persistence_threshold elements, or still in use):
                    # the step re-gathered the unprojected value into p.data, which the next forward reads
                    p.data.copy_(value.to(p.dtype).view_as(p.data))
            else:
                p.data.copy_(value.to(p.dtype).view_as(p.data))


def _z3_partition_index(p: torch.nn.Parameter) -> int:
    """This rank's index in the group that partitions ``p`` (ZeRO-3)."""
    import torch.distributed as tdist

    group = getattr(p, "ds_process_group", None)
    return tdist.get_rank(group=group) if tdist.is_initialized() else 0


def consolidated_state(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    """The full method state on every rank (ZeRO-3 gathered; fp32 master weights for trainables)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    params = list(module.parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            state = {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}
    else:
        state = {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}
    for name, p in module.named_parameters():
        if p.requires_grad:
            full = safe_get_full_fp32_param(p)
            if full is not None:
                state[name] = full.detach().clone().cpu().float()
    return state


def lr_factor(cfg: RunConfig, step: int, steps_per_epoch: int, base_lr: float | None = None,
              epochs: int | None = None) -> float:
    """``train.lr_schedule`` at optimizer step ``step`` (epoch-wise, as the papers' timm schedulers), as a
    factor of the group's ``base_lr``. Cosine decays to the absolute floor ``lr_min`` for every group, as
    timm's CosineLRScheduler does (so a head at 0.1 x lr reaches the same floor as the prompts). ``epochs``: the
    task's (default ``train.epochs``)."""
    t = cfg.train
    n = epochs or t.epochs
    epoch = step // max(steps_per_epoch, 1)
    if t.lr_schedule == "cosine":
        cos = 0.5 * (1 + math.cos(math.pi * min(epoch, n) / n))
        base = t.lr if base_lr is None else base_lr
        return (t.lr_min + (base - t.lr_min) * cos) / base
    if t.lr_schedule == "multistep":
        return t.lr_decay ** sum(1 for m in t.lr_milestones if epoch >= m)
    return 1.0


def warmup_steps(cfg: RunConfig, total_steps: int) -> int:
    """The LLaVA trainer's warmup length: ``ceil(warmup_ratio x total optimizer steps)``
    (transformers' ``TrainingArguments.get_warmup_steps``)."""
    return math.ceil(total_steps * cfg.train.warmup_ratio)


def make_scheduler(cfg: RunConfig, optimizer: Any, steps_per_epoch: int, epochs: int | None = None) -> Any:
    """The task's learning-rate scheduler, stepped by DeepSpeed after every optimizer step. The step-wise ones
    are the libraries' own, so a config copied from a LLaVA-trainer script schedules as that script did:
    transformers' cosine with linear warmup (every group decays from its own lr to 0 at the task's last step) and
    DeepSpeed's WarmupLR (log warmup from 0 to each group's lr, then constant)."""
    t = cfg.train
    total = steps_per_epoch * (epochs or t.epochs)
    if t.lr_schedule == "warmup_cosine":
        from transformers import get_cosine_schedule_with_warmup

        return get_cosine_schedule_with_warmup(optimizer, warmup_steps(cfg, total), total)
    if t.lr_schedule == "warmup_log":
        from deepspeed.runtime.lr_schedules import WarmupLR

        return WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=[g["lr"] for g in optimizer.param_groups],
                        warmup_num_steps=max(warmup_steps(cfg, total), 1), warmup_type="log")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, [functools.partial(lr_factor, cfg, steps_per_epoch=steps_per_epoch, base_lr=g["lr"], epochs=epochs)
                    for g in optimizer.param_groups])


def optimizer_groups(cfg: RunConfig, method: Method) -> list[dict]:
    """The method's parameter groups with their learning rates: ``lr`` where a group names one (absolute), else
    ``train.lr`` times its ``lr_scale``; frozen parameters and empty groups left out."""
    groups = [{"params": [p for p in g["params"] if p.requires_grad],
               "lr": g["lr"] if g.get("lr") is not None else cfg.train.lr * g.get("lr_scale", 1.0)}
              for g in method.param_groups()]
    return [g for g in groups if g["params"]]


def setup_engine(cfg: RunConfig, method: Method, world: int, steps_per_epoch: int = 1,
                 epochs: int | None = None) -> tuple[Any, int]:
    """deepspeed.initialize over the method's trainable parameters (``epochs``: the task's, for its learning-rate
    schedule); returns (engine, ZeRO stage)."""
    import deepspeed

    if not method.trainable_parameters():
        raise RuntimeError(f"method {method.name} has no trainable parameters")
    params = optimizer_groups(cfg, method)
    ds_cfg = build_ds_config(cfg, world)
    stage = int(ds_cfg.get("zero_optimization", {}).get("stage", 0))
    kwargs: dict[str, Any] = {"model": method, "config": ds_cfg}
    if "optimizer" in ds_cfg:
        kwargs["model_parameters"] = params
    else:
        kwargs["optimizer"] = make_optimizer(cfg, params)
    if cfg.train.lr_schedule != "constant":
        kwargs["lr_scheduler"] = functools.partial(make_scheduler, cfg, steps_per_epoch=steps_per_epoch,
                                                   epochs=epochs)
    from mcit.core import extensions

    preloaded = extensions.load_ops(extensions.ops_for(ds_cfg))  # under mcit's lock (mcit.core.extensions)
    engine, _, _, _ = deepspeed.initialize(**kwargs)
    outside = extensions.loaded_ops() - set(preloaded) - {"deepspeed_shm_comm"}
    if outside:  # DeepSpeed chose an op ops_for did not foresee: loaded under torch's unbounded lock only
        warnings.warn(f"DeepSpeed loaded {', '.join(sorted(outside))} outside mcit's extension lock; "
                      f"mcit.core.extensions.ops_for should name it", stacklevel=2)
    return engine, stage


def step_loss(terms: Any, valid: torch.Tensor, scale: float, token_scale: float | None = None) -> torch.Tensor:
    """The micro-batch's share of the accumulation window's objective (before DeepSpeed's averaging).

    ``scale`` = world * grad_accum / real samples in the window over all ranks: the valid-weighted per-sample
    terms summed and scaled become the global mean. ``token_scale`` = world * grad_accum / answer tokens in the
    window over all ranks: the terms' ``tokens`` sums become the global token mean (``train.lm_loss_mean:
    token``); None: each sample's token mean joins the per-sample terms (``sample``)."""
    valid = valid.to(terms.per_sample.dtype)
    if terms.tokens is not None and token_scale is not None:
        sums, _ = terms.tokens
        loss = (sums * valid.to(sums.dtype)).sum() * token_scale
        if terms.sample_terms is not None:
            loss = loss + (terms.sample_terms * valid).sum() * scale
    else:
        loss = (terms.per_sample * valid).sum() * scale
    if terms.regularizer is not None:
        loss = loss + terms.regularizer
    return loss


def train_step(engine: Any, batch: Any, scale: float,
               check: Callable[[torch.Tensor], torch.Tensor] | None = None,
               token_scale: float | None = None) -> tuple[Any, bool]:
    """Forward, loss weighting (``step_loss``), backward and (at an accumulation boundary) the optimizer step.

    ``check(loss)`` runs before the backward (the trainer's non-finite guard; it may raise).
    Returns the method's LossTerms and whether the optimizer stepped.
    """
    terms = engine(batch)
    loss = step_loss(terms, batch.valid, scale, token_scale)
    if check is not None:
        loss = check(loss)
    engine.backward(loss)
    boundary = engine.is_gradient_accumulation_boundary()
    old = _snapshot_masters(engine.module) if boundary and engine.module.projects_updates else None
    engine.step()
    if old is not None:
        _project_updates(engine.module, old)
    return terms, boundary


def windows(steps: Iterable[tuple[int, Any]], gas: int) -> Iterator[list[tuple[int, Any]]]:
    """(micro step, batch) pairs grouped by accumulation window (``step // gas``): the token-mean loss needs the
    window's answer tokens before its first backward, as transformers' Trainer prefetches them."""
    window: list[tuple[int, Any]] = []
    for s, batch in steps:
        if window and window[0][0] // gas != s // gas:
            yield window
            window = []
        window.append((s, batch))
    if window:
        yield window


def window_tokens(method: Any, window: list[tuple[int, Any]], device: torch.device) -> float:
    """The answer tokens of the window's real samples summed over ranks (one all-reduce per window)."""
    local = sum(method.answer_tokens(batch) for _, batch in window)
    return float(dist.all_reduce_sum(torch.tensor([float(local)], dtype=torch.float64, device=device))[0])


def seed_step(seed: int, device: torch.device) -> None:
    """Seed the generators a training step draws from (dropout, a method's sampling), so a resumed step draws
    what the uninterrupted one drew. The CPU generator and, on CUDA, this rank's device: what
    ``torch.manual_seed`` seeds here, without its walk over every other backend (about 1 ms a step, 2% of a
    small model's step, measured with bench/train_stage_throughput.py)."""
    torch.random.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def finite_loss_guard(loss: torch.Tensor, task: int, step: int) -> torch.Tensor:
    """The train stage's check before each backward: one all-reduce of the loss, so a NaN / inf on any rank
    reaches every rank and all stop (or skip) together. bench/engine_throughput.py times the engine step
    with it."""
    for seam in _loss_seams:
        loss = seam(task, step, loss)
    total = loss.detach().float().reshape(1).cpu().clone()
    dist.all_reduce_sum(total)
    if not math.isfinite(float(total)):
        raise _NonFiniteLoss(float(total))
    return loss


class TaskTrainer:
    """Trains one task: the pipeline's train stage (the method's hooks are called around it by mcit.run.lifecycle)."""

    def __init__(self, cfg: RunConfig, logger: JsonlLogger | None = None, preempt_request: Path | None = None,
                 loader: LoaderOptions = LoaderOptions()) -> None:
        self.cfg = cfg
        self.loader = loader  # the run's (Plan.loader)
        self.logger = logger or JsonlLogger(None)
        self.preempt_request = preempt_request  # a file whose appearance asks to stop (mcit.core.preemption)

    def train(
        self,
        method: Method,
        task: int,
        split: Split,
        collate: Callable,
        step_dir: Path,
    ) -> dict[str, torch.Tensor]:
        cfg, t = self.cfg, self.cfg.train
        rank, world = dist.rank(), dist.world_size()
        device = dist.device()
        method.to(device)
        method.backbone.to(device)
        policy, B, gas = cfg.data.split, t.batch_size, t.grad_accum
        steps_epoch = micro_steps_per_epoch(split, world, B, gas, policy)
        counts = rank_counts(split, world, policy)
        live_windows = sum(1 for w0 in range(0, steps_epoch, gas)
                           if sum(global_valid(counts, k, B) for k in range(w0, w0 + gas)) > 0)
        n_epochs = cfg.task_epochs(task)
        total_opt_steps = n_epochs * live_windows
        engine, stage = setup_engine(cfg, method, world, live_windows, n_epochs)
        epoch0, micro0, gstep = 0, 0, 0
        committed = step_dir / COMMITTED
        if committed.is_file():
            info = json.loads(committed.read_text())
            if info["world_size"] != world:
                raise RuntimeError(
                    f"{committed}: task {task} was checkpointed with {info['world_size']} ranks; "
                    f"resume it with the same number (running {world})")
            engine.load_checkpoint(str(step_dir), tag=info["tag"], load_module_strict=True)
            epoch0, micro0, gstep = info["epoch"], info["next_micro_step"], info["global_step"]
        bar = None
        if dist.is_main() and t.progress:
            from mcit.core.progress import progress_bar

            bar = progress_bar(total_opt_steps, f"task {task} train", "step", initial=gstep)
        engine.train()
        seen, t_start = 0, time.perf_counter()
        loss_sum, valid_sum, token_sum, token_count = 0.0, 0.0, 0.0, 0.0
        skipped = 0
        # the token-mean LM loss: a method whose loss has answer tokens, unless train.lm_loss_mean says sample
        tokens = t.lm_loss_mean == "token" and method.token_loss

        def logged_loss() -> float:
            return loss_sum / max(valid_sum, 1) + (token_sum / max(token_count, 1) if tokens else 0.0)

        def check(loss: torch.Tensor) -> torch.Tensor:
            return finite_loss_guard(loss, task, gstep + 1)

        epochs = [Epoch(micro0 if epoch == epoch0 else 0, data_seed(cfg.seed, task, epoch, rank),
                        data_seed(cfg.seed + 13, task, epoch, 0)) for epoch in range(epoch0, n_epochs)]
        stream = train_epochs(split, epochs, rank=rank, world=world, batch_size=B, num_steps=steps_epoch, policy=policy,
                              shuffle_buffer=cfg.data.shuffle_buffer, collate=collate, loader=self.loader)
        with contextlib.closing(stream) as batches:  # the loader workers stop here, whatever ends the loop
            for epoch, e in zip(range(epoch0, n_epochs), epochs):
                # the range first: zip stops at the epoch's end without taking the next epoch's first batch
                for window in windows(zip(range(e.skip_steps, steps_epoch), batches), gas):
                    w0 = (window[0][0] // gas) * gas
                    n_window = sum(global_valid(counts, k, B) for k in range(w0, w0 + gas))
                    if n_window == 0:
                        continue  # an all-padding accumulation window (same on every rank): no step at all
                    token_scale = world * gas / max(window_tokens(method, window, device), 1.0) if tokens else None
                    for s, batch in window:
                        seed_step(data_seed(cfg.seed + 7, task, epoch * 1_000_000 + s, rank), device)
                        batch = batch.to(device, non_blocking=True)
                        try:
                            terms, boundary = train_step(engine, batch, world * gas / n_window, check, token_scale)
                        except _NonFiniteLoss as e:
                            where = f"task {task} step {gstep + 1}: loss is {nonfinite_word(e.value)}"
                            if t.on_nonfinite == "stop":
                                raise NonFiniteError(f"{where} (train.on_nonfinite: stop; the last committed "
                                                     f"checkpoint is kept)") from None
                            skipped += 1
                            self.logger.log({"task": task, "epoch": epoch, "step": gstep, "micro_step": s,
                                             "nonfinite_skipped": skipped, "time": time.time()}, step=gstep)
                            if skipped > t.max_nonfinite_steps:
                                raise NonFiniteError(f"{where}; {skipped} micro-batches skipped in this task, more "
                                                     f"than train.max_nonfinite_steps={t.max_nonfinite_steps}"
                                                     ) from None
                            continue
                        if boundary:
                            norm = engine.get_global_grad_norm()
                            # the same global value on every rank
                            if norm is not None and not math.isfinite(float(norm)):
                                raise NonFiniteError(f"task {task} step {gstep + 1}: gradient norm is "
                                                     f"{nonfinite_word(float(norm))} (the update is already in the "
                                                     f"weights, so this always stops; the last committed checkpoint "
                                                     f"is kept)")
                        valid = batch.valid.to(terms.per_sample.dtype)
                        if token_scale is not None:  # the log shows the objective: token mean + per-sample terms
                            sums, n_tokens = terms.tokens
                            token_sum += float((sums.detach() * valid).sum())
                            token_count += float((n_tokens * valid).sum())
                            if terms.sample_terms is not None:
                                loss_sum += float((terms.sample_terms.detach() * valid).sum())
                        else:
                            loss_sum += float((terms.per_sample.detach() * valid).sum())
                        valid_sum += float(valid.sum())
                        seen += global_valid(counts, s, B)
                        if not boundary:
                            continue
                        gstep += 1
                        rate = seen / max(time.perf_counter() - t_start, 1e-9)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix(loss=f"{logged_loss():.4f}", samples_s=f"{rate:.1f}",
                                            refresh=False)
                        if gstep % t.log_every == 0 or gstep == total_opt_steps:
                            rec = {"task": task, "epoch": epoch, "step": gstep,
                                   "loss": logged_loss(), "lr": engine.get_lr()[0], "samples_per_s": rate,
                                   **terms.logs, "time": time.time()}
                            self.logger.log(rec, step=gstep)
                            loss_sum, valid_sum, token_sum, token_count = 0.0, 0.0, 0.0, 0.0
                        nxt_epoch, nxt = (epoch, s + 1) if s + 1 < steps_epoch else (epoch + 1, 0)
                        saved = gstep % t.checkpoint_every == 0 and gstep < total_opt_steps
                        if saved:
                            self.save_step(engine, step_dir, gstep, nxt_epoch, nxt, world)
                        for callback in _step_callbacks:
                            callback(task, gstep, engine)
                        if preemption.agreed(self.preempt_request):
                            if not saved:
                                self.save_step(engine, step_dir, gstep, nxt_epoch, nxt, world)
                            if bar is not None:
                                bar.close()
                            raise preemption.Preempted(f"task {task}, optimizer step {gstep} (step checkpoint "
                                                       f"committed)")
        if bar is not None:
            bar.close()
        state = consolidated_state(engine, stage)
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine
        return state

    def save_step(self, engine: Any, step_dir: Path, gstep: int, epoch: int, next_micro: int, world: int) -> None:
        """Every rank writes its part of the DeepSpeed checkpoint; once all parts are there (agreed by one
        all-reduce, so a rank whose disk is full stops every rank at once), rank 0 names it in
        ``committed.json``, the step a resume starts from, and drops the previous one."""
        tag = f"step{gstep:08d}"
        err: WriteError | None = None
        try:
            engine.save_checkpoint(str(step_dir), tag=tag, save_latest=False)
        except OSError as e:
            err = e if isinstance(e, WriteError) else WriteError(Path(e.filename or step_dir / tag), e)
        dist.agree(err, "another rank could not write its step checkpoint (it reports why)")

        def commit() -> None:
            committed = step_dir / COMMITTED
            prev = json.loads(committed.read_text())["tag"] if committed.is_file() else None
            atomic_write_text(committed, json.dumps({"tag": tag, "epoch": epoch, "next_micro_step": next_micro,
                                                     "global_step": gstep, "world_size": world}))
            if prev and prev != tag:
                shutil.rmtree(step_dir / prev, ignore_errors=True)

        dist.on_main(commit)
