"""Backbone zoo: pre-trained backbones named by tag, converted from their original checkpoint formats into
the transformers classes the project uses (``ViTModel``, ``CLIPModel``), checked key by key and shape by
shape, and cached as safetensors.

Why: results from different code bases differ partly because they silently load different ViTs
(ImageNet-21k vs 21k fine-tuned on 1k, augreg vs the original ViT paper's, supervised vs DINO / iBOT /
MoCo v3). A tag fixes the architecture, the checkpoint format and its key mapping, and the
preprocessing the papers' code uses; the file's sha256 is recorded with every run.

Formats (``ZooEntry.format``):

* ``jax_npz``: the original JAX checkpoints (google-research/vision_transformer ``ViT-B_16.npz``,
  augreg ``*.npz``, the SAM-optimised ``ViT-B_16.npz`` of "When Vision Transformers Outperform ResNets"):
  ``Transformer/encoderblock_{i}/MultiHeadDotProductAttention_1/{query,key,value}/kernel`` (D, H, hd), ...
* ``timm``: timm / DeiT-style state dicts (``.pth`` / ``.bin`` / ``.safetensors``): ``blocks.{i}.attn.qkv``
  fused (3D, D), ``blocks.{i}.norm1``, ``pos_embed``, ``cls_token``, ...
* ``dino``, ``ibot``, ``mocov3``: timm key names inside the self-supervised releases' wrappers
  (``teacher`` / ``state_dict`` entries, ``module.`` / ``backbone.`` / ``base_encoder.`` prefixes);
  projection heads (``head.*``) and MoCo's momentum encoder are dropped.
* ``openai_clip``: the OpenAI CLIP release (a TorchScript archive or its state dict): ``visual.conv1``,
  ``visual.transformer.resblocks.{i}.attn.in_proj_weight``, ``text_projection``, ...
* ``hf``: a transformers directory, loaded as it is (its architecture is still checked against the tag).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mcit.data.transforms import PIL_FILTER, BackbonePreprocessing
from mcit.models.base import BackboneError

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
VIT_B16 = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
           "patch_size": 16, "image_size": 224}


@dataclass(frozen=True)
class ZooEntry:
    """One tag: what the checkpoint is, how it is converted, and how its pre-training evaluated images (its own
    inference pipeline: what a run without a transform preset feeds it)."""

    tag: str
    kind: str  # vit | clip | llava
    format: str  # jax_npz | timm | dino | ibot | mocov3 | openai_clip | hf
    arch: dict[str, Any]
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    interpolation: str  # bicubic | bilinear: the release's evaluation resize
    papers: str
    obtain: str
    resize: int = 0  # the release's evaluation resize of the shorter side, before the central crop
    preprocessing_source: str = ""
    own_directory: bool = False  # the directory's own preprocessor config is the pipeline (the project's backbones)
    notes: str = ""
    layer_norm_eps: float = 1e-6
    extra: dict[str, Any] = field(default_factory=dict)

    def preprocessing(self) -> BackbonePreprocessing:
        """The release's own evaluation pipeline (checked against the release's code in
        tests/reference/test_preprocessing_reference.py)."""
        size = self.arch.get("image_size", self.arch.get("vision", {}).get("image_size", 224))
        return BackbonePreprocessing(int(size), self.resize or None, self.interpolation, tuple(self.image_mean),
                                     tuple(self.image_std), f"zoo tag {self.tag}: {self.preprocessing_source}")


# timm 0.9.12's pretrained_cfg of the ViT-B/16 releases: bicubic, crop_pct 0.9 (Resize(int(224 / 0.9)) + CenterCrop),
# mean / std 0.5 (the JAX releases' (x - 127.5) / 127.5). The prompt-based CIL code bases do not use it: their
# presets (mcit.data.transforms) carry their own pipelines and normalisation.
_TIMM_VIT = dict(image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), interpolation="bicubic", resize=248)
_TIMM = "timm 0.9.12 create_transform(resolve_data_config(pretrained_cfg of {}))"
# DINO's and iBOT's eval_linear / eval_knn val transform: Resize(256, bicubic) + CenterCrop(224), ImageNet mean / std
_SSL = dict(image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD, interpolation="bicubic", resize=256)

ZOO: dict[str, ZooEntry] = {e.tag: e for e in [
    ZooEntry("vit_b16_in21k", "vit", "jax_npz", VIT_B16, **_TIMM_VIT,
             preprocessing_source=_TIMM.format("vit_base_patch16_224.orig_in21k"),
             papers="HiDe-Prompt, NoRGa (Sup-21K); L2P / DualPrompt's JAX originals",
             obtain="https://storage.googleapis.com/vit_models/imagenet21k/ViT-B_16.npz (the original ViT paper's "
                    "ImageNet-21k ViT-B/16)",
             notes="the JAX repository itself evaluates with a 224 x 224 bilinear resize and no crop; timm's 248 + "
                   "centre crop is the one its PyTorch users (and this tag) get"),
    ZooEntry("vit_b16_in21k_augreg", "vit", "jax_npz", VIT_B16, **_TIMM_VIT,
             preprocessing_source=_TIMM.format("vit_base_patch16_224.augreg_in21k"),
             papers="VPT-NSP² (its scripts load timm vit_base_patch16_224.augreg_in21k)",
             obtain="https://storage.googleapis.com/vit_models/augreg/B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-"
                    "sd_0.0.npz, or timm's vit_base_patch16_224.augreg_in21k (format timm: use tag "
                    "vit_b16_in21k_augreg_timm)"),
    ZooEntry("vit_b16_in21k_augreg_timm", "vit", "timm", VIT_B16, **_TIMM_VIT,
             preprocessing_source=_TIMM.format("vit_base_patch16_224.augreg_in21k"),
             papers="as vit_b16_in21k_augreg, from timm's safetensors / .pth",
             obtain="huggingface.co/timm/vit_base_patch16_224.augreg_in21k (model.safetensors)"),
    ZooEntry("vit_b16_in21k_ft_in1k_augreg", "vit", "timm", VIT_B16, **_TIMM_VIT,
             preprocessing_source=_TIMM.format("vit_base_patch16_224.augreg2_in21k_ft_in1k (.augreg_in21k_ft_in1k: "
                                               "the same)"),
             papers="L2P, DualPrompt PyTorch ports (timm 0.6's vit_base_patch16_224 = augreg in21k fine-tuned on in1k)",
             obtain="huggingface.co/timm/vit_base_patch16_224.augreg2_in21k_ft_in1k or .augreg_in21k_ft_in1k "
                    "(model.safetensors)"),
    ZooEntry("sam_vitb16", "vit", "jax_npz", VIT_B16, **_TIMM_VIT,
             preprocessing_source=_TIMM.format("vit_base_patch16_224.sam_in1k"),
             papers="ViT-B/16 trained with sharpness-aware minimisation on ImageNet-1k "
                    "(timm vit_base_patch16_224.sam_in1k)",
             obtain="https://storage.googleapis.com/vit_models/sam/ViT-B_16.npz",
             notes="SAM = sharpness-aware minimisation (Chen et al. 2022), not Segment Anything, whose windowed "
                   "ViT is not a ViT-B/16 image classifier"),
    ZooEntry("dino_vitb16", "vit", "dino", VIT_B16, **_SSL,
             preprocessing_source="facebookresearch/dino 7c446df eval_linear.py val_transform / eval_knn.py "
                                  "(timm's vit_base_patch16_224.dino cfg says 248: not DINO's own)",
             papers="HiDe-Prompt, NoRGa (DINO-1K)",
             obtain="https://dl.fbaipublicfiles.com/dino/dino_vitbase16_pretrain/dino_vitbase16_pretrain.pth"),
    ZooEntry("ibot_vitb16", "vit", "ibot", VIT_B16, **_SSL,
             preprocessing_source="bytedance/ibot da316d8 evaluation/eval_knn.py extract_feature_pipeline "
                                  "(= eval_linear.py)",
             papers="HiDe-Prompt, NoRGa (iBOT-1K)",
             obtain="https://lf3-nlp-opensource.bytetos.com/obj/nlp-opensource/archive/2022/ibot/vitb_16/"
                    "checkpoint_teacher.pth"),
    ZooEntry("ibot_vitb16_in21k", "vit", "ibot", VIT_B16, **_SSL,
             preprocessing_source="bytedance/ibot da316d8 evaluation/eval_knn.py extract_feature_pipeline "
                                  "(= eval_linear.py)",
             papers="HiDe-Prompt, NoRGa (iBOT-21K)",
             obtain="https://lf3-nlp-opensource.bytetos.com/obj/nlp-opensource/archive/2022/ibot/vitb_16_pt22k/"
                    "checkpoint.pth (the teacher is used)"),
    ZooEntry("mocov3_vitb16", "vit", "mocov3", VIT_B16, IMAGENET_MEAN, IMAGENET_STD, "bilinear", resize=256,
             preprocessing_source="facebookresearch/moco-v3 c349e6e main_lincls.py val_loader (Resize(256) bilinear)",
             papers="HiDe-Prompt, NoRGa (MoCo-1K)",
             obtain="https://dl.fbaipublicfiles.com/moco-v3/vit-b-300ep/vit-b-300ep.pth.tar (base encoder)"),
    ZooEntry("clip_vitb16_openai", "clip", "openai_clip",
             {"vision": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                         "intermediate_size": 3072, "patch_size": 16, "image_size": 224},
              "text": {"hidden_size": 512, "num_hidden_layers": 12, "num_attention_heads": 8,
                       "intermediate_size": 2048, "vocab_size": 49408, "max_position_embeddings": 77},
              "projection_dim": 512},
             CLIP_MEAN, CLIP_STD, "bicubic", resize=224,
             preprocessing_source="openai/CLIP d05afc4 clip.py _transform(224)",
             papers="VPT-NSP² CLIP rows, STAR-Prompt (CLIP level)",
             obtain="openai/CLIP's ViT-B-16.pt (clip.available_models()), or the HF directory "
                    "openai/clip-vit-base-patch16 (tag clip_vitb16_openai, any HF directory loads as it is)",
             layer_norm_eps=1e-5),
    ZooEntry("clip_vitl14_openai", "clip", "openai_clip",
             {"vision": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                         "intermediate_size": 4096, "patch_size": 14, "image_size": 224},
              "text": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                       "intermediate_size": 3072, "vocab_size": 49408, "max_position_embeddings": 77},
              "projection_dim": 768},
             CLIP_MEAN, CLIP_STD, "bicubic", resize=224,
             preprocessing_source="openai/CLIP d05afc4 clip.py _transform(224)",
             papers="STAR-Prompt (CLIP ViT-L/14)",
             obtain="openai/CLIP's ViT-L-14.pt, or the HF directory openai/clip-vit-large-patch14",
             layer_norm_eps=1e-5),
    # The project's own pre-trained backbones (data_prep/): transformers directories whose size the builder's options
    # decide, so no fixed architecture, and their own preprocessor config is their pipeline.
    ZooEntry("tiny_vit_procedural", "vit", "hf", {}, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "bilinear",
             papers="the embedded CIL demo's ViT (data_prep/pretrain_vit.py)", obtain="make data-cil",
             preprocessing_source="its directory's preprocessor_config.json", own_directory=True),
    ZooEntry("tiny_clip_procedural", "clip", "hf", {}, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "bicubic",
             papers="the embedded CIL demo's CLIP (data_prep/pretrain_clip.py)", obtain="make data-cil",
             preprocessing_source="its directory's preprocessor_config.json", own_directory=True),
    ZooEntry("tiny-llava-procedural", "llava", "hf", {}, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "bicubic",
             papers="the embedded MCIT demo's LLaVA (data_prep/pretrain_tiny_llava.py)", obtain="make data",
             preprocessing_source="its processor", own_directory=True),
    ZooEntry("llava_v1.5_7b", "llava", "hf", {"text_hidden_size": 4096, "text_num_hidden_layers": 32},
             CLIP_MEAN, CLIP_STD, "bicubic", resize=336, preprocessing_source="its CLIPImageProcessor (336)",
             papers="Fwd-Prompt, CoIN, MCITlib (LLaVA-1.5-7B)",
             obtain="the HF directory llava-hf/llava-1.5-7b-hf, or an original one converted by "
                    "python -m data_prep.convert_llava", layer_norm_eps=1e-5),
    ZooEntry("llava_v1.5_13b", "llava", "hf", {"text_hidden_size": 5120, "text_num_hidden_layers": 40},
             CLIP_MEAN, CLIP_STD, "bicubic", resize=336, preprocessing_source="its CLIPImageProcessor (336)",
             papers="LLaVA-1.5-13B (MCITlib's larger backbone)",
             obtain="the HF directory llava-hf/llava-1.5-13b-hf, or an original one converted by "
                    "python -m data_prep.convert_llava", layer_norm_eps=1e-5),
    *[ZooEntry(f"llava_v1.5_{size}_original", "llava", "llava_original", arch, CLIP_MEAN, CLIP_STD, "bicubic",
               resize=336, preprocessing_source="LLaVA's expand2square + CLIPImageProcessor (336)",
               papers="MCITlib (liuhaotian/llava-v1.5-*), CoIN (Vicuna-v1.5 + the pre-training mm_projector.bin)",
               obtain=f"liuhaotian/llava-v1.5-{size} and openai/clip-vit-large-patch14-336 "
                      f"(or lmsys/vicuna-{size}-v1.5 + "
                      f"liuhaotian/llava-v1.5-mlp2x-336px-pretrain-vicuna-{size}-v1.5's mm_projector.bin)",
               extra={"converted_tag": f"llava_v1.5_{size}"})
      for size, arch in (("7b", {"text_hidden_size": 4096, "text_num_hidden_layers": 32}),
                         ("13b", {"text_hidden_size": 5120, "text_num_hidden_layers": 40}))],
]}

# Formats no run loads directly: one offline conversion makes a transformers directory of them.
CONVERT_OFFLINE = {"llava_original": "python -m data_prep.convert_llava --llava {path} --clip <CLIP directory> "
                                     "--out <new directory>"}


def close_tags(tag: str) -> list[str]:
    """Zoo tags a mistyped ``tag`` may have meant: the same words in another order, or a close spelling."""
    import difflib

    words = sorted(tag.lower().replace("-", "_").split("_"))
    same_words = [t for t in ZOO if sorted(t.split("_")) == words]
    return same_words + [t for t in difflib.get_close_matches(tag, list(ZOO), n=3, cutoff=0.75) if t not in same_words]


def _unknown(tag: str) -> str:
    close = close_tags(tag)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return f"backbone.tag {tag!r} is not a zoo tag ({hint}known tags: {', '.join(sorted(ZOO))})"


def entry(tag: str) -> ZooEntry:
    if tag not in ZOO:
        raise BackboneError(_unknown(tag))
    return ZOO[tag]


def preprocessing_of(kind: str, tag: str, directory: str) -> BackbonePreprocessing | None:
    """The backbone's own inference pipeline: its zoo tag's (whatever the directory's preprocessor config says:
    a converted cache written by an older version, or a directory made by hand), else the checkpoint
    directory's; None for a backbone kind that preprocesses by itself (the MLLMs)."""
    from mcit.models.base import PromptableImageEncoder, backbone_class

    cls = backbone_class(kind)
    if not issubclass(cls, PromptableImageEncoder):
        return None
    if tag in ZOO and ZOO[tag].kind == kind and not ZOO[tag].own_directory:
        return ZOO[tag].preprocessing()
    return cls.own_preprocessing(directory)


# --------------------------------------------------------------------------------------------------
# Reading original files

def sha256_path(path: Path) -> str:
    """sha256 of a checkpoint file, or of a directory's weight files (name + bytes, sorted by name)."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pth", ".pt", ".npz", ".json"))
    for f in files:
        if path.is_dir():
            h.update(f.name.encode())
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    return h.hexdigest()


def read_tensors(path: Path) -> dict[str, Any]:
    """The raw contents of a checkpoint file: safetensors, numpy .npz, a torch pickle (loaded with
    ``weights_only``; argparse namespaces, as in DINO / MoCo releases, are allowed) or a TorchScript
    archive (OpenAI CLIP's ``.pt``: its state dict)."""
    if not path.is_file():
        raise BackboneError(f"backbone checkpoint not found: {path}")
    suffix = "".join(path.suffixes[-2:]) if path.name.endswith(".pth.tar") else path.suffix
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            return dict(load_file(str(path)))
        if suffix == ".npz":
            with np.load(path) as z:
                return {k: torch.from_numpy(np.array(z[k])) for k in z.files}
        if zipfile.is_zipfile(path) and _is_torchscript(path):
            return {k: v for k, v in torch.jit.load(str(path), map_location="cpu").state_dict().items()}
        import argparse

        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except BackboneError:
        raise
    except Exception as e:  # noqa: BLE001 - one line naming the file
        raise BackboneError(f"cannot read backbone checkpoint {path}: {str(e).splitlines()[0][:300]}") from None


def _is_torchscript(path: Path) -> bool:
    with zipfile.ZipFile(path) as z:
        return any(n.endswith("constants.pkl") or "/code/" in n for n in z.namelist())


# --------------------------------------------------------------------------------------------------
# Key mappings

def _strip(sd: dict[str, Any], prefixes: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for k, v in sd.items():
        changed = True
        while changed:
            changed = False
            for p in prefixes:
                if k.startswith(p):
                    k, changed = k[len(p):], True
        out[k] = v
    return out


def unwrap_self_supervised(raw: dict[str, Any], fmt: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The backbone's timm-named tensors out of a DINO / iBOT / MoCo v3 release; returns (tensors, dropped keys)."""
    sd = raw
    for key in ("teacher", "state_dict", "model"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
            break
    if fmt == "mocov3":
        if any(k.startswith("module.base_encoder.") for k in sd):
            sd = {k: v for k, v in sd.items() if k.startswith("module.base_encoder.")}
        sd = _strip(sd, ("module.", "base_encoder."))
    else:
        sd = _strip(sd, ("module.", "backbone."))
    dropped = [k for k in sd if k.startswith("head.") or k.startswith("head_") or not torch.is_tensor(sd[k])]
    return {k: v for k, v in sd.items() if k not in dropped}, dropped


def jax_npz_to_timm(npz: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """JAX ViT arrays -> timm key names and layouts; returns (tensors, dropped keys: head, pre_logits)."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(k: str) -> torch.Tensor:
        if k not in npz:
            raise KeyError(k)
        used.add(k)
        return npz[k].float()

    out["patch_embed.proj.weight"] = take("embedding/kernel").permute(3, 2, 0, 1).contiguous()  # HWIO -> OIHW
    out["patch_embed.proj.bias"] = take("embedding/bias")
    out["cls_token"] = take("cls")
    out["pos_embed"] = take("Transformer/posembed_input/pos_embedding")
    i = 0
    while f"Transformer/encoderblock_{i}/LayerNorm_0/scale" in npz:
        b = f"Transformer/encoderblock_{i}"
        a = f"{b}/MultiHeadDotProductAttention_1"
        t = f"blocks.{i}"
        out[f"{t}.norm1.weight"], out[f"{t}.norm1.bias"] = take(f"{b}/LayerNorm_0/scale"), take(f"{b}/LayerNorm_0/bias")
        qkv_w = [take(f"{a}/{n}/kernel") for n in ("query", "key", "value")]  # (D, H, hd)
        qkv_b = [take(f"{a}/{n}/bias") for n in ("query", "key", "value")]  # (H, hd)
        out[f"{t}.attn.qkv.weight"] = torch.cat([w.flatten(1).t() for w in qkv_w])
        out[f"{t}.attn.qkv.bias"] = torch.cat([bb.flatten() for bb in qkv_b])
        o = take(f"{a}/out/kernel")  # (H, hd, D)
        out[f"{t}.attn.proj.weight"] = o.flatten(0, 1).t()
        out[f"{t}.attn.proj.bias"] = take(f"{a}/out/bias")
        out[f"{t}.norm2.weight"], out[f"{t}.norm2.bias"] = take(f"{b}/LayerNorm_2/scale"), take(f"{b}/LayerNorm_2/bias")
        for j, name in ((0, "fc1"), (1, "fc2")):
            out[f"{t}.mlp.{name}.weight"] = take(f"{b}/MlpBlock_3/Dense_{j}/kernel").t()
            out[f"{t}.mlp.{name}.bias"] = take(f"{b}/MlpBlock_3/Dense_{j}/bias")
        i += 1
    out["norm.weight"], out["norm.bias"] = take("Transformer/encoder_norm/scale"), take("Transformer/encoder_norm/bias")
    return out, sorted(set(npz) - used)


def timm_to_hf_vit(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
    """timm ViT tensors -> (transformers ViTModel state dict, the architecture read from the shapes,
    dropped keys: classifier and pre-logits heads). Unknown keys are an error listing them."""
    sd = dict(sd)
    dropped = sorted(k for k in sd if k.split(".")[0] in ("head", "pre_logits", "fc_norm", "head_drop"))
    if "fc_norm.weight" in sd:
        raise BackboneError("the checkpoint has fc_norm (global-average-pooled ViT); the project's ViT uses the "
                            "[CLS] token after the final norm")
    for k in dropped:
        sd.pop(k)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(k: str) -> torch.Tensor:
        used.add(k)
        return sd[k].float()

    w = take("patch_embed.proj.weight")
    hidden, patch = w.shape[0], w.shape[-1]
    out["embeddings.patch_embeddings.projection.weight"] = w
    out["embeddings.patch_embeddings.projection.bias"] = take("patch_embed.proj.bias")
    out["embeddings.cls_token"] = take("cls_token").reshape(1, 1, hidden)
    pos = take("pos_embed").reshape(1, -1, hidden)
    out["embeddings.position_embeddings"] = pos
    layers = 0
    while f"blocks.{layers}.norm1.weight" in sd:
        t, h = f"blocks.{layers}", f"layers.{layers}"
        q, k, v = take(f"{t}.attn.qkv.weight").chunk(3)
        qb, kb, vb = take(f"{t}.attn.qkv.bias").chunk(3)
        for name, ww, bb in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
            out[f"{h}.attention.{name}.weight"], out[f"{h}.attention.{name}.bias"] = ww.contiguous(), bb.contiguous()
        out[f"{h}.attention.o_proj.weight"] = take(f"{t}.attn.proj.weight")
        out[f"{h}.attention.o_proj.bias"] = take(f"{t}.attn.proj.bias")
        for src, dst in (("norm1", "layernorm_before"), ("norm2", "layernorm_after")):
            out[f"{h}.{dst}.weight"], out[f"{h}.{dst}.bias"] = take(f"{t}.{src}.weight"), take(f"{t}.{src}.bias")
        for name in ("fc1", "fc2"):
            out[f"{h}.mlp.{name}.weight"] = take(f"{t}.mlp.{name}.weight")
            out[f"{h}.mlp.{name}.bias"] = take(f"{t}.mlp.{name}.bias")
        layers += 1
    out["layernorm.weight"], out["layernorm.bias"] = take("norm.weight"), take("norm.bias")
    unexpected = sorted(set(sd) - used)
    if unexpected:
        raise BackboneError(f"unexpected keys in the ViT checkpoint: {', '.join(unexpected[:12])}"
                            + (f" (+{len(unexpected) - 12} more)" if len(unexpected) > 12 else ""))
    n_patches = pos.shape[1] - 1
    side = int(round(n_patches ** 0.5))
    arch = {"hidden_size": int(hidden), "num_hidden_layers": layers,
            "intermediate_size": int(out["layers.0.mlp.fc1.weight"].shape[0]) if layers else 0,
            "patch_size": int(patch), "image_size": int(side * patch)}
    return out, arch, dropped


def openai_clip_to_hf(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[str]]:
    """OpenAI CLIP tensors -> (transformers CLIPModel state dict, architecture from the shapes, dropped keys)."""
    sd = {k: v for k, v in sd.items()}
    dropped = sorted(k for k in sd if k in ("input_resolution", "context_length", "vocab_size"))
    for k in dropped:
        sd.pop(k)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(k: str) -> torch.Tensor:
        used.add(k)
        return sd[k].float()

    def blocks(src: str, dst: str) -> int:
        n = 0
        while f"{src}.{n}.ln_1.weight" in sd:
            s, d = f"{src}.{n}", f"{dst}.{n}"
            q, k, v = take(f"{s}.attn.in_proj_weight").chunk(3)
            qb, kb, vb = take(f"{s}.attn.in_proj_bias").chunk(3)
            for name, ww, bb in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
                out[f"{d}.self_attn.{name}.weight"] = ww.contiguous()
                out[f"{d}.self_attn.{name}.bias"] = bb.contiguous()
            out[f"{d}.self_attn.out_proj.weight"] = take(f"{s}.attn.out_proj.weight")
            out[f"{d}.self_attn.out_proj.bias"] = take(f"{s}.attn.out_proj.bias")
            for a, b in (("ln_1", "layer_norm1"), ("ln_2", "layer_norm2")):
                out[f"{d}.{b}.weight"], out[f"{d}.{b}.bias"] = take(f"{s}.{a}.weight"), take(f"{s}.{a}.bias")
            for a, b in (("c_fc", "fc1"), ("c_proj", "fc2")):
                out[f"{d}.mlp.{b}.weight"] = take(f"{s}.mlp.{a}.weight")
                out[f"{d}.mlp.{b}.bias"] = take(f"{s}.mlp.{a}.bias")
            n += 1
        return n

    conv = take("visual.conv1.weight")
    out["vision_model.embeddings.patch_embedding.weight"] = conv
    out["vision_model.embeddings.class_embedding"] = take("visual.class_embedding")
    out["vision_model.embeddings.position_embedding.weight"] = take("visual.positional_embedding")
    for a, b in (("visual.ln_pre", "vision_model.pre_layrnorm"), ("visual.ln_post", "vision_model.post_layernorm"),
                 ("ln_final", "text_model.final_layer_norm")):
        out[f"{b}.weight"], out[f"{b}.bias"] = take(f"{a}.weight"), take(f"{a}.bias")
    v_layers = blocks("visual.transformer.resblocks", "vision_model.encoder.layers")
    t_layers = blocks("transformer.resblocks", "text_model.encoder.layers")
    out["visual_projection.weight"] = take("visual.proj").t().contiguous()  # x @ proj  ==  Linear(proj^T)
    out["text_projection.weight"] = take("text_projection").t().contiguous()
    out["text_model.embeddings.token_embedding.weight"] = take("token_embedding.weight")
    out["text_model.embeddings.position_embedding.weight"] = take("positional_embedding")
    out["logit_scale"] = take("logit_scale").reshape(())
    unexpected = sorted(set(sd) - used)
    if unexpected:
        raise BackboneError(f"unexpected keys in the CLIP checkpoint: {', '.join(unexpected[:12])}"
                            + (f" (+{len(unexpected) - 12} more)" if len(unexpected) > 12 else ""))
    vh, th = conv.shape[0], out["text_model.embeddings.token_embedding.weight"].shape[1]
    n_pos = out["vision_model.embeddings.position_embedding.weight"].shape[0] - 1
    arch = {"vision": {"hidden_size": int(vh), "num_hidden_layers": v_layers, "patch_size": int(conv.shape[-1]),
                       "intermediate_size": int(out["vision_model.encoder.layers.0.mlp.fc1.weight"].shape[0]),
                       "image_size": int(round(n_pos ** 0.5)) * int(conv.shape[-1])},
            "text": {"hidden_size": int(th), "num_hidden_layers": t_layers,
                     "intermediate_size": int(out["text_model.encoder.layers.0.mlp.fc1.weight"].shape[0]),
                     "vocab_size": int(out["text_model.embeddings.token_embedding.weight"].shape[0]),
                     "max_position_embeddings": int(out["text_model.embeddings.position_embedding.weight"].shape[0])},
            "projection_dim": int(out["visual_projection.weight"].shape[0])}
    return out, arch, dropped


# --------------------------------------------------------------------------------------------------
# Building the transformers model

def _check_arch(tag: str, expected: dict[str, Any], found: dict[str, Any], path: Path) -> None:
    """Every architecture number the tag names must match what the checkpoint's shapes say."""
    bad = []
    for k, v in expected.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                got = found.get(k, {}).get(kk)
                if got is not None and got != vv:
                    bad.append(f"{k}.{kk} {got} (expected {vv})")
        elif k in found and found[k] != v:
            bad.append(f"{k} {found[k]} (expected {v})")
    if bad:
        raise BackboneError(f"{path} does not match backbone tag {tag!r}: {'; '.join(bad)}")


def _load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Load ``state`` into ``model``: every key present, none extra, every shape equal -- or one error listing them."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(f"{k} {tuple(state[k].shape)} (model {tuple(own[k].shape)})"
                    for k in set(own) & set(state) if tuple(own[k].shape) != tuple(state[k].shape))
    problems = [f"missing keys: {', '.join(missing[:10])}" + (f" (+{len(missing) - 10})" if len(missing) > 10 else "")
                if missing else "",
                f"unexpected keys: {', '.join(unexpected[:10])}" if unexpected else "",
                f"wrong shapes: {', '.join(shapes[:10])}" if shapes else ""]
    problems = [p for p in problems if p]
    if problems:
        raise BackboneError(f"checkpoint {path} does not fit the converted model: {'; '.join(problems)}")
    model.load_state_dict(state, strict=True)


def build_vit(state: dict[str, torch.Tensor], arch: dict[str, Any], heads: int, eps: float, path: Path):
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(hidden_size=arch["hidden_size"], num_hidden_layers=arch["num_hidden_layers"],
                    num_attention_heads=heads, intermediate_size=arch["intermediate_size"],
                    patch_size=arch["patch_size"], image_size=arch["image_size"], layer_norm_eps=eps,
                    hidden_act="gelu", qkv_bias=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = ViTModel(cfg, add_pooling_layer=False)
    _load_strict(model, state, path)
    return model.eval()


def build_clip(state: dict[str, torch.Tensor], arch: dict[str, Any], heads: tuple[int, int], eps: float, path: Path):
    from transformers import CLIPConfig, CLIPModel

    v, t = arch["vision"], arch["text"]
    cfg = CLIPConfig(
        vision_config=dict(hidden_size=v["hidden_size"], num_hidden_layers=v["num_hidden_layers"],
                           num_attention_heads=heads[0], intermediate_size=v["intermediate_size"],
                           patch_size=v["patch_size"], image_size=v["image_size"], layer_norm_eps=eps,
                           hidden_act="quick_gelu"),
        text_config=dict(hidden_size=t["hidden_size"], num_hidden_layers=t["num_hidden_layers"],
                         num_attention_heads=heads[1], intermediate_size=t["intermediate_size"],
                         vocab_size=t["vocab_size"], max_position_embeddings=t["max_position_embeddings"],
                         layer_norm_eps=eps, hidden_act="quick_gelu",
                         # OpenAI CLIP pools the text at its end-of-text token, the largest id of the vocabulary
                         eos_token_id=t["vocab_size"] - 1, bos_token_id=t["vocab_size"] - 2, pad_token_id=0),
        projection_dim=arch["projection_dim"])
    model = CLIPModel(cfg)
    _load_strict(model, state, path)
    return model.eval()


@dataclass
class Converted:
    model: torch.nn.Module
    entry: ZooEntry
    sha256: str
    dropped: list[str]


def convert(tag: str, path: str | Path, *, entry_override: ZooEntry | None = None) -> Converted:
    """Read the original checkpoint at ``path`` for ``tag`` and return the transformers model, checked."""
    e = entry_override or entry(tag)
    path = Path(path)
    if e.format == "hf":
        raise BackboneError(f"backbone tag {tag!r} is an HF directory; it loads as it is")
    raw = read_tensors(path)
    digest = sha256_path(path)
    try:
        if e.format == "openai_clip":
            state, arch, dropped = openai_clip_to_hf(raw)
            _check_arch(tag, e.arch, arch, path)
            heads = (e.arch["vision"]["num_attention_heads"], e.arch["text"]["num_attention_heads"])
            return Converted(build_clip(state, arch, heads, e.layer_norm_eps, path), e, digest, dropped)
        if e.format == "jax_npz":
            sd, dropped = jax_npz_to_timm(raw)
        elif e.format in ("dino", "ibot", "mocov3"):
            sd, dropped = unwrap_self_supervised(raw, e.format)
        elif e.format == "timm":
            sd, dropped = dict(raw.get("state_dict", raw.get("model", raw))), []
        else:
            raise BackboneError(f"backbone tag {tag!r}: unknown format {e.format!r}")
        state, arch, more = timm_to_hf_vit(sd)
    except KeyError as err:
        raise BackboneError(f"checkpoint {path} is not a {e.format} {e.kind} checkpoint for tag {tag!r}: "
                            f"missing key {err.args[0]!r}") from None
    _check_arch(tag, e.arch, arch, path)
    return Converted(build_vit(state, arch, e.arch["num_attention_heads"], e.layer_norm_eps, path), e, digest,
                     dropped + more)


def export_hf(conv: Converted, out: Path, tokenizer: Path | None = None) -> Path:
    """Write the converted model as a transformers directory (safetensors, config, the tag's preprocessing)
    atomically; returns ``out``."""
    tmp = out.with_name(out.name + f".partial{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    conv.model.save_pretrained(str(tmp), safe_serialization=True)
    e = conv.entry
    pre = e.preprocessing()
    (tmp / "preprocessor_config.json").write_text(json.dumps({  # transformers' CLIP image processor keys
        "image_mean": list(pre.mean), "image_std": list(pre.std), "do_normalize": True, "do_rescale": True,
        "resample": PIL_FILTER[pre.interpolation], "do_resize": True,
        "size": {"shortest_edge": pre.resize or pre.size}, "do_center_crop": True,
        "crop_size": {"height": pre.size, "width": pre.size}}, indent=1))
    if tokenizer is not None:  # CLIP: the text side's tokenizer files (the OpenAI file has none)
        _copy_tokenizer(tokenizer, tmp)
    (tmp / "zoo.json").write_text(json.dumps({"tag": e.tag, "format": e.format, "source_sha256": conv.sha256,
                                              "dropped_keys": conv.dropped}, indent=1))
    from mcit.core.checkpoint import publish_dir

    publish_dir(tmp, out)
    return out



# --------------------------------------------------------------------------------------------------
# Resolving a config's backbone

def _hf_dir(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file()


def cached_sha256(path: Path, cache_dir: Path) -> str:
    """sha256_path, remembered in ``cache_dir/sha256_index.json`` by (path, sizes, mtimes): a 14 GB
    LLaVA directory is hashed once, not at every start."""
    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file())
    stamp = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    index_path = cache_dir / "sha256_index.json"
    try:
        index = json.loads(index_path.read_text()) if index_path.is_file() else {}
    except json.JSONDecodeError:
        index = {}
    key = str(path.resolve())
    if index.get(key, {}).get("stamp") == stamp:
        return index[key]["sha256"]
    digest = sha256_path(path)
    index[key] = {"stamp": stamp, "sha256": digest}
    try:
        from mcit.core.checkpoint import atomic_write_text

        atomic_write_text(index_path, json.dumps(index, indent=1))
    except OSError:
        pass  # a read-only cache only costs the hashing next time
    return digest


def _check_hf_arch(e: ZooEntry, directory: Path) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    if e.kind == "vit":
        found = {k: cfg.get(k) for k in e.arch}
    elif e.kind == "clip":
        found = {"vision": cfg.get("vision_config", {}), "text": cfg.get("text_config", {}),
                 "projection_dim": cfg.get("projection_dim")}
    else:
        text = cfg.get("text_config", {})
        found = {"text_hidden_size": text.get("hidden_size"), "text_num_hidden_layers": text.get("num_hidden_layers")}
    found = {k: v for k, v in found.items() if v is not None}
    _check_arch(e.tag, e.arch, found, directory)


def resolve(kind: str, tag: str, path: str, cache_dir: str, tokenizer: str | None = None) -> tuple[Path, dict]:
    """The transformers directory a run loads for ``backbone`` and the record of what it is.

    A zoo tag with an original checkpoint file converts it once into ``cache_dir/<tag>-<sha[:16]>``
    (under a file lock: every rank of a launch may call this); a zoo tag with an HF directory has its
    architecture checked against the tag; any other tag names an HF directory as it is. The record
    (tag, format, source path and sha256, loaded directory) goes into the run directory and metrics."""
    from mcit.core.locks import LockTimeout, flock_within

    p = Path(path)
    cache = Path(cache_dir)
    if tag not in ZOO:
        if not _hf_dir(p):
            if not p.exists():
                raise BackboneError(f"backbone path not found: {p} (and {_unknown(tag)})")
            raise BackboneError(f"backbone.path {p} is not a transformers directory, and {_unknown(tag)}")
        close = close_tags(tag)
        if close:
            import warnings

            warnings.warn(f"backbone.tag {tag!r} is not a zoo tag, so {p} loads as it is, with no architecture check "
                          f"and its own preprocessor config; did you mean {' or '.join(close)}?", stacklevel=2)
        return p, {"tag": tag, "format": "hf", "source": str(p), "sha256": cached_sha256(p, cache),
                   "loaded_from": str(p)}
    e = ZOO[tag]
    if e.kind != kind:
        raise BackboneError(f"backbone.tag {tag!r} is a {e.kind} backbone but backbone.kind is {kind}")
    if e.format in CONVERT_OFFLINE:
        raise BackboneError(f"backbone tag {tag!r} is the original {e.format} layout, which no run loads: convert it "
                            f"once with `{CONVERT_OFFLINE[e.format].format(path=p)}` and use tag "
                            f"{e.extra['converted_tag']} with the new directory")
    if _hf_dir(p):
        _check_hf_arch(e, p)
        return p, {"tag": tag, "format": "hf", "source": str(p), "sha256": cached_sha256(p, cache),
                   "loaded_from": str(p)}
    if e.format == "hf":
        raise BackboneError(f"backbone tag {tag!r} loads a transformers directory; {p} is not one")
    if not p.is_file():
        raise BackboneError(f"backbone checkpoint not found: {p} (backbone tag {tag!r}: {e.obtain})")
    if e.kind == "clip" and not tokenizer:
        raise BackboneError(f"backbone tag {tag!r} from the OpenAI file needs backbone.tokenizer: a directory with the "
                            f"CLIP tokenizer files (vocab.json + merges.txt or tokenizer.json, e.g. from "
                            f"openai/clip-vit-base-patch16)")
    digest = cached_sha256(p, cache)
    out = cache / f"{tag}-{digest[:16]}"
    cache.mkdir(parents=True, exist_ok=True)
    lock_path = cache / f".{tag}-{digest[:16]}.lock"
    with open(lock_path, "a+") as lock:  # every rank may get here: one converts, the others wait (bounded)
        timeout = float(os.environ.get("MCIT_CONVERT_LOCK_TIMEOUT_S", 7200))
        try:
            flock_within(lock.fileno(), lock_path, timeout, f"converting {p} to {out}", "MCIT_CONVERT_LOCK_TIMEOUT_S")
        except LockTimeout as e:
            raise BackboneError(str(e)) from None
        if not (out / "zoo.json").is_file():
            export_hf(convert(tag, p), out, Path(tokenizer) if tokenizer else None)
    return out, {"tag": tag, "format": e.format, "source": str(p), "sha256": digest, "loaded_from": str(out)}


def _copy_tokenizer(src: Path, out: Path) -> None:
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")
    found = [n for n in names if (src / n).is_file()]
    if not ({"tokenizer.json"} & set(found) or {"vocab.json", "merges.txt"} <= set(found)):
        raise BackboneError(f"backbone.tokenizer {src} has neither tokenizer.json nor vocab.json + merges.txt")
    for n in found:
        shutil.copyfile(src / n, out / n)
