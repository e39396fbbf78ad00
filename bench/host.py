"""What every bench that trains or evaluates a method starts from: the run's plan and method host, built as the
pipeline builds them (the config, pre-flight, the process group, the frozen models through the zoo), so a
bench times the code a run executes, in the documented hook order (``MethodHost``), not a copy of it."""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent


def build_embedded(cfg: Any) -> None:
    """The embedded benchmarks' shards and backbones a config names, built here when missing (as ``make data``
    and ``make data-cil`` would)."""
    data, backbone = ROOT / cfg.data.root if cfg.data.root else None, ROOT / cfg.backbone.path
    if data == ROOT / "data/shards/digits":
        from data_prep.digits import build

        build(data)
    if backbone == ROOT / "data/backbones/tiny_vit_procedural":
        from data_prep.pretrain_vit import pretrain

        pretrain(backbone)
    if data == ROOT / "data/shards/tiny_mcit":
        from data_prep.tiny_mcit import build as build_mcit

        build_mcit(data)
        if backbone == ROOT / "data/backbones/tiny_llava":
            from data_prep.pretrain_tiny_llava import pretrain as pretrain_llava

            pretrain_llava(data, backbone)


@contextmanager
def bench_host(config: str | Path, overrides: list[str], *, random_vit_b16: bool = False) -> Iterator[tuple[Any, Any]]:
    """(plan, host): ``config`` with ``overrides`` through pre-flight into a throwaway run directory, the process
    group started, the frozen models loaded; on exit the process group ends and the directory goes.
    ``random_vit_b16``: the backbone is a randomly initialised ViT-B/16 (``save_random_vit_b16``)."""
    from mcit.core import distributed as dist
    from mcit.core.config import load_config
    from mcit.run.lifecycle import MethodHost
    from mcit.run.preflight import preflight

    dist.default_accelerator()
    with tempfile.TemporaryDirectory(prefix="mcit-bench-") as tmp:
        if random_vit_b16:
            save_random_vit_b16(f"{tmp}/vit_b16")
            overrides = [*overrides, f"backbone.path={tmp}/vit_b16", "backbone.tag=local"]
        cfg = load_config(config, overrides)
        build_embedded(cfg)
        plan = preflight(cfg, run_dir=Path(tmp) / "run")
        dist.init()
        try:
            host = MethodHost(plan)
            host.load_models()
            yield plan, host
        finally:
            dist.shutdown()


def save_random_vit_b16(path: str) -> None:
    """A randomly initialised ViT-B/16 (224 px, 12 x 768), the size the CIL papers use, saved with its image
    processor where ``backbone.path`` can point: throughput at real size needs no pre-trained weights."""
    import torch
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    torch.manual_seed(0)
    ViTModel(ViTConfig(image_size=224, patch_size=16), add_pooling_layer=False).save_pretrained(path)
    ViTImageProcessor(size={"height": 224, "width": 224}).save_pretrained(path)
