"""Pre-train the project's tiny ViT on procedural shapes and save it as an HF checkpoint directory.

The continual pipeline then loads it with ``ViTModel.from_pretrained(path)`` exactly as it would a
real checkpoint. A finished checkpoint with the same settings is reused (the demo does not re-train).

    python -m data_prep.pretrain_vit --out data/backbones/tiny_vit_procedural
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from data_prep.common import build_environment, builder_main, portable_kernels

SETTINGS_FILE = "pretraining.json"


@portable_kernels
def pretrain(out: Path, *, hidden: int = 96, layers: int = 6, heads: int = 4, image_size: int = 16,
             patch_size: int = 4, n_train: int = 20000, epochs: int = 8, batch_size: int = 128,
             lr: float = 2e-3, numeral_fraction: float = 0.3, seed: int = 0, force: bool = False) -> dict:
    import numpy as np
    import torch
    from PIL import Image
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    from mcit.core.checkpoint import publish_dir, staging_dir
    from mcit.data.procedural import NUMERAL_NAMES, SHAPES, generate, generate_numerals, to_pixel_values

    settings = dict(hidden=hidden, layers=layers, heads=heads, image_size=image_size, patch_size=patch_size,
                    n_train=n_train, epochs=epochs, batch_size=batch_size, lr=lr, numeral_fraction=numeral_fraction,
                    seed=seed)
    done = out / SETTINGS_FILE
    if done.is_file() and not force and json.loads(done.read_text()).get("settings") == settings:
        return json.loads(done.read_text())

    torch.manual_seed(seed)
    t0 = time.time()
    n_all = n_train + 2000
    n_num = int(round(numeral_fraction * n_all))
    s_img, s_y = generate(n_all - n_num, size=image_size, seed=seed)
    n_img, n_y = generate_numerals(n_num, seed=seed + 1)
    n_img = np.stack([np.asarray(Image.fromarray(a).resize((image_size, image_size), Image.BILINEAR)) for a in n_img])
    mix = np.random.RandomState(seed + 2).permutation(n_all)
    x_img = np.concatenate([s_img, n_img])[mix]
    y = np.concatenate([s_y, n_y + len(SHAPES)])[mix]
    classes = SHAPES + NUMERAL_NAMES
    x = to_pixel_values(x_img)
    y = torch.from_numpy(y)
    x_tr, y_tr, x_va, y_va = x[:n_train], y[:n_train], x[n_train:], y[n_train:]
    cfg = ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                    intermediate_size=2 * hidden, image_size=image_size, patch_size=patch_size, num_channels=3,
                    num_labels=len(classes), id2label=dict(enumerate(classes)),
                    label2id={s: i for i, s in enumerate(classes)})
    model = ViTForImageClassification(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = epochs * ((n_train + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    for epoch in range(epochs):
        perm = torch.randperm(n_train)
        for i in range(0, n_train, batch_size):
            b = perm[i:i + batch_size]
            loss = torch.nn.functional.cross_entropy(model(pixel_values=x_tr[b]).logits, y_tr[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        print(f"pretrain epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}", file=sys.stderr, flush=True)
    model.eval()
    with torch.no_grad():
        acc = float((model(pixel_values=x_va).logits.argmax(-1) == y_va).float().mean())

    tmp = staging_dir(out)
    model.vit.save_pretrained(tmp)  # the bare ViTModel: what the pipeline loads
    ViTImageProcessor(do_resize=True, size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3,
                      image_std=[0.5] * 3, do_convert_rgb=True).save_pretrained(tmp)
    info = {"settings": settings, "environment": build_environment(),
            "shapes": classes, "val_accuracy": acc, "seconds": round(time.time() - t0, 1)}
    publish_dir(tmp, out, files={SETTINGS_FILE: json.dumps(info, indent=1)})
    return info


def main(argv: list[str] | None = None) -> int:
    return builder_main(__doc__, pretrain, lambda a, info: f"tiny ViT at {a.out}: procedural val accuracy "
                        f"{info['val_accuracy']:.3f} ({info['seconds']} s to train)", argv,
                        out="data/backbones/tiny_vit_procedural",
                        options=("hidden", "layers", "n_train", "epochs", "seed"))


if __name__ == "__main__":
    raise SystemExit(main())
