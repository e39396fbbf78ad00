"""Every multimodal-LLM family but LLaVA-1.5 (``bench/llava7b_step.py``) at its published size, random weights:
the architecture without weights (any machine), and where CUDA is present one ZeRO-2 bf16 training step of the
method (default Fwd-Prompt) with throughput, memory and MFU, and greedy generation through the method's ``generate``
(what the eval stage calls) against transformers' ``generate`` on the same inputs.

    python bench/family_step.py                                     # meta builds: parameter counts, every family
    python bench/family_step.py --family qwen3_vl --tiny-layers 1 --batch 1 --steps 1 --generate 4 --rounds 1
                                     # real widths, 1 layer, fp32 on CPU: one step and a generation (the code path)
    deepspeed --num_gpus 1 bench/family_step.py --family all --steps 5 --batch 4 --generate 32   # on a GPU

Families (``--family``, repeatable, or ``all``): qwen2_vl (Qwen2-VL-7B), qwen2_5_vl (Qwen2.5-VL-7B), qwen3_vl
(Qwen3-VL-8B), internvl (InternVL3-8B-hf), llava_onevision (LLaVA-OneVision-Qwen2-7B), instructblip
(InstructBLIP-Vicuna-7B). Each is built from the family's own tiny model (``Family.tiny``: config classes, tokenizer,
processor) with the sizes of the published checkpoint's config.json written over the tiny config (the dicts below;
the tiny tokenizer's special-token ids stay, the vocabulary is the real one's size), and its processor set to the
checkpoint's image size: a 448 x 448 image for the Qwen families (256 merged tokens at patch 14, 196 at Qwen3-VL's
patch 16), one 448 tile for InternVL, a 384 image for OneVision (anyres: base crop + a 1 x 1 grid), 224 for
InstructBLIP (32 query tokens). The batch is the family's own collate of chat-formatted samples (``--text-tokens``
words of question and answer), so the LLM tokens per sample are the ones a real run has.

On a GPU each family prints ms/step, samples/s, tokens/s, peak memory and model FLOPs utilisation (MFU) against
``--peak-tflops`` (default 989, H100 SXM dense bf16): 6 N T for the language model (the usual convention, as if
every weight had a gradient; N without the input embedding, the output head included) plus 2 N T for the vision
side (tower, merger / projector / Q-Former: forward only), T its tokens per sample (ViT patches for the vision
side); "needed" FLOPs count 4 N T for the frozen LLM, as ``llava7b_step`` does. Then greedy generation of
``--generate`` new tokens for the evaluation collate of the same samples, method vs transformers, median of
``--rounds`` after a warm-up round. Each family's model is freed before the next (one 80 GB H100 runs them in turn),
and a family that fails prints ``FAILED family: error`` and the others go on.

Without CUDA the meta builds run (frozen / trainable parameter counts); ``--tiny-layers N`` builds the real widths
with N layers (LLM, vision tower, Q-Former; window / deepstack indexes mapped into them) in float32 on the CPU and
runs the same step (ZeRO-2 fp32 through DeepSpeed's CPU accelerator, one process) and generation.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# -- the published configs (config.json; the hub is not reachable here) ----------------------------------------------
# Qwen/Qwen2-VL-7B-Instruct
QWEN2_VL_7B: dict[str, Any] = {
    "vision_config": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "hidden_act": "quick_gelu"},
    "text_config": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24],
                                                              "rope_theta": 1e6}},
    "tie_word_embeddings": False,
}
# Qwen/Qwen2.5-VL-7B-Instruct
QWEN2_5_VL_7B: dict[str, Any] = {
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14,
                      "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "hidden_act": "silu"},
    "text_config": {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000,
                    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24],
                                                              "rope_theta": 1e6}},
    "tie_word_embeddings": False,
}
# Qwen/Qwen3-VL-8B-Instruct
QWEN3_VL_8B: dict[str, Any] = {
    "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 4096,
                      "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
                      "hidden_act": "gelu_pytorch_tanh"},
    "text_config": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                    "rope_parameters": {"rope_type": "default", "mrope_section": [24, 20, 20],
                                        "mrope_interleaved": True, "rope_theta": 5e6}},
    "tie_word_embeddings": False,
}
# OpenGVLab/InternVL3-8B-hf (InternViT-300M-448px-V2.5 + Qwen2.5-7B), what mcit/models/internvl.py loads
INTERNVL3_8B: dict[str, Any] = {
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "image_size": [448, 448], "patch_size": [14, 14],
                      "attention_bias": True, "use_qk_norm": False, "norm_type": "layer_norm",
                      "layer_norm_eps": 1e-6, "layer_scale_init_value": 0.1, "hidden_act": "gelu"},
    "text_config": {"vocab_size": 151674, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "image_seq_length": 256, "downsample_ratio": 0.5, "projector_hidden_act": "gelu", "vision_feature_layer": -1,
    "tie_word_embeddings": False,
}
# llava-hf/llava-onevision-qwen2-7b-ov-hf (SigLIP so400m-patch14-384 without its last layer and head + Qwen2-7B)
ONEVISION_PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]
LLAVA_ONEVISION_7B: dict[str, Any] = {
    "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 26,
                      "num_attention_heads": 16, "image_size": 384, "patch_size": 14, "vision_use_head": False,
                      "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
    "text_config": {"vocab_size": 152128, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "image_grid_pinpoints": ONEVISION_PINPOINTS, "vision_aspect_ratio": "anyres_max_9",
    "vision_feature_select_strategy": "full", "vision_feature_layer": -1, "projector_hidden_act": "gelu",
    "multimodal_projector_bias": True, "tie_word_embeddings": False,
}
# Salesforce/instructblip-vicuna-7b (EVA ViT-g/14 at 224, Q-Former, Vicuna-7B; vocab with the added <image> token)
INSTRUCTBLIP_VICUNA_7B: dict[str, Any] = {
    "vision_config": {"hidden_size": 1408, "intermediate_size": 6144, "num_hidden_layers": 39,
                      "num_attention_heads": 16, "image_size": 224, "patch_size": 14, "qkv_bias": True,
                      "layer_norm_eps": 1e-6, "hidden_act": "gelu"},
    "qformer_config": {"vocab_size": 30523, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                       "intermediate_size": 3072, "max_position_embeddings": 512, "cross_attention_frequency": 2,
                       "encoder_hidden_size": 1408},
    "text_config": {"vocab_size": 32002, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
                    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "num_query_tokens": 32,
}
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
# Where a parameter is on the vision side (tower, merger / projector, Q-Former): forward only, 2 N T.
VISION_PARTS = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "qformer", "query_tokens",
                "language_projection", "image_newline")
ANSWER_WORDS = 16


# -- the families ----------------------------------------------------------------------------------------------------
def _qwen_processor(patch: int, mean: list[float], std: list[float]) -> Callable[[Any, int], Any]:
    def make(tiny_processor: Any, image_px: int) -> Any:
        from mcit.models.qwen2_5_vl import qwen_image_processor

        tiny_processor.image_processor = qwen_image_processor(patch, mean, std, image_size=image_px)
        return tiny_processor

    return make


def _internvl_processor(tiny_processor: Any, image_px: int) -> Any:
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from mcit.models.internvl import INTERNVL_TEMPLATE, InternVLImageTokenProcessor

    tile = INTERNVL3_8B["vision_config"]["image_size"][0]
    images = GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=False, min_patches=1,
                                      max_patches=12, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)
    return InternVLImageTokenProcessor(tiny_processor.tokenizer, images, INTERNVL3_8B["image_seq_length"],
                                       INTERNVL_TEMPLATE)


def _onevision_processor(tiny_processor: Any, image_px: int) -> Any:
    from transformers.models.llava_onevision import LlavaOnevisionImageProcessorPil

    from mcit.models.llava_onevision import ONEVISION_TEMPLATE, AnyresImageTokenProcessor

    v = LLAVA_ONEVISION_7B["vision_config"]
    crop = v["image_size"]
    images = LlavaOnevisionImageProcessorPil(size={"height": crop, "width": crop},
                                             image_grid_pinpoints=ONEVISION_PINPOINTS, image_mean=[0.5] * 3,
                                             image_std=[0.5] * 3)
    return AnyresImageTokenProcessor(tiny_processor.tokenizer, images,
                                     num_image_tokens=(crop // v["patch_size"]) ** 2,
                                     vision_feature_select_strategy="full",
                                     vision_aspect_ratio=LLAVA_ONEVISION_7B["vision_aspect_ratio"],
                                     chat_template=ONEVISION_TEMPLATE)


def _instructblip_processor(tiny_processor: Any, image_px: int) -> Any:
    from transformers import InstructBlipProcessor
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    size = INSTRUCTBLIP_VICUNA_7B["vision_config"]["image_size"]
    images = BlipImageProcessorPil(size={"height": size, "width": size}, image_mean=CLIP_MEAN, image_std=CLIP_STD,
                                   do_convert_rgb=True)
    return InstructBlipProcessor(image_processor=images, tokenizer=tiny_processor.tokenizer,
                                 qformer_tokenizer=tiny_processor.qformer_tokenizer,
                                 num_query_tokens=INSTRUCTBLIP_VICUNA_7B["num_query_tokens"])


def _qwen_vision_tokens(batch: Any, cfg: Any) -> float:
    """ViT patches per sample (the merger then sees a quarter of them)."""
    return float(batch.inputs["image_grid_thw"].prod(-1).float().mean())


def _internvl_vision_tokens(batch: Any, cfg: Any) -> float:
    v = cfg.vision_config
    return float(batch.inputs["num_tiles"].float().mean()) * ((v.image_size[0] // v.patch_size[0]) ** 2 + 1)


def _onevision_vision_tokens(batch: Any, cfg: Any) -> float:
    v = cfg.vision_config
    return float(batch.inputs["image_patches"].float().mean()) * (v.image_size // v.patch_size) ** 2


def _instructblip_vision_tokens(batch: Any, cfg: Any) -> float:
    v = cfg.vision_config
    return float((v.image_size // v.patch_size) ** 2 + 1)


@dataclass
class Family:
    kind: str  # the backbone kind (mcit/models/<kind>.py) and --family name
    label: str
    hub_id: str
    spec: dict[str, Any]
    image_px: int  # the side of the sample images
    processor: Callable[[Any, int], Any]  # (tiny processor, image side) -> the checkpoint-size processor
    vision_tokens: Callable[[Any, Any], float]  # (train batch, config) -> ViT tokens per sample


FAMILIES: dict[str, Family] = {f.kind: f for f in [
    Family("qwen2_vl", "Qwen2-VL-7B", "Qwen/Qwen2-VL-7B-Instruct", QWEN2_VL_7B, 448,
           _qwen_processor(14, CLIP_MEAN, CLIP_STD), _qwen_vision_tokens),
    Family("qwen2_5_vl", "Qwen2.5-VL-7B", "Qwen/Qwen2.5-VL-7B-Instruct", QWEN2_5_VL_7B, 448,
           _qwen_processor(14, CLIP_MEAN, CLIP_STD), _qwen_vision_tokens),
    Family("qwen3_vl", "Qwen3-VL-8B", "Qwen/Qwen3-VL-8B-Instruct", QWEN3_VL_8B, 448,
           _qwen_processor(16, [0.5] * 3, [0.5] * 3), _qwen_vision_tokens),
    Family("internvl", "InternVL3-8B", "OpenGVLab/InternVL3-8B-hf", INTERNVL3_8B, 448, _internvl_processor,
           _internvl_vision_tokens),
    Family("llava_onevision", "LLaVA-OneVision-7B", "llava-hf/llava-onevision-qwen2-7b-ov-hf", LLAVA_ONEVISION_7B,
           384, _onevision_processor, _onevision_vision_tokens),
    Family("instructblip", "InstructBLIP-Vicuna-7B", "Salesforce/instructblip-vicuna-7b", INSTRUCTBLIP_VICUNA_7B, 224,
           _instructblip_processor, _instructblip_vision_tokens),
]}


# -- building ------------------------------------------------------------------------------------------------------
def _merge(into: dict[str, Any], spec: dict[str, Any]) -> None:
    for k, v in spec.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def _with_layers(spec: dict[str, Any], n: int) -> dict[str, Any]:
    """The spec with ``n`` layers in the LLM, the vision tower and the Q-Former; Qwen2.5-VL's full-attention blocks
    become the last one (the others attend in windows), Qwen3-VL's deepstack blocks map proportionally."""
    import copy

    out = copy.deepcopy(spec)
    out["text_config"]["num_hidden_layers"] = n
    if "qformer_config" in out:
        out["qformer_config"]["num_hidden_layers"] = n
    v = out["vision_config"]
    depth_key = "depth" if "depth" in v else "num_hidden_layers"
    depth = v[depth_key]
    v[depth_key] = n
    if "fullatt_block_indexes" in v:
        v["fullatt_block_indexes"] = [n - 1]
    if "deepstack_visual_indexes" in v:
        v["deepstack_visual_indexes"] = sorted({i * n // depth for i in v["deepstack_visual_indexes"]})
    return out


def real_config(tiny_cfg: Any, spec: dict[str, Any]) -> Any:
    """The tiny config with the published sizes written over it (special-token ids stay the tiny tokenizer's)."""
    d = tiny_cfg.to_dict()
    _merge(d, spec)
    for sub in d.values():
        if isinstance(sub, dict):
            sub.pop("layer_types", None)  # per-layer lists of the tiny depth: rebuilt from the new one
    return type(tiny_cfg).from_dict(d)


def word_list() -> list[str]:
    from mcit.data import tiny_mcit

    return sorted({w for t in tiny_mcit.corpus() for w in t.lower().split() if w.isalpha()})


def build_family(fam: Family, layers: int | None) -> tuple[Any, Any, Any, tuple[int, int]]:
    """(model class, checkpoint-size config, processor, the tiny model's (eos, pad) ids) from the family's tiny
    model."""
    import transformers

    from mcit.core.registry import BACKBONES

    cls = BACKBONES.get(fam.kind)
    tiny_model, tiny_processor = cls.tiny([" ".join(word_list())], seed=0)
    spec = fam.spec if layers is None else _with_layers(fam.spec, layers)
    cfg = real_config(tiny_model.config, spec)
    gen = tiny_model.generation_config if fam.kind != "instructblip" else tiny_model.language_model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else tiny_processor.tokenizer.eos_token_id
    return (getattr(transformers, cls.model_class), cfg, fam.processor(tiny_processor, fam.image_px),
            (int(eos), int(tiny_processor.tokenizer.pad_token_id)))


def parameter_split(model: torch.nn.Module) -> tuple[int, int]:
    """(vision-side parameters, language-model parameters without the input embedding)."""
    n_vis = n_lm = 0
    for name, p in model.named_parameters():
        if any(part in name for part in VISION_PARTS):
            n_vis += p.numel()
        elif "embed_tokens" not in name:
            n_lm += p.numel()
    return n_vis, n_lm


def meta_counts(fam: Family, method_cls: Any, layers: int | None, seq: Any) -> tuple[int, int]:
    """(frozen backbone parameters, trainable method parameters) of the architecture on the meta device."""
    from accelerate import init_empty_weights

    from mcit.models.mllm import MLLMBackbone

    model_cls, cfg, _, _ = build_family(fam, layers)
    with init_empty_weights():
        model = model_cls(cfg)
    empty = MLLMBackbone.wrap(model, None)
    method = method_cls(method_cls.Params(), empty, seq)
    ours = {id(q) for q in method.parameters()}
    n_backbone = sum(p.numel() for p in empty.model.parameters() if id(p) not in ours)
    return n_backbone, sum(p.numel() for p in method.trainable_parameters())


def samples(n: int, words: int, image_px: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` raw instruction samples: a random RGB image and one turn of ``words`` known words (the answer is
    ``ANSWER_WORDS`` of them)."""
    import io
    import json
    import random

    import numpy as np
    from PIL import Image

    vocab = word_list()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        q = " ".join(rng.choice(vocab) for _ in range(max(1, words - ANSWER_WORDS)))
        a = " ".join(rng.choice(vocab) for _ in range(ANSWER_WORDS))
        pixels = np.random.RandomState(seed + i).randint(0, 256, (image_px, image_px, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        conv = [{"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a}]
        out.append({"__key__": f"s{i}", "json": json.dumps({"conversations": conv}).encode(), "png": buf.getvalue()})
    return out


def vocab_tokenizer(vocab: int, pad: int, eos: int) -> Any:
    """A word-level tokenizer over every id of the big vocabulary (random weights generate any id): decodes what
    both generations make, one word a token. Padding and EOS have names no other word contains (the tokenizer finds
    special tokens inside words: an EOS named "w2" would split "w29720")."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    names = {i: f"w{i}" for i in range(vocab)}
    names[pad], names[eos] = "<|bench_pad|>", "<|bench_eos|>"
    words = Tokenizer(WordLevel({w: i for i, w in names.items()}, unk_token=names[pad]))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token=names[pad], eos_token=names[eos])


# -- one family --------------------------------------------------------------------------------------------------------
def run_family(fam: Family, args: argparse.Namespace, method_cls: Any, seq: Any, runnable: bool) -> dict[str, Any]:
    from mcit.core import distributed as dist

    layers = args.tiny_layers
    size = fam.label + ("" if layers is None else f" ({layers} layer{'s' * (layers > 1)}, real widths)")
    n_backbone, n_train = meta_counts(fam, method_cls, layers, seq)
    print(f"{size} [{fam.hub_id}] on the meta device: {n_backbone / 1e9:.3f} B frozen parameters; "
          f"{args.method}: {n_train:,} trainable ({100 * n_train / n_backbone:.4f}% of the backbone)", flush=True)
    row: dict[str, Any] = {"family": fam.kind, "frozen_B": n_backbone / 1e9, "trainable": n_train}
    if not runnable:
        return row

    from mcit.core.config import validate_config
    from mcit.models.mllm import MLLMBackbone
    from mcit.run.engine import setup_engine, train_step

    device = dist.device()
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    model_cls, cfg, processor, (eos, pad) = build_family(fam, layers)
    torch.manual_seed(0)
    t_build = time.perf_counter()
    with torch.device(device):
        model = model_cls._from_config(cfg, dtype=dtype)
    gens = [model.generation_config]
    if fam.kind == "instructblip":  # transformers' InstructBLIP generates through its language model
        gens.append(model.language_model.generation_config)
    for gen in gens:  # the tiny model's, as its tests have them
        gen.eos_token_id, gen.pad_token_id = eos, pad
    weights = torch.cuda.memory_allocated() / 2**30 if cuda else sum(p.numel() * p.element_size()
                                                                     for p in model.parameters()) / 2**30
    print(f"  model ready in {time.perf_counter() - t_build:.1f} s; weights {weights:.1f} GiB on {device}",
          flush=True)
    bb = MLLMBackbone.wrap(model, processor, max_length=32768)
    n_vis, n_lm = parameter_split(model)
    B = args.batch
    raw = samples(B, args.text_tokens, fam.image_px)
    train_batch = bb.collate(raw, task=0, train=True, location="bench").to(device)
    eval_batch = bb.collate(raw, task=0, train=False, location="bench").to(device)
    run = validate_config({"name": "b", "backbone": {"kind": fam.kind, "path": "unused"},
                           "data": {"tasks": ["t"], "root": "."}, "method": {"name": args.method},
                           "train": {"batch_size": B, "lr": 0.03, "precision": "bf16" if cuda else "fp32",
                                     "deepspeed_config": "deepspeed_configs/zero2.json"}})
    method = method_cls(method_cls.Params(), bb, seq).to(device)
    engine, _ = setup_engine(run, method, dist.world_size())
    try:
        # the LLM's tokens per sample, prompts included (what the step's LLM pass sees), as llava7b_step counts them
        t_lm = float(train_batch.inputs["attention_mask"].sum(1).float().mean()) + \
            getattr(method.params, "top_n", 1) * getattr(method.params, "prompt_length", 0)
        t_img = float((train_batch.inputs["input_ids"] == bb.image_token_id).sum(1).float().mean())
        t_vis = fam.vision_tokens(train_batch, model.config)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            train_step(engine, train_batch, 1.0 / B)  # warm-up
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            terms, _ = train_step(engine, train_batch, 1.0 / B)
        sync()
        dt = time.perf_counter() - t0
        step_s = dt / args.steps
        model_flops = B * (6 * n_lm * t_lm + 2 * n_vis * t_vis)
        needed_flops = B * (4 * n_lm * t_lm + 2 * n_vis * t_vis)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        loss = float(terms["logs"].get("lm_loss", float("nan")))
        print(f"  ZeRO-2 {'bf16' if cuda else 'fp32'} step, batch {B}, {t_lm:.0f} LLM tokens per sample "
              f"({t_img:.0f} image tokens, prompts included), {t_vis:.0f} ViT tokens: {step_s * 1000:.0f} ms/step, "
              f"{args.steps * B / dt:.2f} samples/s, {args.steps * B * t_lm / dt:,.0f} tokens/s, lm_loss {loss:.3f}"
              + (f", peak GPU memory {peak:.1f} GiB on {torch.cuda.get_device_name()}" if cuda else ""), flush=True)
        mfu = 100 * model_flops / step_s / (args.peak_tflops * 1e12)
        print(f"  MFU {mfu:.1f}% (6NT LLM {n_lm / 1e9:.2f} B + 2NT vision {n_vis / 1e9:.2f} B, "
              f"{model_flops / step_s / 1e12:.1f} TFLOP/s); needed-FLOPs utilisation "
              f"{100 * needed_flops / step_s / (args.peak_tflops * 1e12):.1f}% (4NT, frozen LLM) of "
              f"{args.peak_tflops:.0f} TFLOP/s", flush=True)
        row.update(ms_step=step_s * 1000, samples_s=args.steps * B / dt, tokens_s=args.steps * B * t_lm / dt,
                   llm_tokens=t_lm, peak_gib=peak, mfu=mfu)
        if args.generate:
            row.update(time_generation(bb, method, model, eval_batch, args.generate, args.rounds, cuda))
    finally:
        engine.destroy()
    return row


def time_generation(bb: Any, method: Any, model: Any, batch: Any, new_tokens: int, rounds: int,
                    cuda: bool) -> dict[str, float]:
    """Greedy decoding of ``new_tokens`` for the evaluation batch through the method (prompt selection, prompts
    inserted, the family's KV-cached decoding) and through transformers' ``generate`` on the family's own inputs
    for the same samples (``model_inputs``), alternating; median of ``rounds`` (after a warm-up round on CUDA)."""
    d = bb.decoding()
    tok = vocab_tokenizer(int(model.config.text_config.vocab_size), d.pad, d.eos[0])
    bb.tokenizer = tok
    method.eval()
    inputs = bb.model_inputs(batch)
    ids = inputs["input_ids"]

    def ours() -> int:
        return sum(len(a.split()) for a in method.generate(batch, new_tokens))  # one word a token, EOS not one

    @torch.no_grad()
    def hf() -> int:
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                             pad_token_id=d.pad, eos_token_id=d.eos)
        L = ids.shape[1]
        new = out[:, L:] if out.shape[1] > L and torch.equal(out[:, :L], ids) else out
        return int(((new != d.pad) & ~torch.isin(new, torch.tensor(d.eos, device=new.device))).sum())  # as ours

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {"method generate": [], "transformers generate": []}
    made: dict[str, int] = {}
    for r in range(rounds + int(cuda)):  # on CUDA the first round warms up
        for name, fn in (("method generate", ours), ("transformers generate", hf)):
            sync()
            t0 = time.perf_counter()
            made[name] = fn()
            sync()
            if r or not cuda:
                times[name].append(time.perf_counter() - t0)
    B = ids.shape[0]
    out: dict[str, float] = {}
    for name, v in times.items():
        dt = statistics.median(v)
        print(f"  {name}: batch {B}, {ids.shape[1]} prompt tokens, up to {new_tokens} new: {dt * 1000:.0f} ms, "
              f"{made[name] / dt:,.1f} new tokens/s ({made[name]} made)", flush=True)
        out[f"{name.split()[0]}_gen_ms"] = dt * 1000
    ratio = statistics.median(a / b for a, b in zip(times["method generate"], times["transformers generate"]))
    print(f"  ratio method / transformers generate (time) = {ratio:.3f}", flush=True)
    out["gen_ratio"] = ratio
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", action="append", default=None, metavar="NAME",
                    help=f"one of {', '.join(FAMILIES)} or all (repeatable; default all)")
    ap.add_argument("--method", default="fwd_prompt", choices=["fwd_prompt", "prompt_tuning", "lora"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--text-tokens", type=int, default=64, help="words of question + answer per sample")
    ap.add_argument("--generate", type=int, default=32, metavar="N",
                    help="time greedy generation of N new tokens, method vs transformers (0: none)")
    ap.add_argument("--rounds", type=int, default=3, help="generation rounds (median); CUDA adds a warm-up round")
    ap.add_argument("--tiny-layers", type=int, default=None, metavar="N",
                    help="real widths but N layers (LLM, vision tower, Q-Former): runs the step and generation on "
                         "the CPU too (float32)")
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for MFU")
    args = ap.parse_args(argv)
    names = args.family or ["all"]
    if "all" in names:
        names = list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        ap.error(f"unknown family {', '.join(unknown)}; known: {', '.join(FAMILIES)}, all")
    if args.tiny_layers is not None and args.tiny_layers < 1:
        ap.error("--tiny-layers must be >= 1")
    if args.steps < 1 or args.batch < 1 or args.rounds < 1:
        ap.error("--steps, --batch and --rounds must be >= 1")

    from mcit.core import distributed as dist
    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence

    runnable = torch.cuda.is_available() or args.tiny_layers is not None
    if runnable:
        dist.init()
    else:
        print("no CUDA device: meta builds only (--tiny-layers N runs a step and a generation on the CPU)")
    seq = TaskSequence.from_label_spaces(["t"], [[]])
    method_cls = METHODS.get(args.method)
    print(f"method {args.method} ({method_cls.Params().model_dump()})", flush=True)
    rows, failed = [], []
    for name in names:
        fam = FAMILIES[name]
        try:
            rows.append(run_family(fam, args, method_cls, seq, runnable))
        except Exception as e:  # noqa: BLE001 - one family's failure does not lose the others
            failed.append(name)
            first = (str(e).splitlines() or [""])[0]
            print(f"FAILED {name}: {type(e).__name__}: {first}", flush=True)
            traceback.print_exc(limit=-3, file=sys.stderr)
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                print(f"  GPU memory after freeing {name}: {torch.cuda.memory_allocated() / 2**30:.2f} GiB", flush=True)
    if runnable and rows:
        print("\nsummary (" + ("bf16 on " + torch.cuda.get_device_name() if torch.cuda.is_available() else "fp32 CPU")
              + f", {args.method}, batch {args.batch}):")
        print(f"{'family':16} {'ms/step':>8} {'samples/s':>9} {'tokens/s':>9} {'LLM tok':>7} {'peak GiB':>8} "
              f"{'MFU%':>5} {'gen ms':>7} {'hf ms':>7} {'ratio':>6}")
        for r in rows:
            if "ms_step" not in r:
                continue
            print(f"{r['family']:16} {r['ms_step']:8.0f} {r['samples_s']:9.2f} {r['tokens_s']:9.0f} "
                  f"{r['llm_tokens']:7.0f} {r['peak_gib']:8.1f} {r['mfu']:5.1f} {r.get('method_gen_ms', 0):7.0f} "
                  f"{r.get('transformers_gen_ms', 0):7.0f} {r.get('gen_ratio', 0):6.3f}")
    return 1 if failed else 0


if __name__ == "__main__":
    from mcit.core.distributed import exit_process

    exit_process(main())
