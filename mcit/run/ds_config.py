"""The DeepSpeed JSON a run trains with: the file ``train.deepspeed_config`` names, with the run's batch sizes,
precision and clipping filled in, and checked by DeepSpeed's own config model before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mcit.core.config import ConfigError, RunConfig


def resolve_ds_config_path(path: str) -> Path:
    """A DeepSpeed JSON path as given, else relative to the repository root."""
    p = Path(path)
    if p.is_file() or p.is_absolute():
        return p
    return Path(__file__).resolve().parents[2] / path


def build_ds_config(cfg: RunConfig, world: int) -> dict[str, Any]:
    """The JSON file of ``train.deepspeed_config`` with the run's batch, precision and clipping filled in."""
    path = resolve_ds_config_path(cfg.train.deepspeed_config)
    ds = json.loads(path.read_text())
    t = cfg.train
    _refuse_owned_keys(ds, path, cfg, world)
    ds["train_micro_batch_size_per_gpu"] = t.batch_size
    ds["gradient_accumulation_steps"] = t.grad_accum
    ds["train_batch_size"] = t.batch_size * t.grad_accum * world
    ds["gradient_clipping"] = t.grad_clip
    ds["steps_per_print"] = 1 << 30
    ds["bf16"] = {"enabled": t.precision == "bf16"}
    if t.precision == "bf16":
        # Projected updates and small prompts want fp32 gradient accumulation (PLATFORM.md).
        ds.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    if "optimizer" in ds:  # DeepSpeed builds it (e.g. DeepSpeedCPUAdam for offload); fill "auto"s
        params = ds["optimizer"].setdefault("params", {})
        for k, v in {"lr": t.lr, "weight_decay": t.weight_decay}.items():
            if params.get(k, "auto") == "auto":
                params[k] = v
    return ds


def _refuse_owned_keys(ds: dict[str, Any], path: Path, cfg: RunConfig, world: int) -> None:
    """Batch sizes and clipping come from the run's config. A JSON value that disagrees used to be replaced
    silently (a user's train_batch_size 7 trained with 16); now it stops the run. "auto" (or the same value)
    is fine. train_batch_size counts every rank: before the process group exists (``world`` 1, pre-flight)
    any multiple of batch_size x grad_accum is accepted, then the launched world must match it."""
    t = cfg.train
    per_rank = t.batch_size * t.grad_accum
    owned = {"train_micro_batch_size_per_gpu": ("train.batch_size", t.batch_size),
             "gradient_accumulation_steps": ("train.grad_accum", t.grad_accum),
             "gradient_clipping": ("train.grad_clip", t.grad_clip)}
    for key, (source, want) in owned.items():
        got = ds.get(key, "auto")
        if got != "auto" and got != want:
            raise ValueError(f"{path} sets {key} {got!r} but the run's {source} is {want!r}: batch sizes and "
                             f"clipping come from the config (remove the key or set it to \"auto\")")
    got = ds.get("train_batch_size", "auto")
    ok = got == "auto" or (isinstance(got, int) and got % per_rank == 0 and got >= per_rank
                           and (world == 1 or got == per_rank * world))
    if not ok:
        raise ValueError(f"{path} sets train_batch_size {got!r} but the run's train.batch_size x train.grad_accum "
                         f"x ranks is {per_rank} x {world}: remove the key or set it to \"auto\"")


def check_ds_config(ds: dict, path: Path) -> None:
    """The DeepSpeed JSON (with the run's batch sizes filled in for one process) through DeepSpeed's own
    config model, so an invalid value stops here, not in deepspeed.initialize on every rank."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    try:
        DeepSpeedConfig(ds)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(x) for x in e["loc"])
        raise ConfigError(f"train.deepspeed_config: {path}: {err.title} {loc}: {e['msg']} "
                          f"(got {e.get('input')!r})") from None
    except Exception as e:  # noqa: BLE001 - DeepSpeed's own asserts and ValueErrors
        raise ConfigError(f"train.deepspeed_config: {path}: DeepSpeed rejects it: "
                          f"{(str(e).splitlines() or [e.__class__.__name__])[0]}") from None


def check_deepspeed_config(cfg: RunConfig) -> None:
    """Pre-flight's part: the file exists, is JSON, agrees with the run's batch sizes and clipping, and
    DeepSpeed's config model takes it -- one ConfigError naming the file otherwise."""
    ds_path = resolve_ds_config_path(cfg.train.deepspeed_config)
    if not ds_path.is_file():
        raise ConfigError(f"train.deepspeed_config: file not found: {cfg.train.deepspeed_config}")
    import torch.distributed as tdist

    # DeepSpeedConfig checks the batch sizes against the live group's size where one exists (a worker that
    # calls pre-flight after init), else against one process.
    world = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
    try:
        ds = build_ds_config(cfg, world)
    except json.JSONDecodeError as e:
        raise ConfigError(f"train.deepspeed_config: {ds_path} is not valid JSON ({e})") from None
    except ValueError as e:  # a batch size or clipping value that disagrees with the config
        raise ConfigError(f"train.deepspeed_config: {e}") from None
    check_ds_config(ds, ds_path)
