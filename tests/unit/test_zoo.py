"""Backbone zoo converters. No real checkpoint can be downloaded here, so each test writes a checkpoint in
the original format from random tensors in that format's own layout (JAX kernels, timm's fused qkv inside
the DINO / iBOT / MoCo v3 wrappers, OpenAI CLIP's in_proj and TorchScript archive), converts it, and
compares the transformers model with a forward computed here directly from the original tensors."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mcit.models import zoo as Z
from mcit.models.base import BackboneError

D, LAYERS, HEADS, MLP, PATCH, IMG = 32, 2, 4, 64, 4, 16
TINY_VIT = {"hidden_size": D, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "intermediate_size": MLP,
            "patch_size": PATCH, "image_size": IMG}
ATOL = 1e-5


def _rand(*shape, scale=0.1, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _ln(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


# -- timm / JAX layouts and their reference forwards ---------------------------------------------------
def timm_vit(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = (IMG // PATCH) ** 2 + 1
    sd = {"patch_embed.proj.weight": _rand(D, 3, PATCH, PATCH, gen=g), "patch_embed.proj.bias": _rand(D, gen=g),
          "cls_token": _rand(1, 1, D, gen=g), "pos_embed": _rand(1, n, D, gen=g),
          "norm.weight": 1 + _rand(D, gen=g), "norm.bias": _rand(D, gen=g)}
    for i in range(LAYERS):
        t = f"blocks.{i}"
        sd.update({f"{t}.norm1.weight": 1 + _rand(D, gen=g), f"{t}.norm1.bias": _rand(D, gen=g),
                   f"{t}.attn.qkv.weight": _rand(3 * D, D, scale=0.3, gen=g), f"{t}.attn.qkv.bias": _rand(3 * D, gen=g),
                   f"{t}.attn.proj.weight": _rand(D, D, scale=0.3, gen=g), f"{t}.attn.proj.bias": _rand(D, gen=g),
                   f"{t}.norm2.weight": 1 + _rand(D, gen=g), f"{t}.norm2.bias": _rand(D, gen=g),
                   f"{t}.mlp.fc1.weight": _rand(MLP, D, scale=0.3, gen=g), f"{t}.mlp.fc1.bias": _rand(MLP, gen=g),
                   f"{t}.mlp.fc2.weight": _rand(D, MLP, scale=0.3, gen=g), f"{t}.mlp.fc2.bias": _rand(D, gen=g)})
    return {k: v.float() for k, v in sd.items()}


def timm_forward(sd, x):
    """timm's VisionTransformer.forward_features, written out over the timm tensors (float64)."""
    p = {k: v.double() for k, v in sd.items()}
    x = x.double()
    tok = F.conv2d(x, p["patch_embed.proj.weight"], p["patch_embed.proj.bias"], stride=PATCH).flatten(2).transpose(1, 2)
    tok = torch.cat([p["cls_token"].expand(len(x), -1, -1), tok], 1) + p["pos_embed"]
    hd = D // HEADS
    for i in range(LAYERS):
        t = f"blocks.{i}"
        y = _ln(tok, p[f"{t}.norm1.weight"], p[f"{t}.norm1.bias"], 1e-6)
        qkv = (y @ p[f"{t}.attn.qkv.weight"].T + p[f"{t}.attn.qkv.bias"]).reshape(len(x), -1, 3, HEADS, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), -1) @ v
        tok = tok + a.transpose(1, 2).reshape(len(x), -1, D) @ p[f"{t}.attn.proj.weight"].T + p[f"{t}.attn.proj.bias"]
        y = _ln(tok, p[f"{t}.norm2.weight"], p[f"{t}.norm2.bias"], 1e-6)
        y = (F.gelu(y @ p[f"{t}.mlp.fc1.weight"].T + p[f"{t}.mlp.fc1.bias"]) @ p[f"{t}.mlp.fc2.weight"].T
             + p[f"{t}.mlp.fc2.bias"])
        tok = tok + y
    return _ln(tok, p["norm.weight"], p["norm.bias"], 1e-6)


def jax_vit(seed=0) -> dict[str, np.ndarray]:
    """Arrays in the JAX checkpoint layout (flax kernels: (in, out); attention (D, H, hd) / (H, hd, D))."""
    g = torch.Generator().manual_seed(seed)
    hd, n = D // HEADS, (IMG // PATCH) ** 2 + 1
    a = {"embedding/kernel": _rand(PATCH, PATCH, 3, D, gen=g), "embedding/bias": _rand(D, gen=g),
         "cls": _rand(1, 1, D, gen=g), "Transformer/posembed_input/pos_embedding": _rand(1, n, D, gen=g),
         "Transformer/encoder_norm/scale": 1 + _rand(D, gen=g), "Transformer/encoder_norm/bias": _rand(D, gen=g),
         "pre_logits/kernel": _rand(D, D, gen=g), "pre_logits/bias": _rand(D, gen=g),
         "head/kernel": _rand(D, 7, gen=g), "head/bias": _rand(7, gen=g)}
    for i in range(LAYERS):
        b = f"Transformer/encoderblock_{i}"
        m = f"{b}/MultiHeadDotProductAttention_1"
        a.update({f"{b}/LayerNorm_0/scale": 1 + _rand(D, gen=g), f"{b}/LayerNorm_0/bias": _rand(D, gen=g),
                  f"{b}/LayerNorm_2/scale": 1 + _rand(D, gen=g), f"{b}/LayerNorm_2/bias": _rand(D, gen=g),
                  f"{m}/out/kernel": _rand(HEADS, hd, D, scale=0.3, gen=g), f"{m}/out/bias": _rand(D, gen=g),
                  f"{b}/MlpBlock_3/Dense_0/kernel": _rand(D, MLP, scale=0.3, gen=g),
                  f"{b}/MlpBlock_3/Dense_0/bias": _rand(MLP, gen=g),
                  f"{b}/MlpBlock_3/Dense_1/kernel": _rand(MLP, D, scale=0.3, gen=g),
                  f"{b}/MlpBlock_3/Dense_1/bias": _rand(D, gen=g)})
        for name in ("query", "key", "value"):
            a[f"{m}/{name}/kernel"] = _rand(D, HEADS, hd, scale=0.3, gen=g)
            a[f"{m}/{name}/bias"] = _rand(HEADS, hd, gen=g)
    return {k: v.float().numpy() for k, v in a.items()}


def jax_forward(a, x):
    """The ViT of google-research/vision_transformer over its own arrays (NHWC conv, per-head kernels);
    exact GELU, as the PyTorch code bases that load these weights."""
    p = {k: torch.from_numpy(v).double() for k, v in a.items()}
    x = x.double().permute(0, 2, 3, 1)  # NHWC
    B = len(x)
    patches = x.reshape(B, IMG // PATCH, PATCH, IMG // PATCH, PATCH, 3).permute(0, 1, 3, 2, 4, 5)
    tok = torch.einsum("bghijc,ijcd->bghd", patches, p["embedding/kernel"]).reshape(B, -1, D) + p["embedding/bias"]
    tok = torch.cat([p["cls"].expand(B, -1, -1), tok], 1) + p["Transformer/posembed_input/pos_embedding"]
    hd = D // HEADS
    for i in range(LAYERS):
        b = f"Transformer/encoderblock_{i}"
        m = f"{b}/MultiHeadDotProductAttention_1"
        y = _ln(tok, p[f"{b}/LayerNorm_0/scale"], p[f"{b}/LayerNorm_0/bias"], 1e-6)
        q, k, v = (torch.einsum("bnd,dhk->bnhk", y, p[f"{m}/{n}/kernel"]) + p[f"{m}/{n}/bias"]
                   for n in ("query", "key", "value"))
        att = torch.softmax(torch.einsum("bnhk,bmhk->bhnm", q, k) / math.sqrt(hd), -1)
        o = torch.einsum("bhnm,bmhk->bnhk", att, v)
        tok = tok + torch.einsum("bnhk,hkd->bnd", o, p[f"{m}/out/kernel"]) + p[f"{m}/out/bias"]
        y = _ln(tok, p[f"{b}/LayerNorm_2/scale"], p[f"{b}/LayerNorm_2/bias"], 1e-6)
        y = F.gelu(y @ p[f"{b}/MlpBlock_3/Dense_0/kernel"] + p[f"{b}/MlpBlock_3/Dense_0/bias"])
        tok = tok + y @ p[f"{b}/MlpBlock_3/Dense_1/kernel"] + p[f"{b}/MlpBlock_3/Dense_1/bias"]
    return _ln(tok, p["Transformer/encoder_norm/scale"], p["Transformer/encoder_norm/bias"], 1e-6)


def tiny(tag: str) -> Z.ZooEntry:
    e = Z.ZOO[tag]
    return dataclasses.replace(e, arch=TINY_VIT if e.kind == "vit" else TINY_CLIP)


def _images(n=3):
    return torch.rand(n, 3, IMG, IMG, generator=torch.Generator().manual_seed(7))


def _hf_vit_out(model, x):
    with torch.no_grad():
        return model(pixel_values=x).last_hidden_state.double()


# -- the formats ----------------------------------------------------------------------------------------
def _write(tmp_path, fmt: str):
    """(checkpoint path, reference forward) for ``fmt``, the file in that release's own structure."""
    sd = timm_vit()
    if fmt == "jax_npz":
        arrays = jax_vit()
        path = tmp_path / "ViT-B_16.npz"
        np.savez(path, **arrays)
        return path, lambda x: jax_forward(arrays, x)
    if fmt == "timm_safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "model.safetensors"
        save_file({**sd, "head.weight": torch.zeros(5, D), "head.bias": torch.zeros(5)}, str(path))
    elif fmt == "timm_pth":
        path = tmp_path / "vit.pth"
        torch.save({**sd, "head.weight": torch.zeros(5, D), "head.bias": torch.zeros(5)}, path)
    elif fmt == "dino":  # dino_vitbase16_pretrain.pth: the backbone's state dict as it is
        path = tmp_path / "dino_vitbase16_pretrain.pth"
        torch.save(sd, path)
    elif fmt == "ibot":  # checkpoint_teacher.pth: {"state_dict": ...} with DDP prefixes
        path = tmp_path / "checkpoint_teacher.pth"
        torch.save({"state_dict": {f"module.{k}": v for k, v in sd.items()}}, path)
    elif fmt == "ibot21k":  # checkpoint.pth: {"teacher": backbone.* + the projection head, "student": ...}
        path = tmp_path / "checkpoint.pth"
        head = {"backbone.head.weight": torch.zeros(1), "head.mlp.0.weight": torch.randn(8, D),
                "head.last_layer.weight_g": torch.ones(8, 1)}
        torch.save({"teacher": {**{f"backbone.{k}": v for k, v in sd.items()}, **head},
                    "student": {f"backbone.{k}": torch.zeros_like(v) for k, v in sd.items()}, "epoch": 3}, path)
    elif fmt == "mocov3":  # vit-b-300ep.pth.tar: base and momentum encoders, heads, optimizer state, args
        import argparse

        path = tmp_path / "vit-b-300ep.pth.tar"
        state = {**{f"module.base_encoder.{k}": v for k, v in sd.items()},
                 **{f"module.momentum_encoder.{k}": torch.zeros_like(v) for k, v in sd.items()},
                 "module.base_encoder.head.0.weight": torch.randn(16, D),
                 "module.predictor.0.weight": torch.randn(4, 4)}
        torch.save({"epoch": 300, "arch": "vit_base", "state_dict": state, "optimizer": {"state": {}},
                    "args": argparse.Namespace(lr=1.5e-4)}, path)
    else:
        raise ValueError(fmt)
    return path, lambda x: timm_forward(sd, x)


@pytest.mark.parametrize("fmt, tag", [
    ("jax_npz", "vit_b16_in21k"), ("jax_npz", "sam_vitb16"), ("timm_safetensors", "vit_b16_in21k_augreg_timm"),
    ("timm_pth", "vit_b16_in21k_ft_in1k_augreg"), ("dino", "dino_vitb16"), ("ibot", "ibot_vitb16"),
    ("ibot21k", "ibot_vitb16_in21k"), ("mocov3", "mocov3_vitb16")])
def test_vit_formats_convert_to_the_same_outputs(tmp_path, fmt, tag):
    path, reference = _write(tmp_path, fmt)
    conv = Z.convert(tag, path, entry_override=tiny(tag))
    x = _images()
    got, want = _hf_vit_out(conv.model, x), reference(x)
    assert (got - want).abs().max() < ATOL, float((got - want).abs().max())
    assert conv.sha256 == Z.sha256_path(path) and len(conv.sha256) == 64
    if fmt in ("mocov3", "ibot21k", "jax_npz", "timm_pth"):
        assert conv.dropped  # heads / pre-logits / momentum parts are reported, not silently ignored


def test_converted_vit_round_trips_through_an_hf_directory_and_the_backbone(tmp_path):
    from mcit.models.vit import ViTBackbone

    path, reference = _write(tmp_path, "jax_npz")
    out = Z.export_hf(Z.convert("vit_b16_in21k", path, entry_override=tiny("vit_b16_in21k")), tmp_path / "hf")
    bb = ViTBackbone.from_path(out)
    x = _images()
    with torch.no_grad():
        h = bb.encode(bb.embed(x)).double()  # blocks + final norm, the path every method takes
    assert (h - reference(x)).abs().max() < ATOL
    # the directory carries the tag's own pipeline (timm's: bicubic 248 + centre crop, mean / std 0.5), which a run
    # without a preset uses; a preset's Normalize replaces the mean / std at load (MethodHost.load_models)
    assert bb.mean.flatten().tolist() == [0.5, 0.5, 0.5] and bb.std.flatten().tolist() == [0.5, 0.5, 0.5]
    assert bb.resample == 3
    own, tag = ViTBackbone.own_preprocessing(out), tiny("vit_b16_in21k").preprocessing()
    assert (own.size, own.resize, own.interpolation, own.mean, own.std) == (tag.size, 248, "bicubic", tag.mean, tag.std)
    bb.use_normalization((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    assert bb.mean.flatten().tolist() == [0.0, 0.0, 0.0] and bb.std.flatten().tolist() == [1.0, 1.0, 1.0]
    from PIL import Image

    white = Image.new("RGB", (bb.image_size, bb.image_size), (255, 255, 255))
    assert bb.preprocess([white]).flatten().unique().tolist() == [1.0]  # the collate normalises with it too


def test_wrong_checkpoints_give_the_listed_error(tmp_path):
    path, _ = _write(tmp_path, "timm_pth")
    with pytest.raises(BackboneError,
                       match=r"does not match backbone tag 'dino_vitb16': hidden_size 32 \(expected 768\)"):
        Z.convert("dino_vitb16", path)  # a tiny checkpoint is not a ViT-B/16
    sd = timm_vit()
    sd["blocks.0.attn.extra"] = torch.zeros(3)
    torch.save(sd, tmp_path / "bad.pth")
    with pytest.raises(BackboneError, match=r"unexpected keys in the ViT checkpoint: blocks.0.attn.extra"):
        Z.convert("dino_vitb16", tmp_path / "bad.pth", entry_override=tiny("dino_vitb16"))
    sd = timm_vit()
    sd["blocks.1.mlp.fc1.bias"] = torch.zeros(MLP + 1)
    torch.save(sd, tmp_path / "shape.pth")
    with pytest.raises(BackboneError, match=r"wrong shapes: layers.1.mlp.fc1.bias \(65,\) \(model \(64,\)\)"):
        Z.convert("dino_vitb16", tmp_path / "shape.pth", entry_override=tiny("dino_vitb16"))
    sd = timm_vit()
    del sd["norm.bias"]
    torch.save(sd, tmp_path / "missing.pth")
    with pytest.raises(BackboneError,
                       match=r"not a dino vit checkpoint for tag 'dino_vitb16': missing key 'norm.bias'"):
        Z.convert("dino_vitb16", tmp_path / "missing.pth", entry_override=tiny("dino_vitb16"))
    with pytest.raises(BackboneError,
                       match=r"backbone.tag 'vit_b16_typo' is not a zoo tag \(known tags: .*dino_vitb16"):
        Z.entry("vit_b16_typo")
    with pytest.raises(BackboneError,
                       match=r"'vit_b16_augreg_in21k' is not a zoo tag \(did you mean vit_b16_in21k_augreg or "):
        Z.entry("vit_b16_augreg_in21k")  # the words of a zoo tag in another order


# -- OpenAI CLIP -----------------------------------------------------------------------------------------
TD, TLAYERS, THEADS, VOCAB, CTX, EMBED = 24, 2, 2, 40, 7, 16
TINY_CLIP = {"vision": {**TINY_VIT, "intermediate_size": 4 * D},
             "text": {"hidden_size": TD, "num_hidden_layers": TLAYERS, "num_attention_heads": THEADS,
                      "intermediate_size": 4 * TD, "vocab_size": VOCAB, "max_position_embeddings": CTX},
             "projection_dim": EMBED}


def openai_clip(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = (IMG // PATCH) ** 2 + 1
    sd = {"visual.conv1.weight": _rand(D, 3, PATCH, PATCH, gen=g), "visual.class_embedding": _rand(D, gen=g),
          "visual.positional_embedding": _rand(n, D, gen=g), "visual.proj": _rand(D, EMBED, scale=0.3, gen=g),
          "token_embedding.weight": _rand(VOCAB, TD, gen=g), "positional_embedding": _rand(CTX, TD, gen=g),
          "text_projection": _rand(TD, EMBED, scale=0.3, gen=g), "logit_scale": torch.tensor(math.log(1 / 0.07)),
          "input_resolution": torch.tensor(IMG), "context_length": torch.tensor(CTX), "vocab_size": torch.tensor(VOCAB)}
    for pre, width in (("visual.ln_pre", D), ("visual.ln_post", D), ("ln_final", TD)):
        sd[f"{pre}.weight"], sd[f"{pre}.bias"] = 1 + _rand(width, gen=g), _rand(width, gen=g)
    for stack, width, layers in (("visual.transformer.resblocks", D, LAYERS), ("transformer.resblocks", TD, TLAYERS)):
        for i in range(layers):
            s = f"{stack}.{i}"
            sd.update({f"{s}.attn.in_proj_weight": _rand(3 * width, width, scale=0.3, gen=g),
                       f"{s}.attn.in_proj_bias": _rand(3 * width, gen=g),
                       f"{s}.attn.out_proj.weight": _rand(width, width, scale=0.3, gen=g),
                       f"{s}.attn.out_proj.bias": _rand(width, gen=g),
                       f"{s}.ln_1.weight": 1 + _rand(width, gen=g), f"{s}.ln_1.bias": _rand(width, gen=g),
                       f"{s}.ln_2.weight": 1 + _rand(width, gen=g), f"{s}.ln_2.bias": _rand(width, gen=g),
                       f"{s}.mlp.c_fc.weight": _rand(4 * width, width, scale=0.3, gen=g),
                       f"{s}.mlp.c_fc.bias": _rand(4 * width, gen=g),
                       f"{s}.mlp.c_proj.weight": _rand(width, 4 * width, scale=0.3, gen=g),
                       f"{s}.mlp.c_proj.bias": _rand(width, gen=g)})
    return {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()}


def _clip_blocks(p, stack, x, layers, heads, mask=None):
    width = x.shape[-1]
    hd = width // heads
    for i in range(layers):
        s = f"{stack}.{i}"
        y = _ln(x, p[f"{s}.ln_1.weight"], p[f"{s}.ln_1.bias"], 1e-5)
        q, k, v = (y @ p[f"{s}.attn.in_proj_weight"].T + p[f"{s}.attn.in_proj_bias"]).chunk(3, -1)
        q, k, v = (t.reshape(len(x), -1, heads, hd).transpose(1, 2) for t in (q, k, v))
        s_ = q @ k.transpose(-1, -2) / math.sqrt(hd)
        if mask is not None:
            s_ = s_ + mask
        a = (torch.softmax(s_, -1) @ v).transpose(1, 2).reshape(len(x), -1, width)
        x = x + a @ p[f"{s}.attn.out_proj.weight"].T + p[f"{s}.attn.out_proj.bias"]
        y = _ln(x, p[f"{s}.ln_2.weight"], p[f"{s}.ln_2.bias"], 1e-5)
        y = y @ p[f"{s}.mlp.c_fc.weight"].T + p[f"{s}.mlp.c_fc.bias"]
        y = y * torch.sigmoid(1.702 * y)  # QuickGELU
        x = x + y @ p[f"{s}.mlp.c_proj.weight"].T + p[f"{s}.mlp.c_proj.bias"]
    return x


def clip_reference(sd, images, ids):
    """OpenAI CLIP's encode_image / encode_text over its own tensors (float64)."""
    p = {k: v.double() for k, v in sd.items() if v.is_floating_point()}
    x = F.conv2d(images.double(), p["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)
    x = torch.cat([p["visual.class_embedding"].expand(len(x), 1, -1), x], 1) + p["visual.positional_embedding"]
    x = _ln(x, p["visual.ln_pre.weight"], p["visual.ln_pre.bias"], 1e-5)
    x = _clip_blocks(p, "visual.transformer.resblocks", x, LAYERS, HEADS)
    img = _ln(x[:, 0], p["visual.ln_post.weight"], p["visual.ln_post.bias"], 1e-5) @ p["visual.proj"]
    t = p["token_embedding.weight"][ids] + p["positional_embedding"][: ids.shape[1]]
    causal = torch.full((ids.shape[1], ids.shape[1]), float("-inf"), dtype=torch.float64).triu(1)
    t = _clip_blocks(p, "transformer.resblocks", t, TLAYERS, THEADS, causal)
    t = _ln(t, p["ln_final.weight"], p["ln_final.bias"], 1e-5)
    txt = t[torch.arange(len(ids)), ids.argmax(-1)] @ p["text_projection"]
    return img, txt


def _tensor(out):
    return (out.pooler_output if hasattr(out, "pooler_output") else out).double()


def _torchscript(sd: dict[str, torch.Tensor], path) -> None:
    """A TorchScript archive holding ``sd`` under the same names, as OpenAI's ``ViT-B-16.pt`` files."""
    root = torch.nn.Module()
    for key, value in sd.items():
        *mods, leaf = key.split(".")
        m = root
        for name in mods:
            if not hasattr(m, name):
                m.add_module(name, torch.nn.Module())
            m = getattr(m, name)
        if value.is_floating_point():
            m.register_parameter(leaf, torch.nn.Parameter(value.clone(), requires_grad=False))
        else:
            m.register_buffer(leaf, value.clone())

    class Wrap(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            for name, child in inner.named_children():
                self.add_module(name, child)
            for name, p in inner.named_parameters(recurse=False):
                self.register_parameter(name, p)
            for name, b in inner.named_buffers(recurse=False):
                self.register_buffer(name, b)

        def forward(self) -> torch.Tensor:
            return self.logit_scale

    torch.jit.save(torch.jit.script(Wrap(root)), str(path))


@pytest.mark.parametrize("container", ["state_dict", "torchscript"])
def test_openai_clip_converts_to_the_same_image_and_text_features(tmp_path, container):
    sd = openai_clip()
    path = tmp_path / "ViT-B-16.pt"
    if container == "state_dict":
        torch.save(sd, path)
    else:
        _torchscript(sd, path)
    conv = Z.convert("clip_vitb16_openai", path, entry_override=tiny("clip_vitb16_openai"))
    images = _images()
    ids = torch.tensor([[VOCAB - 2, 5, 9, VOCAB - 1, 0, 0, 0], [VOCAB - 2, 3, 4, 11, 12, VOCAB - 1, 0]])
    want_img, want_txt = clip_reference(sd, images, ids)
    with torch.no_grad():
        got_img = _tensor(conv.model.get_image_features(pixel_values=images))
        got_txt = _tensor(conv.model.get_text_features(input_ids=ids))  # causal: the padding after EOT is inert
    assert (got_img - want_img).abs().max() < ATOL, float((got_img - want_img).abs().max())
    assert (got_txt - want_txt).abs().max() < ATOL, float((got_txt - want_txt).abs().max())
    assert float(conv.model.logit_scale) == pytest.approx(math.log(1 / 0.07))
    assert sorted(conv.dropped) == ["context_length", "input_resolution", "vocab_size"]


# -- through the config and the pipeline's pre-flight ------------------------------------------------------
def test_a_zoo_tag_in_the_config_converts_once_records_its_sha_and_guards_the_run(assets, tmp_path, monkeypatch):
    """``backbone: {tag: dino_vitb16, path: <the release file>}``: pre-flight converts it once into the
    cache (a second pre-flight reuses it), the loaded backbone computes the release's forward, the
    record carries the file's sha256, and a run directory started with another checkpoint is refused."""
    import yaml

    from mcit.core.config import dump_config, load_config
    from mcit.core.rundir import RunDirError
    from mcit.models.base import load_backbone
    from mcit.run.preflight import preflight

    monkeypatch.setitem(Z.ZOO, "dino_vitb16", tiny("dino_vitb16"))  # the real tag's ViT-B/16 shape, shrunk
    path, reference = _write(tmp_path, "dino")
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "name": "zoo", "run_dir": str(tmp_path / "run"),
        "backbone": {"kind": "vit", "tag": "dino_vitb16", "path": str(path), "cache_dir": str(tmp_path / "cache")},
        "data": {"root": str(assets["shards"]), "tasks": ["task0"]}, "method": {"name": "seq"}}))
    plan = preflight(load_config(cfg_path))
    assert plan.backbone.record["sha256"] == Z.sha256_path(path) and plan.backbone.record["format"] == "dino"
    converted = Path(plan.backbone.directory)
    assert converted.parent == tmp_path / "cache" and (converted / "model.safetensors").is_file()
    stamp = (converted / "zoo.json").stat().st_mtime_ns
    assert preflight(load_config(cfg_path)).backbone.directory == str(converted)
    assert (converted / "zoo.json").stat().st_mtime_ns == stamp  # converted once
    bb = load_backbone("vit", str(converted))
    x = _images()
    with torch.no_grad():
        assert (bb.encode(bb.embed(x)).double() - reference(x)).abs().max() < ATOL
    (tmp_path / "run").mkdir()  # a run that started with another checkpoint under the same tag
    (tmp_path / "run" / "config.yaml").write_text(dump_config(load_config(cfg_path)))
    (tmp_path / "run" / "backbone.json").write_text(json.dumps({**plan.backbone.record, "sha256": "0" * 64}))
    with pytest.raises(RunDirError, match=r"is not the one run .* started with"):
        preflight(load_config(cfg_path))
    cfg_path.write_text(cfg_path.read_text().replace("dino_vitb16", "dino_vitb61"))
    with pytest.raises(BackboneError,
                       match=r"not a transformers directory, and backbone.tag 'dino_vitb61' is not a zoo tag"):
        preflight(load_config(cfg_path))


def test_openai_clip_resolves_with_a_tokenizer_and_hf_dirs_are_checked_against_their_tag(tmp_path, clip_backbone,
                                                                                         monkeypatch):
    """An OpenAI CLIP file under its tag needs the tokenizer files (the release has none); converted, it
    loads as the project's CLIP backbone with the release's image features. An HF directory named by a tag
    has its architecture checked against the tag, and a tag of the other kind is refused."""
    from mcit.models.clip import CLIPBackbone

    monkeypatch.setitem(Z.ZOO, "clip_vitb16_openai", tiny("clip_vitb16_openai"))
    sd = openai_clip()
    path = tmp_path / "ViT-B-16.pt"
    torch.save(sd, path)
    cache = str(tmp_path / "cache")
    with pytest.raises(BackboneError, match=r"needs backbone.tokenizer"):
        Z.resolve("clip", "clip_vitb16_openai", str(path), cache)
    out, record = Z.resolve("clip", "clip_vitb16_openai", str(path), cache, str(clip_backbone))
    assert record["format"] == "openai_clip" and record["sha256"] == Z.sha256_path(path)
    bb = CLIPBackbone.from_path(out)
    x = _images()
    want, _ = clip_reference(sd, x, torch.tensor([[VOCAB - 1]]))
    with torch.no_grad():
        got = bb.image_features(x, normalize=False).double()
    assert (got - want).abs().max() < ATOL
    assert bb.resample == 3 and torch.allclose(bb.mean.flatten(), torch.tensor(Z.CLIP_MEAN))
    with pytest.raises(BackboneError, match=r"does not match backbone tag 'clip_vitl14_openai': vision.hidden_size 32 "
                                            r"\(expected 1024\)"):
        Z.resolve("clip", "clip_vitl14_openai", str(clip_backbone), cache)
    with pytest.raises(BackboneError, match=r"'clip_vitb16_openai' is a clip backbone but backbone.kind is vit"):
        Z.resolve("vit", "clip_vitb16_openai", str(path), cache)


def test_a_tag_that_is_not_a_zoo_tag_is_refused_on_an_original_file_and_the_close_tags_are_named(tmp_path):
    """A typo in the tag (the words of a zoo tag in another order) on an original checkpoint file is refused before
    anything is read; on a transformers directory it loads as it is, with a warning naming the zoo tag it looks like."""
    original = tmp_path / "B_16-i21k.npz"
    original.write_bytes(b"not read")
    with pytest.raises(BackboneError, match=r"backbone.path .*B_16-i21k.npz is not a transformers directory, and "
                                            r"backbone.tag 'vit_b16_augreg_in21k' is not a zoo tag \(did you mean "
                                            r"vit_b16_in21k_augreg"):
        Z.resolve("vit", "vit_b16_augreg_in21k", str(original), str(tmp_path / "cache"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.warns(UserWarning, match=r"'vit_b16_augreg_in21k' is not a zoo tag.*did you mean vit_b16_in21k_augreg"):
        Z.resolve("vit", "vit_b16_augreg_in21k", str(hf), str(tmp_path / "cache"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tag of one's own that resembles no zoo tag is not a typo
        assert Z.resolve("vit", "my_lab_vit", str(hf), str(tmp_path / "cache"))[0] == hf
