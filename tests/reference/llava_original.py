"""A tiny checkpoint in the ORIGINAL LLaVA-1.5 layouts (haotian-liu/LLaVA), seeded and built offline.

The official numbers in ``official/llava15.safetensors`` were produced by haotian-liu/LLaVA's own model code
(``LlavaLlamaForCausalLM``, ``process_images``, ``tokenizer_image_token``, ``conv_templates["vicuna_v1"]``) on
exactly the files :func:`build` writes, so a test can rebuild them here, check their sha256 against
``official/llava15.json`` and feed them to mcit's converter (data_prep/convert_llava.py).

Three layouts, one model:

* ``clip/``: laid out as openai/clip-vit-large-patch14-336 (a full ``CLIPModel``: config, model.safetensors,
  preprocessor_config.json), 3 vision layers of which LLaVA uses the first two (``mm_vision_select_layer -2``);
* ``llava/``: as liuhaotian/llava-v1.5-7b: ``model_type "llava"``, ``LlavaLlamaForCausalLM``, two torch ``.bin``
  shards with the Llama weights and ``model.mm_projector.{0,2}`` (no vision tower weights), a Llama-like
  tokenizer without an ``<image>`` token;
* ``vicuna/`` + ``mm_projector.bin``: CoIN's starting point, a Vicuna (``LlamaForCausalLM``, two safetensors
  shards) and the projector as LLaVA's pre-training stage saves it; the same tensors as ``llava/``.

Names and shapes come from the model classes built on the meta device; values come from an explicit
``torch.Generator`` in sorted key order, so they depend neither on transformers' init code nor on its version.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from PIL.Image import Image
    from transformers import PreTrainedTokenizerFast

SEED = 0
VISION_TOWER = "openai/clip-vit-large-patch14-336"
# conv_templates["vicuna_v1"].system (llava/conversation.py): "user", unlike llava_v1 / vicuna_v0's "human"
SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the user's questions.")
QUESTION = "<image>\nWhat colour is the shape?"
# conv = conv_templates["vicuna_v1"].copy(); conv.append_message("USER", QUESTION);
# conv.append_message("ASSISTANT", None); conv.get_prompt()
PROMPT = SYSTEM + " USER: " + QUESTION + " ASSISTANT:"
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
LOGIT_SCALE = 2.6592  # openai's logit_scale_init_value, log(1 / 0.07)

CLIP_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 64, "max_position_embeddings": 16, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
             "projection_dim": 16, "bos_token_id": 62, "eos_token_id": 63, "pad_token_id": 1}
CLIP_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
               "image_size": 32, "patch_size": 8, "num_channels": 3, "hidden_act": "quick_gelu",
               "layer_norm_eps": 1e-5, "projection_dim": 16}
LLAMA = {"hidden_size": 48, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 4,
         "num_hidden_layers": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "hidden_act": "silu",
         "initializer_range": 0.02, "pretraining_tp": 1, "rope_scaling": None, "rope_theta": 10000.0,
         "tie_word_embeddings": False, "use_cache": True, "attention_bias": False,
         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
# the keys LLaVA's training writes into the config (llava/train/train.py, llava_arch.initialize_vision_modules),
# with LLaVA-1.5's values; the resampler / unfreeze keys are those of the published llava-v1.5-7b config
LLAVA_KEYS = {"mm_vision_tower": VISION_TOWER, "mm_hidden_size": CLIP_VISION["hidden_size"],
              "mm_projector_type": "mlp2x_gelu", "mm_vision_select_layer": -2, "mm_vision_select_feature": "patch",
              "mm_patch_merge_type": "flat", "image_aspect_ratio": "pad", "mm_use_im_start_end": False,
              "mm_use_im_patch_token": False, "use_mm_proj": True, "mm_projector_lr": None,
              "tokenizer_model_max_length": 2048, "tokenizer_padding_side": "right",
              "freeze_mm_mlp_adapter": False, "tune_mm_mlp_adapter": False,
              "mm_resampler_type": None, "freeze_mm_vision_resampler": False, "tune_mm_vision_resampler": False,
              "unfreeze_mm_vision_tower": False}
CORPUS = [SYSTEM, SYSTEM.replace("user", "human"), "USER: ASSISTANT:", QUESTION.replace("<image>", ""),
          "the shape is red. the shape is blue. a red square on a green and yellow background.",
          "what is in the image? how many dots? three one two left right answer with one word."]


def _write_json(path: Path, obj: dict) -> None:
    """Sorted keys and a trailing newline, so that two builds give the same bytes."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _values(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 values in sorted key order, far from trivial: weights and embeddings N(0, 0.1^2), norm
    weights 1 + 0.1 N, biases 0.05 N. CLIP's logit_scale is CLIP's init value (unused by LLaVA)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        x = torch.randn(shapes[name], generator=g, dtype=torch.float32)
        module = name.rsplit(".", 1)[0]
        if name == "logit_scale":
            x = torch.full(shapes[name], LOGIT_SCALE)
        elif name.endswith("bias"):
            x = 0.05 * x
        elif "norm" in module.split(".")[-1] or "layrnorm" in module:
            x = 1 + 0.1 * x
        else:
            x = 0.1 * x
        out[name] = x.contiguous()
    return out


def _meta_shapes(module_fn: Callable[[], torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """The state-dict names and shapes of ``module_fn()`` built on the meta device (no init, no memory)."""
    with torch.device("meta"):
        module = module_fn()
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer that splits words as Llama's sentencepiece model does (``legacy: false``): a "▁" before each
    word, a dummy prefix on the first piece only, ``<unk>``=0, ``<s>``=1, ``</s>``=2, BOS added by the
    post-processor, pad = ``<unk>`` (LLaVA's v1 training sets it so), right padding, 2048 tokens; no ``<image>``
    token, as in the original LLaVA tokenizer (LLaVA splits the prompt at "<image>" instead)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
        pre_tokenizers.Punctuation()])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.train_from_iterator(CORPUS * 5, trainers.BpeTrainer(vocab_size=256, special_tokens=["<unk>", "<s>", "</s>"],
                                                            show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>", padding_side="right", model_max_length=2048)


def sentencepiece_model() -> bytes:
    """A SentencePiece model as Llama's / Vicuna's ``tokenizer.model`` is made (BPE, byte fallback, digits split,
    a dummy prefix, no normalisation, ``<unk>``=0 ``<s>``=1 ``</s>``=2, no pad), trained offline on the corpus by
    sentencepiece's own trainer: 300 pieces, 259 of them the specials and the bytes. One thread: the same bytes on
    every run."""
    import io

    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS * 5), model_writer=out, vocab_size=300,
                                   model_type="bpe", byte_fallback=True, split_digits=True, add_dummy_prefix=True,
                                   remove_extra_whitespaces=False, normalization_rule_name="identity", unk_id=0,
                                   bos_id=1, eos_id=2, pad_id=-1, num_threads=1, character_coverage=1.0, minloglevel=2)
    return out.getvalue()


def _save_sentencepiece(path: Path, model: bytes) -> None:
    """The tokenizer files as liuhaotian/llava-v1.5-7b and lmsys/vicuna-7b-v1.5 ship them: ``tokenizer.model`` and a
    ``LlamaTokenizer`` config (``legacy: false``, BOS added, no pad token), no ``tokenizer.json``."""
    (path / "tokenizer.model").write_bytes(model)
    _write_json(path / "tokenizer_config.json", {
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": None, "clean_up_tokenization_spaces": False, "legacy": False, "model_max_length": 2048,
        "padding_side": "right", "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer"})
    _write_json(path / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


def sample(img: Image) -> dict:
    """The question as a webdataset sample (image bytes + a one-turn conversation), as the converted checkpoint's
    collate reads it."""
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    conv = [{"from": "human", "value": QUESTION}, {"from": "gpt", "value": "red"}]
    return {"__key__": "q", "png": buf.getvalue(), "json": json.dumps({"conversations": conv}).encode()}


# Answers of 1 to 12 words (one-word VQA beside a caption, as UCIT and CoIN mix them), for the loss fixture
LOSS_ANSWERS = ["red", "a red box on the left of the image", "two", "the image shows a red box and a blue sky",
                "yes", "a box"]


def loss_samples(img: Image) -> list[dict]:
    """One batch of training samples whose answers differ in length (``LOSS_ANSWERS``), each the question of
    ``sample`` with its own answer: the micro-batch LLaVA's trainer averages over every answer token."""
    out = []
    for i, answer in enumerate(LOSS_ANSWERS):
        s = sample(img)
        conv = json.loads(s["json"])["conversations"]
        conv[1]["value"] = answer
        out.append({**s, "__key__": f"loss{i}", "json": json.dumps({"conversations": conv}).encode()})
    return out


def image() -> Image:
    """A fixed 40 x 24 RGB image (wider than high, so LLaVA's expand2square padding matters): a gradient with a
    red rectangle off centre."""
    from PIL import Image

    img = Image.new("RGB", (40, 24))
    img.putdata([(6 * x, 10 * y, 128 + 3 * x - 4 * y) for y in range(24) for x in range(40)])
    img.paste((220, 30, 40), (24, 4, 36, 16))
    return img


def _clip_config():
    from transformers import CLIPConfig

    return CLIPConfig.from_dict(_clip_config_json())


def _llama_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, **LLAMA)


def _clip_weights(seed: int) -> dict[str, torch.Tensor]:
    from transformers import CLIPModel

    cfg = _clip_config()
    return _values(_meta_shapes(lambda: CLIPModel(cfg)), seed)


def _llama_weights(vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    cfg = _llama_config(vocab_size)
    return _values(_meta_shapes(lambda: LlamaForCausalLM(cfg)), seed + 1)


def _projector_weights(seed: int) -> dict[str, torch.Tensor]:
    """LLaVA's mlp2x_gelu projector (Linear(mm_hidden, hidden), GELU, Linear(hidden, hidden)) as named in
    LlavaLlamaForCausalLM: ``model.mm_projector.{0,2}.{weight,bias}``."""
    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(CLIP_VISION["hidden_size"], LLAMA["hidden_size"]), torch.nn.GELU(),
                                   torch.nn.Linear(LLAMA["hidden_size"], LLAMA["hidden_size"]))

    shapes = {f"model.mm_projector.{k}": v for k, v in _meta_shapes(mlp).items()}
    return _values(shapes, seed + 2)


def _clip_config_json() -> dict:
    """A full CLIPModel config as openai's, every value explicit (readable by transformers 4.37 and 5)."""
    common = {"attention_dropout": 0.0, "initializer_factor": 1.0, "initializer_range": 0.02}
    return {"architectures": ["CLIPModel"], "model_type": "clip", "initializer_factor": 1.0,
            "logit_scale_init_value": LOGIT_SCALE, "projection_dim": 16, "torch_dtype": "float32",
            "text_config": {**CLIP_TEXT, **common, "model_type": "clip_text_model"},
            "vision_config": {**CLIP_VISION, **common, "model_type": "clip_vision_model"}}


def _llama_config_json(vocab_size: int, **extra: object) -> dict:
    """A Llama config as vicuna-7b-v1.5's, every key explicit."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
            "torch_dtype": "float32", **LLAMA, **extra}


def _shards(weights: dict[str, torch.Tensor], first: Callable[[str], bool]) -> tuple[dict, dict]:
    """Split into two shards: the keys ``first(key)`` selects, then the rest (sorted within each)."""
    a = {k: weights[k] for k in sorted(weights) if first(k)}
    b = {k: weights[k] for k in sorted(weights) if not first(k)}
    return a, b


def _first_shard(key: str) -> bool:
    return key.startswith("model.embed_tokens.") or key.startswith("model.layers.0.")


def _legacy_tokenizer_json(path: Path) -> None:
    """Rewrite tokenizer.json in the older serialisation that tokenizers 0.15 (LLaVA's pin) reads and 0.23 still
    reads the same way: Metaspace with ``add_prefix_space`` (no ``split``), BPE merges as "a b" strings, no
    ``ignore_merges``. The encodings of the corpus are checked to be unchanged."""
    from tokenizers import Tokenizer

    data = json.loads(path.read_text(encoding="utf-8"))
    before = Tokenizer.from_file(str(path))
    for m in [*data["pre_tokenizer"]["pretokenizers"], data["decoder"]]:
        if m["type"] == "Metaspace":
            m.pop("split")
            m["add_prefix_space"] = True
    data["model"].pop("ignore_merges")
    assert not any(" " in a + b for a, b in data["model"]["merges"])
    data["model"]["merges"] = [f"{a} {b}" for a, b in data["model"]["merges"]]
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    after = Tokenizer.from_file(str(path))
    for text in [*CORPUS, PROMPT, *PROMPT.split("<image>")]:
        assert before.encode(text).ids == after.encode(text).ids, text


def _save_tokenizer(tok: PreTrainedTokenizerFast, path: Path) -> None:
    """save_pretrained, readable by LLaVA's transformers 4.37 / tokenizers 0.15 too: the class named
    ``PreTrainedTokenizerFast`` (transformers 5 writes its alias ``TokenizersBackend``), tokenizer.json in the
    older serialisation."""
    tok.save_pretrained(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(path / "tokenizer_config.json", cfg)
    _legacy_tokenizer_json(path / "tokenizer.json")


# sha256 of torch.randn(64, generator=manual_seed(0)) in float32 as ATen's AVX2 / AVX-512 kernels draw it (the
# kernels the official numbers' weights were drawn with); ATen's default kernel (a CPU without AVX2, or
# ATEN_CPU_CAPABILITY=default) rounds its Box-Muller step differently and draws other values (4e31654...)
AVX2_RANDN_SHA256 = "e1275a785936ab2f402174ff3c60fb3b7367f0d6ee9dfce7a6ea1f8d41520484"


def skip_unless_this_randn_draws_the_weights() -> None:
    """Skip (naming the reason) where this CPU's ``torch.randn`` cannot redraw the weights the official code ran on:
    the comparison would be with other weights. Anywhere else a weight file off its recorded sha256 is a failure."""
    import pytest

    drawn = hashlib.sha256(torch.randn(64, generator=torch.Generator().manual_seed(0)).numpy().tobytes()).hexdigest()
    if drawn != AVX2_RANDN_SHA256:
        pytest.skip(f"torch.randn on this CPU ({torch.backends.cpu.get_cpu_capability()} kernels) draws other "
                    "values than the AVX2 kernel the official fixture's weights were drawn with")


def build(out: Path, seed: int = SEED, sentencepiece: bool = False) -> dict[str, Path]:
    """Write clip/, llava/, vicuna/ and mm_projector.bin under ``out`` (see the module docstring); return their
    paths. Deterministic: two builds with the same seed give byte-identical weight files (CLIP's values come from
    a generator seeded ``seed``, the Llama's from ``seed + 1``, the projector's from ``seed + 2``).
    ``sentencepiece``: the LLM directories hold a SentencePiece ``tokenizer.model`` and no ``tokenizer.json``, as
    the published LLaVA-1.5 and Vicuna directories do (``sentencepiece_model``; the Llama's vocabulary is its 300
    pieces: other weights than the official numbers were computed on)."""
    from safetensors.torch import save_file

    out = Path(out)
    paths = {"clip": out / "clip", "llava": out / "llava", "vicuna": out / "vicuna",
             "mm_projector": out / "mm_projector.bin"}
    for key in ("clip", "llava", "vicuna"):
        paths[key].mkdir(parents=True, exist_ok=True)

    # CLIP, as openai/clip-vit-large-patch14-336
    _write_json(paths["clip"] / "config.json", _clip_config_json())
    save_file(_clip_weights(seed), paths["clip"] / "model.safetensors", metadata={"format": "pt"})
    _write_json(paths["clip"] / "preprocessor_config.json", {
        "crop_size": {"height": CLIP_VISION["image_size"], "width": CLIP_VISION["image_size"]},
        "do_center_crop": True, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": IMAGE_MEAN, "image_processor_type":
        "CLIPImageProcessor", "image_std": IMAGE_STD, "resample": 3, "rescale_factor": 1 / 255,
        "size": {"shortest_edge": CLIP_VISION["image_size"]}})

    tok = tokenizer()
    sp = sentencepiece_model() if sentencepiece else None
    vocab = 300 if sentencepiece else len(tok)
    llama = _llama_weights(vocab, seed)
    projector = _projector_weights(seed)

    # LLaVA-1.5, as liuhaotian/llava-v1.5-7b: two .bin shards, projector in the second
    llava_cfg = _llama_config_json(vocab, **LLAVA_KEYS)
    llava_cfg.update(architectures=["LlavaLlamaForCausalLM"], model_type="llava")
    _write_json(paths["llava"] / "config.json", llava_cfg)
    weight_map, total = {}, 0
    for i, shard in enumerate(_shards({**llama, **projector}, _first_shard), start=1):
        name = f"pytorch_model-0000{i}-of-00002.bin"
        torch.save({k: v.clone() for k, v in shard.items()}, paths["llava"] / name)
        weight_map.update({k: name for k in shard})
        total += sum(v.numel() * v.element_size() for v in shard.values())
    _write_json(paths["llava"] / "pytorch_model.bin.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(paths["llava"] / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    if sp:
        _save_sentencepiece(paths["llava"], sp)
    else:
        _save_tokenizer(tok, paths["llava"])

    # Vicuna + the pre-training stage's mm_projector.bin (CoIN's starting point)
    _write_json(paths["vicuna"] / "config.json", _llama_config_json(vocab))
    weight_map, total = {}, 0
    for i, shard in enumerate(_shards(llama, _first_shard), start=1):
        name = f"model-0000{i}-of-00002.safetensors"
        save_file(shard, paths["vicuna"] / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        total += sum(v.numel() * v.element_size() for v in shard.values())
    _write_json(paths["vicuna"] / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(paths["vicuna"] / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    if sp:
        _save_sentencepiece(paths["vicuna"], sp)
    else:
        _save_tokenizer(tok, paths["vicuna"])
    torch.save({k: v.clone() for k, v in projector.items()}, paths["mm_projector"])
    return paths


def weight_files(paths: dict[str, Path]) -> list[Path]:
    """The weight files of a build (what official/llava15.json records the sha256 of)."""
    files = [paths["clip"] / "model.safetensors", paths["mm_projector"]]
    files += sorted(paths["llava"].glob("pytorch_model-*.bin")) + sorted(paths["vicuna"].glob("model-*.safetensors"))
    return files


def weight_sha256(paths: dict[str, Path]) -> dict[str, str]:
    """sha256 of each weight file's bytes, keyed by its path under the build folder (official/llava15.json
    ``sha256``). The .bin bytes depend on torch's serializer; :func:`state_digest` does not."""
    root = paths["clip"].parent
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in weight_files(paths)}


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's names, dtypes, shapes and raw values in sorted key order: the same tensors give
    the same digest whatever file format or serializer version held them (official/llava15.json
    ``tensor_sha256``)."""
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().contiguous().cpu()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
