"""Pre-train the project's tiny CLIP on procedural image-caption pairs; save an HF checkpoint directory.

No hub, no real data: the images are the procedural stroke shapes of ``mcit.data.procedural`` and
typeset numerals (Pillow's built-in font, reduced to 8x8 like a small scan), each with a caption
from a few templates ("a drawing of a ring.", "a photo of the digit seven."). The model is
transformers' own CLIPModel built from a config, trained with the symmetric contrastive loss (pairs
with the same concept count as positives, since captions repeat), and saved with a word-level
tokenizer (``tokenizers``) and an image-processor config, so the pipeline loads it with
``CLIPModel.from_pretrained(path)`` exactly as a real CLIP. The CLIP methods then run on the embedded
digits benchmark with real class-name prompts; the benchmark's handwritten digits are never seen.

    python -m data_prep.pretrain_clip --out data/backbones/tiny_clip_procedural
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from data_prep.common import build_environment, builder_main, portable_kernels

SETTINGS_FILE = "pretraining.json"
SHAPE_TEMPLATES = ["a photo of a {}.", "a drawing of a {}.", "a blurry photo of a {}.", "a sketch of a {}."]
NUMERAL_TEMPLATES = ["a photo of the digit {}.", "a drawing of the digit {}.", "a blurry photo of the number {}.",
                     "the digit {}."]
DIGIT_TEMPLATE = "a photo of the digit {}."  # the template of the embedded digits configs
# Ids 0-3 in this order: the end-of-text id must not be 2, which transformers' CLIP takes to mean a
# legacy checkpoint and then pools at the largest token id instead of at the end-of-text token.
SPECIAL = {"pad": "<pad>", "unk": "<unk>", "bos": "<|startoftext|>", "eos": "<|endoftext|>"}


def concepts() -> tuple[list[str], list[list[str]]]:
    """Every concept's name and its caption templates: the 16 shapes, then the numerals 0-9."""
    from mcit.data.procedural import NUMERAL_NAMES, SHAPE_NAMES, SHAPES

    names = [SHAPE_NAMES[s] for s in SHAPES] + NUMERAL_NAMES
    return names, [SHAPE_TEMPLATES] * len(SHAPES) + [NUMERAL_TEMPLATES] * len(NUMERAL_NAMES)


def build_tokenizer(texts: list[str]) -> Any:
    """A lower-cased word-level tokenizer over ``texts``: <|startoftext|> ... <|endoftext|>, as CLIP's."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=SPECIAL["unk"]))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=list(SPECIAL.values()), min_frequency=1))
    bos, eos = tok.token_to_id(SPECIAL["bos"]), tok.token_to_id(SPECIAL["eos"])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL['bos']} $A {SPECIAL['eos']}", special_tokens=[(SPECIAL["bos"], bos), (SPECIAL["eos"], eos)])
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"],
                                   unk_token=SPECIAL["unk"], pad_token=SPECIAL["pad"], padding_side="right",
                                   model_max_length=16)


def to_pixels(images: list, size: int) -> Any:
    """uint8 grey arrays of any size -> normalised (n, 3, size, size), resized as CLIPBackbone.preprocess."""
    import numpy as np
    import torch
    from PIL import Image

    arrs = [np.asarray(Image.fromarray(a).convert("RGB").resize((size, size), Image.BICUBIC), dtype=np.float32) / 255.0
            for a in images]
    x = torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2)
    return ((x - 0.5) / 0.5).contiguous()


@portable_kernels
def pretrain(out: Path, *, vision_hidden: int = 64, vision_layers: int = 4, text_hidden: int = 64, text_layers: int = 2,
             heads: int = 4, projection_dim: int = 32, image_size: int = 16, patch_size: int = 4,
             n_train: int = 16000, epochs: int = 6, batch_size: int = 128, lr: float = 2e-3, seed: int = 0,
             force: bool = False) -> dict:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from transformers import CLIPConfig, CLIPModel
    from transformers.models.clip import (
        CLIPImageProcessorPil,  # no torchvision here (see PLATFORM.md)
    )

    from mcit.core.checkpoint import publish_dir, staging_dir
    from mcit.data.procedural import SHAPES, generate, generate_numerals

    settings = dict(vision_hidden=vision_hidden, vision_layers=vision_layers, text_hidden=text_hidden,
                    text_layers=text_layers, heads=heads, projection_dim=projection_dim, image_size=image_size,
                    patch_size=patch_size, n_train=n_train, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed)
    done = out / SETTINGS_FILE
    if done.is_file() and not force and json.loads(done.read_text()).get("settings") == settings:
        return json.loads(done.read_text())

    torch.manual_seed(seed)
    t0 = time.time()
    names, templates = concepts()
    n_all = n_train + 2000
    shapes, shape_y = generate(n_all // 2, size=image_size, seed=seed)
    nums, num_y = generate_numerals(n_all - n_all // 2, seed=seed + 1)
    images = list(shapes) + list(nums)
    concept = np.concatenate([shape_y, num_y + len(SHAPES)])
    rng = np.random.RandomState(seed + 2)
    captions = [templates[c][rng.randint(len(templates[c]))].format(names[c]) for c in concept]
    corpus = [t.format(n) for n, ts in zip(names, templates) for t in ts] + [DIGIT_TEMPLATE.format(n) for n in names]
    tokenizer = build_tokenizer(corpus)
    x = to_pixels(images, image_size)
    enc = tokenizer(captions, padding="max_length", max_length=16, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    y = torch.from_numpy(concept)
    perm = torch.randperm(n_all, generator=torch.Generator().manual_seed(seed))
    tr, va = perm[:n_train], perm[n_train:]

    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=2 * text_hidden,
                         num_hidden_layers=text_layers, num_attention_heads=heads, max_position_embeddings=16,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                           num_hidden_layers=vision_layers, num_attention_heads=heads, image_size=image_size,
                           patch_size=patch_size),
        projection_dim=projection_dim)
    model = CLIPModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = epochs * ((n_train + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    for epoch in range(epochs):
        order = tr[torch.randperm(n_train)]
        for i in range(0, n_train, batch_size):
            b = order[i:i + batch_size]
            img = F.normalize(model.get_image_features(pixel_values=x[b]).pooler_output, dim=-1)
            txt = F.normalize(model.get_text_features(input_ids=ids[b], attention_mask=mask[b]).pooler_output, dim=-1)
            logits = model.logit_scale.exp() * img @ txt.t()
            same = (y[b].unsqueeze(0) == y[b].unsqueeze(1)).float()
            target = same / same.sum(dim=1, keepdim=True)  # repeated concepts are positives too
            loss = 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, 4.6052)
        print(f"pretrain clip epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}", file=sys.stderr, flush=True)
    model.eval()

    def zero_shot(pixels: torch.Tensor, labels: torch.Tensor, class_names: list[str], tmpls: list[list[str]]) -> float:
        with torch.no_grad():
            feats = []
            for name, ts in zip(class_names, tmpls):
                e = tokenizer([t.format(name) for t in ts], padding=True, return_tensors="pt")
                f = F.normalize(model.get_text_features(**e).pooler_output, dim=-1).mean(0)
                feats.append(F.normalize(f, dim=-1))
            img = F.normalize(model.get_image_features(pixel_values=pixels).pooler_output, dim=-1)
            return float(((img @ torch.stack(feats).t()).argmax(-1) == labels).float().mean())

    val_acc = zero_shot(x[va], y[va], names, templates)
    from sklearn.datasets import load_digits

    digits = load_digits()
    d_img = [np.clip(a * 16, 0, 255).astype(np.uint8) for a in digits.images]
    from mcit.data.procedural import NUMERAL_NAMES

    digits_acc = zero_shot(to_pixels(d_img, image_size), torch.from_numpy(digits.target), NUMERAL_NAMES,
                           [[DIGIT_TEMPLATE]] * 10)

    tmp = staging_dir(out)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    CLIPImageProcessorPil(do_resize=True, size={"shortest_edge": image_size},
                          crop_size={"height": image_size, "width": image_size},
                          image_mean=[0.5] * 3, image_std=[0.5] * 3, do_convert_rgb=True).save_pretrained(tmp)
    info = {"settings": settings, "environment": build_environment(),
            "concepts": names, "val_zero_shot_accuracy": val_acc,
            "sklearn_digits_zero_shot_accuracy": digits_acc, "digits_template": DIGIT_TEMPLATE,
            "seconds": round(time.time() - t0, 1)}
    publish_dir(tmp, out, files={SETTINGS_FILE: json.dumps(info, indent=1)})
    return info


def main(argv: list[str] | None = None) -> int:
    return builder_main(__doc__, pretrain, lambda a, info: f"tiny CLIP at {a.out}: zero-shot accuracy "
                        f"{info['val_zero_shot_accuracy']:.3f} on held-out procedural pairs, "
                        f"{info['sklearn_digits_zero_shot_accuracy']:.3f} on scikit-learn's digits "
                        f"({info['seconds']} s to train)", argv, out="data/backbones/tiny_clip_procedural",
                        options=("n_train", "epochs", "seed"))


if __name__ == "__main__":
    raise SystemExit(main())
