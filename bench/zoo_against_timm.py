#!/usr/bin/env python
"""The backbone zoo's converters and inference pipelines against independent implementations: timm and torchvision.

These two are not installed beside the CPU torch here (timm needs torchvision, whose wheel must match the torch
build); a GPU image has both. So this is a script, not a test: run it where timm and torchvision import.

* ``vit_b16_in21k_augreg_timm`` (timm safetensors) and ``vit_b16_in21k_ft_in1k_augreg`` (timm ``.pth``): a random
  real-size timm ``vit_base_patch16_224`` (weights perturbed so that no LayerNorm is the identity) saved as timm
  saves it, converted by ``mcit.models.zoo.convert``; transformers' ``ViTModel`` last hidden state against timm's
  ``forward_features``.
* ``vit_b16_in21k_augreg`` (JAX ``.npz``): the same timm weights written in the JAX layout, read back by timm's
  own ``_load_weights`` (must give timm's model back exactly: that checks the writing), converted by the zoo.
* ``clip_vitb16_openai``: a random real-size OpenAI CLIP state dict, loaded into timm's
  ``vit_base_patch16_clip_224.openai`` by timm's own ``_convert_openai_clip``; transformers' ``CLIPModel``
  image features against timm's forward (its head is the projection).
* every zoo tag's evaluation pipeline (``ZooEntry.preprocessing``: resize, centre crop, mean / std) against
  torchvision's ``Resize`` / ``CenterCrop`` / ``ToTensor`` / ``Normalize`` with the same parameters, and the timm
  tags against timm's ``create_transform(resolve_data_config(pretrained_cfg))``, on PIL images of several sizes.

Models compare in float64 (TF32 off) on CUDA when present, else CPU. Target: max |difference| <= 1e-5.

    python bench/zoo_against_timm.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET = 1e-5


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """timm's init leaves LayerNorms at (1, 0) and biases at 0, under which a swapped weight / bias or a dropped
    bias would not show: add noise to every tensor."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def _images(n: int, size: int, device: str) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(device)


def _report(name: str, diff: float) -> bool:
    ok = diff <= TARGET
    print(f"{name}: max |difference| {diff:.3e} ({'ok' if ok else 'ABOVE'} {TARGET:g})", flush=True)
    return ok


def _jax_layout(sd: dict[str, torch.Tensor], heads: int) -> dict[str, np.ndarray]:
    """timm ViT tensors in the layout of google-research/vision_transformer's .npz (flax kernels (in, out),
    per-head attention kernels, NHWC patch kernel)."""
    d = sd["cls_token"].shape[-1]
    hd = d // heads
    a = {"embedding/kernel": sd["patch_embed.proj.weight"].permute(2, 3, 1, 0), "embedding/bias":
         sd["patch_embed.proj.bias"], "cls": sd["cls_token"], "Transformer/posembed_input/pos_embedding":
         sd["pos_embed"], "Transformer/encoder_norm/scale": sd["norm.weight"],
         "Transformer/encoder_norm/bias": sd["norm.bias"]}
    i = 0
    while f"blocks.{i}.norm1.weight" in sd:
        t, b = f"blocks.{i}", f"Transformer/encoderblock_{i}"
        m = f"{b}/MultiHeadDotProductAttention_1"
        q, k, v = sd[f"{t}.attn.qkv.weight"].chunk(3, 0)
        qb, kb, vb = sd[f"{t}.attn.qkv.bias"].chunk(3, 0)
        for name, w, bias in (("query", q, qb), ("key", k, kb), ("value", v, vb)):
            a[f"{m}/{name}/kernel"] = w.T.reshape(d, heads, hd)
            a[f"{m}/{name}/bias"] = bias.reshape(heads, hd)
        a.update({f"{m}/out/kernel": sd[f"{t}.attn.proj.weight"].T.reshape(heads, hd, d),
                  f"{m}/out/bias": sd[f"{t}.attn.proj.bias"],
                  f"{b}/LayerNorm_0/scale": sd[f"{t}.norm1.weight"], f"{b}/LayerNorm_0/bias": sd[f"{t}.norm1.bias"],
                  f"{b}/LayerNorm_2/scale": sd[f"{t}.norm2.weight"], f"{b}/LayerNorm_2/bias": sd[f"{t}.norm2.bias"],
                  f"{b}/MlpBlock_3/Dense_0/kernel": sd[f"{t}.mlp.fc1.weight"].T,
                  f"{b}/MlpBlock_3/Dense_0/bias": sd[f"{t}.mlp.fc1.bias"],
                  f"{b}/MlpBlock_3/Dense_1/kernel": sd[f"{t}.mlp.fc2.weight"].T,
                  f"{b}/MlpBlock_3/Dense_1/bias": sd[f"{t}.mlp.fc2.bias"]})
        i += 1
    return {k: v.detach().float().contiguous().numpy() for k, v in a.items()}


def check_vit(tmp: Path, device: str) -> bool:
    import timm
    from safetensors.torch import save_file
    from timm.models.vision_transformer import _load_weights

    from mcit.models import zoo as Z

    ok = True
    x = _images(2, 224, device)
    for tag, timm_name, fmt in (("vit_b16_in21k_augreg_timm", "vit_base_patch16_224.augreg_in21k", "safetensors"),
                                ("vit_b16_in21k_ft_in1k_augreg", "vit_base_patch16_224.augreg2_in21k_ft_in1k", "pth"),
                                ("vit_b16_in21k_augreg", "vit_base_patch16_224.augreg_in21k", "npz")):
        ref = _perturbed(timm.create_model(timm_name, pretrained=False), seed=len(tag))
        sd = {k: v.detach().clone().contiguous() for k, v in ref.state_dict().items()}
        if fmt == "safetensors":
            path = tmp / f"{tag}.safetensors"
            save_file(sd, str(path))
        elif fmt == "pth":
            path = tmp / f"{tag}.pth"
            torch.save(sd, path)
        else:
            path = tmp / f"{tag}.npz"
            np.savez(path, **_jax_layout(sd, ref.blocks[0].attn.num_heads))
            back = timm.create_model(timm_name, pretrained=False, num_classes=0).eval()
            _load_weights(back, str(path))
            written = max(float((back.state_dict()[k] - v).abs().max()) for k, v in sd.items()
                          if k in back.state_dict())
            print(f"{tag}: the .npz written here, read by timm's _load_weights, max |difference| from the timm "
                  f"weights {written:.1e}", flush=True)
            ref = back
        conv = Z.convert(tag, path)
        ours = conv.model.double().to(device).eval()
        ref = ref.double().to(device)
        with torch.no_grad():
            want = ref.forward_features(x)
            got = ours(pixel_values=x).last_hidden_state
        ok &= _report(f"{tag} ({fmt}) vs timm {timm_name} forward_features, {tuple(got.shape)}",
                      float((got - want).abs().max()))
        del ours, ref
    return ok


def openai_clip_state(seed: int, width: int = 768, layers: int = 12, patch: int = 16, image: int = 224,
                      twidth: int = 512, tlayers: int = 12, vocab: int = 49408, ctx: int = 77,
                      embed: int = 512) -> dict[str, torch.Tensor]:
    """A random OpenAI CLIP ViT-B/16 state dict (openai/CLIP model.py's names and shapes)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    n = (image // patch) ** 2 + 1
    sd = {"visual.conv1.weight": r(width, 3, patch, patch), "visual.class_embedding": r(width),
          "visual.positional_embedding": r(n, width), "visual.proj": r(width, embed, scale=width ** -0.5),
          "token_embedding.weight": r(vocab, twidth), "positional_embedding": r(ctx, twidth),
          "text_projection": r(twidth, embed, scale=twidth ** -0.5), "logit_scale": torch.tensor(4.6052),
          "input_resolution": torch.tensor(image), "context_length": torch.tensor(ctx),
          "vocab_size": torch.tensor(vocab)}
    for pre, w in (("visual.ln_pre", width), ("visual.ln_post", width), ("ln_final", twidth)):
        sd[f"{pre}.weight"], sd[f"{pre}.bias"] = 1 + r(w, scale=0.1), r(w, scale=0.1)
    for stack, w, n_layers in (("visual.transformer.resblocks", width, layers),
                               ("transformer.resblocks", twidth, tlayers)):
        for i in range(n_layers):
            s = f"{stack}.{i}"
            sd.update({f"{s}.attn.in_proj_weight": r(3 * w, w, scale=w ** -0.5), f"{s}.attn.in_proj_bias": r(3 * w),
                       f"{s}.attn.out_proj.weight": r(w, w, scale=w ** -0.5), f"{s}.attn.out_proj.bias": r(w),
                       f"{s}.ln_1.weight": 1 + r(w, scale=0.1), f"{s}.ln_1.bias": r(w, scale=0.1),
                       f"{s}.ln_2.weight": 1 + r(w, scale=0.1), f"{s}.ln_2.bias": r(w, scale=0.1),
                       f"{s}.mlp.c_fc.weight": r(4 * w, w, scale=w ** -0.5), f"{s}.mlp.c_fc.bias": r(4 * w),
                       f"{s}.mlp.c_proj.weight": r(w, 4 * w, scale=(4 * w) ** -0.5), f"{s}.mlp.c_proj.bias": r(w)})
    return sd


def check_clip(tmp: Path, device: str) -> bool:
    import timm
    from timm.models.vision_transformer import _convert_openai_clip

    from mcit.models import zoo as Z

    sd = openai_clip_state(seed=3)
    path = tmp / "ViT-B-16.pt"
    torch.save(sd, path)
    ref = timm.create_model("vit_base_patch16_clip_224.openai", pretrained=False).eval()
    missing, unexpected = ref.load_state_dict(_convert_openai_clip(dict(sd), ref), strict=False)
    print(f"timm vit_base_patch16_clip_224.openai from timm's _convert_openai_clip: missing {missing}, "
          f"unexpected {unexpected}", flush=True)
    conv = Z.convert("clip_vitb16_openai", path)
    ours = conv.model.double().to(device).eval()
    ref = ref.double().to(device)
    x = _images(2, 224, device)
    with torch.no_grad():
        want = ref(x)
        out: Any = ours.get_image_features(pixel_values=x)
        got = out.pooler_output if hasattr(out, "pooler_output") else out
    return _report(f"clip_vitb16_openai image features vs timm vit_base_patch16_clip_224.openai, {tuple(got.shape)}",
                   float((got - want).abs().max()))


def _pil_images() -> list[Any]:
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for w, h in ((640, 480), (300, 500), (224, 224), (97, 131), (1024, 768)):
        yy, xx = np.mgrid[0:h, 0:w]
        smooth = np.stack([(xx * 255 // max(w - 1, 1)), (yy * 255 // max(h - 1, 1)), ((xx + yy) % 256)], -1)
        noise = rng.integers(0, 256, (h, w, 3))
        arr = np.where(rng.random((h, w, 1)) < 0.3, noise, smooth).astype(np.uint8)
        out.append(Image.fromarray(arr, "RGB"))
    return out


def check_preprocessing() -> bool:
    import timm
    from timm.data import create_transform, resolve_data_config
    from torchvision import transforms as T

    from mcit.data.transforms import to_tensor
    from mcit.models import zoo as Z

    modes = {"bicubic": T.InterpolationMode.BICUBIC, "bilinear": T.InterpolationMode.BILINEAR}
    timm_names = {"vit_b16_in21k": "vit_base_patch16_224.orig_in21k",
                  "vit_b16_in21k_augreg": "vit_base_patch16_224.augreg_in21k",
                  "vit_b16_in21k_augreg_timm": "vit_base_patch16_224.augreg_in21k",
                  "vit_b16_in21k_ft_in1k_augreg": "vit_base_patch16_224.augreg2_in21k_ft_in1k",
                  "sam_vitb16": "vit_base_patch16_224.sam_in1k"}
    images = _pil_images()
    ok = True
    for tag, e in Z.ZOO.items():
        if e.format == "hf" or e.own_directory:
            continue
        pre = e.preprocessing()
        resize = [T.Resize(pre.resize, interpolation=modes[pre.interpolation]), T.CenterCrop(pre.size)] \
            if pre.resize else [T.Resize((pre.size, pre.size), interpolation=modes[pre.interpolation])]
        tv = T.Compose([*resize, T.ToTensor(), T.Normalize(pre.mean, pre.std)])
        worst = 0.0
        for im in images:
            ours = to_tensor([pre.steps()(im)], pre.mean, pre.std)[0]
            worst = max(worst, float((ours - tv(im)).abs().max()))
        ok &= _report(f"{tag} evaluation pipeline ({pre.resize} {pre.interpolation} + crop {pre.size}) vs "
                      f"torchvision, {len(images)} images", worst)
        if tag in timm_names:
            cfg = resolve_data_config({}, model=timm.create_model(timm_names[tag], pretrained=False))
            tt = create_transform(**cfg)
            worst = max(float((to_tensor([pre.steps()(im)], pre.mean, pre.std)[0] - tt(im)).abs().max())
                        for im in images)
            ok &= _report(f"{tag} vs timm create_transform({timm_names[tag]}) {cfg}", worst)
    return ok


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        import timm
        import torchvision
    except Exception as err:  # noqa: BLE001 - the reason timm cannot be used here is the message
        print(f"timm / torchvision not importable here ({type(err).__name__}: {err}); run this where both are")
        return 2
    print(f"torch {torch.__version__}, timm {timm.__version__}, torchvision {torchvision.__version__}, "
          f"device {device}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name, fn in (("vit", lambda: check_vit(Path(d), device)), ("clip", lambda: check_clip(Path(d), device)),
                         ("preprocessing", check_preprocessing)):
            try:
                results[name] = fn()
            except Exception as err:  # noqa: BLE001 - one check's failure must not hide the others
                print(f"FAILED {name}: {type(err).__name__}: {err}", flush=True)
                results[name] = False
    print("summary: " + ", ".join(f"{k} {'ok' if v else 'NOT ok'}" for k, v in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
