"""Instruction-tune the project's tiny LLaVA on the embedded benchmark's base mix; save it as an HF
checkpoint directory (model + processor), the "pre-trained MLLM" of the embedded MCIT demo.

Everything is built locally: the tokenizer is trained on the benchmark's text (``tokenizers``), the
processor is transformers' LlavaProcessor, the model a LlavaForConditionalGeneration from config
classes (CLIP vision tower + Llama). All weights are trained here on the base mix (captions of
every scene family and "What shape is this?"); the continual tasks' questions are never seen. The
pipeline loads the result with ``from_pretrained`` exactly like a real checkpoint. A finished
checkpoint with the same settings is reused.

    python -m data_prep.pretrain_tiny_llava --shards data/shards/tiny_mcit --out data/backbones/tiny_llava
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from data_prep.common import build_environment, builder_main, portable_kernels

SETTINGS_FILE = "pretraining.json"


@portable_kernels
def pretrain(shards: Path, out: Path, *, epochs: int = 6, batch_size: int = 32, lr: float = 3e-3,
             text_hidden: int = 128, text_layers: int = 3, vision_hidden: int = 64, vision_layers: int = 4,
             patch_size: int = 8, vision_samples: int = 8000, vision_epochs: int = 6, seed: int = 0,
             force: bool = False, progress: bool = True) -> dict:
    import torch

    from mcit.core.checkpoint import publish_dir, staging_dir
    from mcit.core.scorers import exact_match
    from mcit.data import tiny_mcit as B
    from mcit.data.loader import eval_batches
    from mcit.data.shards import iter_samples, open_split
    from mcit.models.mllm import MLLMBackbone
    from mcit.models.tiny_llava import build_model, build_processor, train_tokenizer

    settings = dict(epochs=epochs, batch_size=batch_size, lr=lr, text_hidden=text_hidden, text_layers=text_layers,
                    vision_hidden=vision_hidden, vision_layers=vision_layers, patch_size=patch_size,
                    vision_samples=vision_samples, vision_epochs=vision_epochs, seed=seed,
                    data=json.loads((shards / "benchmark.json").read_text())["settings"])
    done = out / SETTINGS_FILE
    if done.is_file() and not force and json.loads(done.read_text()).get("settings") == settings:
        return json.loads(done.read_text())
    t0 = time.time()
    torch.manual_seed(seed)
    train, val = open_split(shards / "base" / "train"), open_split(shards / "base" / "test")
    tokenizer = train_tokenizer(B.corpus())
    processor = build_processor(tokenizer, image_size=B.SIZE, patch_size=patch_size)
    model = build_model(tokenizer, image_size=B.SIZE, patch_size=patch_size, vision_hidden=vision_hidden,
                        vision_layers=vision_layers, text_hidden=text_hidden, text_layers=text_layers, seed=seed)
    wrap = MLLMBackbone.wrap(model, processor)  # its collate is the one the pipeline uses
    vision_acc = pretrain_vision(model, processor, n=vision_samples, epochs=vision_epochs, seed=seed,
                                 progress=progress)
    # Stage 2 (LLaVA-1.5's recipe): the vision tower stays frozen; projector and LLM are tuned.
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith("model.vision_tower"))
    collate = wrap.make_collate(train, 0, train=True)
    samples = list(iter_samples(train, 0, 1, policy="sample"))
    steps = epochs * ((len(samples) + batch_size - 1) // batch_size)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    bar = None
    if progress:
        from mcit.core.progress import progress_bar

        bar = progress_bar(steps, "tiny LLaVA instruction pre-training", "step", leave=True)
    g = torch.Generator().manual_seed(seed)
    model.train()
    loss_ema = None
    for _ in range(epochs):
        order = torch.randperm(len(samples), generator=g).tolist()
        for i in range(0, len(order), batch_size):
            batch = collate([samples[j] for j in order[i:i + batch_size]])
            out_ = model(input_ids=batch.inputs["input_ids"], attention_mask=batch.inputs["attention_mask"],
                         pixel_values=batch.pixel_values, labels=batch.labels)
            opt.zero_grad(set_to_none=True)
            out_.loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
            opt.step()
            sched.step()
            lv = float(out_.loss.detach())
            loss_ema = lv if loss_ema is None else 0.95 * loss_ema + 0.05 * lv
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_ema:.3f}", refresh=False)
    if bar is not None:
        bar.close()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    # Held-out exact match of generated answers on the base mix (sanity of the pre-training).
    correct, total = 0.0, 0
    for batch in eval_batches(val, rank=0, world=1, batch_size=64, policy="sample",
                              collate=wrap.make_collate(val, 0, train=False)):
        embeds, _ = wrap.input_embeddings(batch)
        preds = wrap.generate(embeds, batch.inputs["attention_mask"], max_new_tokens=8)
        correct += sum(exact_match(p, m) for p, m in zip(preds, batch.meta))
        total += len(preds)
    info = {"settings": settings, "environment": build_environment(),
            "base_val_exact_match": correct / max(total, 1), "train_loss_ema": loss_ema,
            "vision_attribute_val_acc": vision_acc,
            "parameters": sum(p.numel() for p in model.parameters()), "seconds": time.time() - t0}
    tmp = staging_dir(out)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Writing model shards" bar for one tiny file says nothing
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    publish_dir(tmp, out, files={SETTINGS_FILE: json.dumps(info, indent=1)})
    return info


def pretrain_vision(model, processor, *, n: int, epochs: int, seed: int, lr: float = 2e-3, batch_size: int = 128,
                    progress: bool = True) -> dict[str, float]:
    """Stage 1: the CLIP vision tower learns the scenes' attributes (colour, shape, count, position,
    digit) with linear heads on its [CLS] and mean patch features, standing in for a real
    checkpoint's pre-trained CLIP. Returns held-out accuracy per attribute."""
    import torch

    from mcit.data import tiny_mcit as B

    tower = model.model.vision_tower
    images, labels = B.attribute_scenes(n + 1000, seed)
    x = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    y = {k: torch.tensor(v) for k, v in labels.items()}
    sizes = {"colour": len(B.COLOURS), "shape": len(B.SHAPES), "count": 4, "position": len(B.POSITIONS), "digit": 10}
    width = 2 * tower.config.hidden_size
    heads = torch.nn.ModuleDict({k: torch.nn.Linear(width, c) for k, c in sizes.items()})
    params = list(tower.parameters()) + list(heads.parameters())
    for p in tower.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    steps = epochs * ((n + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)

    def features(px):
        out = tower(px, output_hidden_states=True)
        return torch.cat([out.pooler_output, out.hidden_states[-1][:, 1:].mean(1)], -1)

    bar = None
    if progress:
        from mcit.core.progress import progress_bar

        bar = progress_bar(steps, "tiny CLIP vision tower pre-training", "step", leave=True)
    tower.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=g)
        for i in range(0, n, batch_size):
            idx = order[i:i + batch_size]
            f = features(x[idx])
            loss = sum(torch.nn.functional.cross_entropy(heads[k](f), y[k][idx], ignore_index=-100) for k in sizes)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}", refresh=False)
    if bar is not None:
        bar.close()
    tower.eval()
    with torch.no_grad():
        f = features(x[n:])
        acc = {}
        for k in sizes:
            m = y[k][n:] != -100
            acc[k] = float((heads[k](f).argmax(-1)[m] == y[k][n:][m]).float().mean())
    return acc


def _summary(args: Any, info: dict) -> str:
    return ("tiny CLIP vision tower, held-out attribute accuracy: "
            + ", ".join(f"{k} {100 * v:.1f}%" for k, v in info["vision_attribute_val_acc"].items())
            + f"\ntiny LLaVA at {args.out}: {info['parameters']} parameters, base-mix held-out exact match "
            f"{100 * info['base_val_exact_match']:.1f}%, {info['seconds']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    return builder_main(__doc__, pretrain, _summary, argv, out="data/backbones/tiny_llava",
                        options=("shards", "epochs", "patch_size", "lr", "vision_layers"),
                        defaults={"shards": Path("data/shards/tiny_mcit")})


if __name__ == "__main__":
    raise SystemExit(main())
