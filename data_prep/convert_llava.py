"""Original LLaVA-1.5 checkpoints -> a transformers ``LlavaForConditionalGeneration`` directory, offline.

    # MCITlib's start: haotian-liu/LLaVA's LlavaLlamaForCausalLM directory + the CLIP tower it names
    python -m data_prep.convert_llava --llava llava-v1.5-7b --clip clip-vit-large-patch14-336 --out llava-7b-hf
    # CoIN's start: Vicuna-7B-v1.5 + the pre-training stage's projector
    python -m data_prep.convert_llava --vicuna vicuna-7b-v1.5 --mm-projector mm_projector.bin \
        --clip clip-vit-large-patch14-336 --out llava-7b-hf

Why here: transformers' own conversion script downloads from the model hub, and ``LlavaConfig`` reads an
original-layout directory as LLaVA's defaults (a 13B checkpoint gets 7B shapes, every weight random). This one
takes every shape from the checkpoint's own config and the CLIP directory's, and reads the weights shard by shard
(a 7B in 16-bit fits this machine's memory only that way): each source shard is read (``.bin`` memory-mapped,
``.safetensors`` lazily), renamed into the llava-hf layout (that of llava-hf/llava-1.5-7b-hf, which every
transformers version since 4.36 loads) and written before the next is read. Every source key is consumed or
dropped by a named rule (the CLIP directory's text tower; rotary caches); an unknown key or a missing target
key stops the conversion with its name.

The tokenizer gets ``<image>`` (a special token after the vocabulary) and ``<pad>`` as llava-hf's conversion adds
them, and the vocabulary is padded to a multiple of 64 (32000 -> 32064). The new embedding and output rows are
the mean of the old ones (transformers' script samples them around that mean): the image token's embedding is
never read (image features replace it) and a mean output row is never a strict greedy maximum. LLaVA's own model
has no such rows (it splices image features at index -200), so its logits are the first ``vocab_size`` columns:
with ``chat_format: vicuna_v1`` the backbone masks the added rows out of the softmax (``MLLMBackbone._output_vocab``),
and the training loss is LLaVA's own (tests/reference/test_llava_sentencepiece.py).

The processor is transformers' ``LlavaProcessor`` with ``LlavaImageProcessor`` set to pad to a square with the mean
colour first (``image_aspect_ratio: pad``, LLaVA's ``expand2square``), the CLIP directory's resize / crop /
normalisation, and the vicuna_v1 conversation as its chat template (runs use ``backbone.chat_format: vicuna_v1``,
the default for LLaVA-1.5 tags, which tokenises around the image as LLaVA does). ``zoo.json`` records the source
format, the sha256 of every input and output file, and the key counts. The output directory is written under a
temporary name and renamed when complete; an existing one is never replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

VICUNA_V1_TEMPLATE = (  # haotian-liu/LLaVA conv_vicuna_v1 (SeparatorStyle.TWO: sep " ", sep2 "</s>")
    "{{ 'A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
    "detailed, and polite answers to the user\\'s questions. ' }}"
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: "
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %} "
    "{% else %}ASSISTANT: {% for c in message['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}</s>{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
SELECT_FEATURE = {"patch": "default", "cls_patch": "full"}  # mm_vision_select_feature -> llava-hf strategy
LLAMA_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
              "max_position_embeddings", "rms_norm_eps", "hidden_act", "rope_theta", "rope_scaling",
              "attention_bias", "bos_token_id", "eos_token_id", "initializer_range", "pretraining_tp")
CLIP_DROPPED = ("text_model.", "text_projection.", "visual_projection.", "logit_scale")  # CLIPModel's other parts
CLIP_VISION_MODULES = ("embeddings.", "pre_layrnorm.", "encoder.", "post_layernorm.")  # CLIPVisionTransformer's
BUFFERS = ("rotary_emb.inv_freq", "embeddings.position_ids")  # caches some releases saved


class ConversionError(ValueError):
    """A source that cannot be converted: one line naming the file and key."""


@dataclass
class Sources:
    """What a conversion reads: the Llama weights (with or without LLaVA's projector), the projector file (CoIN's
    start), the CLIP directory."""

    llm: Path
    clip: Path
    projector: Path | None = None
    llm_config: dict[str, Any] = field(default_factory=dict)
    clip_config: dict[str, Any] = field(default_factory=dict)

    @property
    def fmt(self) -> str:
        return "vicuna_mm_projector" if self.projector else "llava_original"


def _json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ConversionError(f"{path}: not found ({what})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not JSON ({what}): {e}") from None


def weight_files(d: Path) -> list[Path]:
    """A directory's weight shards in their index's order (safetensors preferred, as transformers does)."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (d / index).is_file():
            names = sorted(set(_json(d / index, "weight index")["weight_map"].values()))
            missing = [n for n in names if not (d / n).is_file()]
            if missing:
                raise ConversionError(f"{d / index}: shard {missing[0]} not found")
            return [d / n for n in names]
        if (d / single).is_file():
            return [d / single]
    raise ConversionError(f"{d}: no weights (model.safetensors[.index.json] or pytorch_model.bin[.index.json])")


def read_shard(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of one weight file without holding more than the file itself in memory."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                for k in f.keys():
                    yield k, f.get_tensor(k)
            return
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - one line naming the file
        raise ConversionError(f"{path}: cannot read weights: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(sd, dict):
        raise ConversionError(f"{path}: not a state dict ({type(sd).__name__})")
    yield from sd.items()


def check_sources(llava: Path | None, vicuna: Path | None, projector: Path | None, clip: Path) -> Sources:
    """Every input exists and is what it should be, before any weight is read."""
    if (llava is None) == (vicuna is None):
        raise ConversionError("give exactly one of --llava (an original LLaVA-1.5 directory) and --vicuna "
                              "(a Llama/Vicuna directory, with --mm-projector)")
    if (vicuna is None) != (projector is None):
        raise ConversionError("--vicuna and --mm-projector go together (CoIN's start: Vicuna + the projector)")
    llm = llava or vicuna
    assert llm is not None
    cfg = _json(llm / "config.json", "the checkpoint's config")
    if llava is not None:
        arch = cfg.get("architectures") or []
        if "mm_projector_type" not in cfg and "LlavaLlamaForCausalLM" not in arch:
            raise ConversionError(f"{llm / 'config.json'}: not an original LLaVA checkpoint (no mm_projector_type, "
                                  f"architectures {arch}); a Vicuna directory goes with --vicuna and --mm-projector")
        for key, want in (("mm_projector_type", "mlp2x_gelu"), ("mm_use_im_start_end", False),
                          ("mm_patch_merge_type", "flat")):
            if cfg.get(key, want) != want:
                raise ConversionError(f"{llm / 'config.json'}: {key} {cfg[key]!r} is not LLaVA-1.5's {want!r} "
                                      f"(llava-hf's LlavaForConditionalGeneration has no equivalent)")
        if cfg.get("mm_vision_select_feature", "patch") not in SELECT_FEATURE:
            raise ConversionError(f"{llm / 'config.json'}: mm_vision_select_feature "
                                  f"{cfg['mm_vision_select_feature']!r} unknown ({', '.join(SELECT_FEATURE)})")
    elif cfg.get("model_type") != "llama":
        raise ConversionError(f"{llm / 'config.json'}: model_type {cfg.get('model_type')!r}, not a Llama/Vicuna model")
    if projector is not None and not projector.is_file():
        raise ConversionError(f"{projector}: not found (--mm-projector)")
    if not (llm / "tokenizer.json").is_file() and not (llm / "tokenizer.model").is_file():
        raise ConversionError(f"{llm}: no tokenizer (tokenizer.json or tokenizer.model)")
    weight_files(llm)
    clip_cfg = _json(clip / "config.json", "the CLIP vision tower's config")
    vision = clip_cfg.get("vision_config", clip_cfg)
    if not str(vision.get("model_type", clip_cfg.get("model_type", ""))).startswith("clip"):
        raise ConversionError(f"{clip / 'config.json'}: not a CLIP model (model_type "
                              f"{clip_cfg.get('model_type')!r})")
    _json(clip / "preprocessor_config.json", "the CLIP image processor")
    weight_files(clip)
    return Sources(llm, clip, projector, cfg, clip_cfg)


def target_name(key: str, source: str) -> str | None:
    """The llava-hf name of a source key (None: dropped by rule); ConversionError for a key no rule knows."""
    if any(key.endswith(b) for b in BUFFERS):
        return None
    if source == "clip":
        if key.startswith("vision_model."):  # CLIPModel, or CLIPVisionModel as transformers 4 saves it
            return "vision_tower." + key
        if key.startswith(CLIP_VISION_MODULES):  # CLIPVisionModel as transformers 5 saves it (no vision_model.)
            return "vision_tower.vision_model." + key
        if key.startswith(CLIP_DROPPED):
            return None
    elif key.startswith("model.mm_projector."):
        rest = key[len("model.mm_projector."):]
        idx, _, param = rest.partition(".")
        if idx in ("0", "2") and param in ("weight", "bias"):
            return f"multi_modal_projector.linear_{1 if idx == '0' else 2}.{param}"
    elif key.startswith("model.vision_tower.vision_tower.vision_model."):  # a release that tuned the tower
        return "vision_tower." + key[len("model.vision_tower.vision_tower."):]
    elif key == "lm_head.weight":
        return "language_model.lm_head.weight"
    elif key.startswith(("model.embed_tokens.", "model.layers.", "model.norm.")):
        return "language_model." + key
    raise ConversionError(f"{source} key {key!r}: no rule maps it into LlavaForConditionalGeneration")


def tokenizer_with_image_token(path: Path) -> tuple[Any, list[str]]:
    """The checkpoint's tokenizer with ``<image>`` and ``<pad>`` added as llava-hf's conversion adds them. It is
    loaded as the class its ``tokenizer_config.json`` names: ``AutoTokenizer`` would pick one from config.json's
    ``model_type`` ("llava"), and for a SentencePiece-only directory (liuhaotian/llava-v1.5-7b ships
    ``tokenizer.model`` and ``LlamaTokenizer``) it built a tokenizer without Llama's dummy prefix: every prompt's
    first word became another token than LLaVA's."""
    import transformers
    from transformers import AddedToken, AutoTokenizer

    cfg = path / "tokenizer_config.json"
    name = json.loads(cfg.read_text()).get("tokenizer_class") if cfg.is_file() else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    with warnings.catch_warnings():  # AutoTokenizer probes config.json, which transformers reads as a LlavaConfig
        warnings.simplefilter("ignore", FutureWarning)
        tok = (cls or AutoTokenizer).from_pretrained(str(path))
    added = []
    if "<image>" not in tok.get_vocab():
        tok.add_tokens(AddedToken("<image>", special=True, normalized=False), special_tokens=True)
        added.append("<image>")
    if "<pad>" not in tok.get_vocab():
        tok.add_special_tokens({"pad_token": "<pad>"})
        added.append("<pad>")
    tok.pad_token = "<pad>"
    tok.chat_template = VICUNA_V1_TEMPLATE
    return tok, added


def llava_config(src: Sources, tok: Any, pad_to: int = 64) -> Any:
    """LlavaConfig from the checkpoint's and the CLIP directory's own numbers (nothing from defaults)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    c = src.llm_config
    vision = dict(src.clip_config.get("vision_config", src.clip_config))
    vision.pop("model_type", None)
    vocab = -(-len(tok) // pad_to) * pad_to
    text = LlamaConfig(vocab_size=vocab, tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                       pad_token_id=tok.pad_token_id, **{k: c[k] for k in LLAMA_KEYS if c.get(k) is not None})
    vcfg = CLIPVisionConfig(**{k: v for k, v in vision.items() if not k.startswith("_")})
    return LlavaConfig(
        vision_config=vcfg, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
        pad_token_id=tok.pad_token_id, projector_hidden_act="gelu", multimodal_projector_bias=True,
        vision_feature_layer=int(c.get("mm_vision_select_layer", -2)),
        vision_feature_select_strategy=SELECT_FEATURE[c.get("mm_vision_select_feature", "patch")],
        image_seq_length=(vcfg.image_size // vcfg.patch_size) ** 2)


def processor(src: Sources, tok: Any, cfg: Any) -> Any:
    """LlavaProcessor: pad to square with the mean colour (LLaVA's expand2square), then the CLIP directory's
    resize / crop / normalisation; vicuna_v1 as the chat template."""
    from transformers import LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    pre = _json(src.clip / "preprocessor_config.json", "the CLIP image processor")
    keys = ("size", "crop_size", "do_resize", "do_center_crop", "do_rescale", "rescale_factor", "do_normalize",
            "image_mean", "image_std", "resample", "do_convert_rgb")
    pad = src.llm_config.get("image_aspect_ratio", "pad") == "pad"
    ip = LlavaImageProcessorPil(**{k: pre[k] for k in keys if k in pre}, do_pad=pad)
    return LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=cfg.vision_config.patch_size,
                          vision_feature_select_strategy=cfg.vision_feature_select_strategy,
                          chat_template=VICUNA_V1_TEMPLATE, image_token="<image>", num_additional_image_tokens=1)


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Embedding / output rows for the added tokens: the mean of the existing rows."""
    if t.shape[0] >= rows:
        return t
    mean = t.float().mean(0, keepdim=True).to(t.dtype)
    return torch.cat([t, mean.expand(rows - t.shape[0], -1)])


def _streams(src: Sources) -> Iterator[tuple[str, Path, Iterator[tuple[str, torch.Tensor]]]]:
    for f in weight_files(src.llm):
        yield "llava" if src.projector is None else "vicuna", f, read_shard(f)
    if src.projector is not None:
        yield "mm_projector", src.projector, read_shard(src.projector)
    for f in weight_files(src.clip):
        yield "clip", f, read_shard(f)


def convert(src: Sources, out: Path, *, max_shard_bytes: int = 4 << 30, dtype: torch.dtype | None = None,
            progress: bool = True) -> dict[str, Any]:
    """Write the llava-hf directory ``out`` (atomically) and return its zoo record."""
    from accelerate import init_empty_weights
    from transformers import LlavaForConditionalGeneration

    from mcit.core.checkpoint import publish_dir

    if out.exists():
        raise ConversionError(f"{out}: already exists (nothing is overwritten; remove it or choose another --out)")
    tok, added = tokenizer_with_image_token(src.llm)
    cfg = llava_config(src, tok)
    with init_empty_weights():
        model = LlavaForConditionalGeneration(cfg)
    expected = {k: tuple(v.shape) for k, v in _saved_names(model).items()}
    tmp = out.with_name(out.name + f".partial{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        record = _write(src, tmp, tok, added, cfg, expected, max_shard_bytes, dtype, progress)
        publish_dir(tmp, out, replace=False, files={"zoo.json": json.dumps(record, indent=1)})
    except BaseException:  # a failed or killed conversion leaves nothing behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _write(src: Sources, tmp: Path, tok: Any, added: list[str], cfg: Any, expected: dict[str, tuple[int, ...]],
           max_shard_bytes: int, dtype: torch.dtype | None, progress: bool) -> dict[str, Any]:
    """Stream the sources into ``tmp`` (shards, index, config, processor); return the zoo record."""
    from safetensors.torch import save_file

    from mcit.models.zoo import sha256_path

    written: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    dropped: dict[str, int] = {}
    consumed = 0
    files: list[str] = []

    def flush() -> None:
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file({k: v.contiguous() for k, v in shard.items()}, str(tmp / name), metadata={"format": "pt"})
            files.append(name)
            written.update({k: name for k in shard})
            shard.clear()

    for source, path, stream in _streams(src):
        for key, t in stream:
            try:
                name = target_name(key, "clip" if source == "clip" else "llava")
            except ConversionError as e:
                raise ConversionError(f"{path}: {e}") from None
            if name is None:
                dropped[source] = dropped.get(source, 0) + 1
                continue
            if name in written or name in shard:
                if source == "clip":  # the checkpoint's own tuned tower wins over the CLIP directory's
                    dropped["clip"] = dropped.get("clip", 0) + 1
                    continue
                raise ConversionError(f"{path}: key {key!r} given twice (as {name})")
            if name not in expected:
                raise ConversionError(f"{path}: key {key!r} -> {name}, which LlavaForConditionalGeneration lacks")
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                t = _padded(t, expected[name][0])
            if tuple(t.shape) != expected[name]:
                raise ConversionError(f"{path}: key {key!r} has shape {tuple(t.shape)}, the config says "
                                      f"{expected[name]} for {name}")
            shard[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t.clone()
            consumed += 1
            if sum(v.numel() * v.element_size() for v in shard.values()) >= max_shard_bytes:
                flush()
        if progress:
            print(f"  read {path.name}", file=sys.stderr)
    flush()
    missing = sorted(set(expected) - set(written))
    if missing:
        raise ConversionError(f"{src.llm}: the sources give no {missing[0]} ({len(missing)} target keys missing"
                              f"{', e.g. the vision tower: check --clip' if 'vision_tower' in missing[0] else ''})")
    total = sum((tmp / f).stat().st_size for f in files)
    renamed = {f"model-{i + 1:05d}-of-{len(files):05d}.safetensors": f for i, f in enumerate(files)}
    for new, old in renamed.items():
        (tmp / old).rename(tmp / new)
    back = {old: new for new, old in renamed.items()}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": {k: back[v] for k, v in sorted(written.items())}},
        indent=1))
    cfg.save_pretrained(str(tmp))
    processor(src, tok, cfg).save_pretrained(str(tmp))
    inputs = {"llm": sha256_path(src.llm), "clip": sha256_path(src.clip)}
    if src.projector is not None:
        inputs["mm_projector"] = sha256_path(src.projector)
    record = {"format": src.fmt, "sources": {"llm": str(src.llm), "clip": str(src.clip),
                                             **({"mm_projector": str(src.projector)} if src.projector else {})},
              "sources_sha256": inputs, "keys_consumed": consumed, "keys_dropped_by_rule": dropped,
              "added_tokens": added, "vocab_size": cfg.text_config.vocab_size,
              "outputs_sha256": {f: sha256_path(tmp / f) for f in sorted(os.listdir(tmp))},
              "chat_format": "vicuna_v1", "image_aspect_ratio": src.llm_config.get("image_aspect_ratio", "pad")}
    return record


def _saved_names(model: Any) -> dict[str, torch.Tensor]:
    """The model's parameters under the llava-hf names its checkpoints use (``language_model.model.*``,
    ``vision_tower.vision_model.*``): transformers 5 loads them into its own layout."""
    out = {}
    for k, v in model.state_dict().items():
        if k.startswith("model.language_model."):
            out["language_model.model." + k[len("model.language_model."):]] = v
        elif k == "lm_head.weight":
            out["language_model.lm_head.weight"] = v
        elif k.startswith("model.vision_tower."):
            out["vision_tower.vision_model." + k[len("model.vision_tower."):]] = v
        elif k.startswith("model.multi_modal_projector."):
            out[k[len("model."):]] = v
        else:
            raise AssertionError(f"LlavaForConditionalGeneration key {k} has no llava-hf name")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data_prep.convert_llava", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llava", type=Path, help="an original LLaVA-1.5 directory (LlavaLlamaForCausalLM)")
    ap.add_argument("--vicuna", type=Path, help="a Llama/Vicuna directory (CoIN's start; with --mm-projector)")
    ap.add_argument("--mm-projector", type=Path, help="the pre-training stage's mm_projector.bin")
    ap.add_argument("--clip", type=Path, required=True,
                    help="the CLIP directory the checkpoint's mm_vision_tower names "
                         "(openai/clip-vit-large-patch14-336)")
    ap.add_argument("--out", type=Path, required=True, help="the llava-hf directory to write (must not exist)")
    ap.add_argument("--max-shard-size", type=float, default=4.0, help="GiB per output shard")
    ap.add_argument("--dtype", choices=("keep", "float16", "bfloat16", "float32"), default="keep")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    try:
        src = check_sources(a.llava, a.vicuna, a.mm_projector, a.clip)
        rec = convert(src, a.out, max_shard_bytes=int(a.max_shard_size * (1 << 30)),
                      dtype=None if a.dtype == "keep" else getattr(torch, a.dtype), progress=not a.no_progress)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{a.out}: {rec['format']} -> LlavaForConditionalGeneration, {rec['keys_consumed']} keys "
          f"(dropped by rule: {rec['keys_dropped_by_rule'] or 'none'}), vocab {rec['vocab_size']} "
          f"(added {', '.join(rec['added_tokens']) or 'none'}); use backbone.kind llava, chat_format vicuna_v1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
