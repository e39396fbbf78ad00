"""Strict loading: a checkpoint whose weights do not fill the backbone's transformers class exactly is refused in
pre-flight (one line naming the first keys, nothing read but key names and shapes) and at load time, instead of
training from randomly initialised weights; a checkpoint in the original LLaVA layout is named as such."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import mcit_config, run_main
from safetensors.torch import load_file, save_file

from mcit.models.base import BackboneError


def _copy(src: Path, dst: Path, edit) -> Path:
    """``src`` copied to ``dst`` with its model.safetensors passed through ``edit(state) -> state``."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    save_file(edit(state), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_vit_checkpoint_missing_a_weight_is_refused_before_loading_and_at_load(assets, tmp_path):
    from transformers import ViTModel

    from mcit.models.base import strict_from_pretrained
    from mcit.models.vit import ViTBackbone

    ViTBackbone.check(assets["backbone"])  # the intact checkpoint passes
    dropped = sorted(load_file(str(assets["backbone"] / "model.safetensors")))[3]
    bad = _copy(assets["backbone"], tmp_path / "vit", lambda s: {k: v for k, v in s.items() if k != dropped})
    with pytest.raises(BackboneError) as e:
        ViTBackbone.check(bad)
    msg = str(e.value)
    assert "\n" not in msg and str(bad) in msg and "ViTModel" in msg and f"1 missing (first: {dropped})" in msg
    with pytest.raises(BackboneError, match=f"1 missing \\(first: {dropped}\\)"):
        strict_from_pretrained(ViTModel, bad, add_pooling_layer=False)  # what from_path loads with


def test_a_vit_pooler_is_dropped_on_purpose_but_any_other_extra_key_is_refused(assets, tmp_path):
    from mcit.models.vit import ViTBackbone

    def with_pooler(state: dict) -> dict:
        h = state["layernorm.weight"].shape[0]
        return {**state, "pooler.dense.weight": torch.zeros(h, h), "pooler.dense.bias": torch.zeros(h)}

    ViTBackbone.check(_copy(assets["backbone"], tmp_path / "pooled", with_pooler))  # an HF ViT with its pooler
    stray = _copy(assets["backbone"], tmp_path / "stray", lambda s: {**s, "head.weight": torch.zeros(3, 3)})
    with pytest.raises(BackboneError, match=r"1 unexpected \(first: head.weight\)"):
        ViTBackbone.check(stray)


def test_a_llava_directory_whose_config_does_not_match_its_weights_is_refused(mcit_assets, tmp_path):
    """The silent failure the issue names: a config that builds another model than the weights describe
    (e.g. LLaVA's defaults read from a directory whose keys say otherwise) must not load as random weights."""
    from mcit.models.llava import LlavaBackbone

    LlavaBackbone.check(str(mcit_assets["backbone"]))
    bad = tmp_path / "llava"
    shutil.copytree(mcit_assets["backbone"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] += 1  # one more layer than the checkpoint has
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BackboneError) as e:
        LlavaBackbone.check(str(bad))
    assert "\n" not in str(e.value) and "missing" in str(e.value) and "LlavaForConditionalGeneration" in str(e.value)


def original_llava_dir(path: Path) -> Path:
    """A tiny checkpoint in the original LLaVA-1.5 layout (haotian-liu/LLaVA's LlavaLlamaForCausalLM):
    Llama keys at the top level, ``model.mm_projector.{0,2}``, the vision tower named by ``mm_vision_tower``."""
    path.mkdir(parents=True)
    h, v, inter, vocab = 48, 32, 96, 64
    cfg = {"architectures": ["LlavaLlamaForCausalLM"], "model_type": "llava", "hidden_size": h,
           "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
           "vocab_size": vocab, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
           "mm_vision_tower": "openai/clip-vit-large-patch14-336", "mm_projector_type": "mlp2x_gelu",
           "mm_vision_select_layer": -2, "mm_vision_select_feature": "patch", "mm_hidden_size": v,
           "image_aspect_ratio": "pad", "mm_use_im_start_end": False, "mm_use_im_patch_token": False}
    (path / "config.json").write_text(json.dumps(cfg))
    state = {"model.embed_tokens.weight": torch.zeros(vocab, h), "model.norm.weight": torch.ones(h),
             "lm_head.weight": torch.zeros(vocab, h), "model.mm_projector.0.weight": torch.zeros(h, v),
             "model.mm_projector.0.bias": torch.zeros(h), "model.mm_projector.2.weight": torch.zeros(h, h),
             "model.mm_projector.2.bias": torch.zeros(h)}
    for i in range(2):
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (h, h)), ("self_attn.v_proj", (h, h)),
                            ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (inter, h)), ("mlp.up_proj", (inter, h)),
                            ("mlp.down_proj", (h, inter))):
            state[f"model.layers.{i}.{name}.weight"] = torch.zeros(shape)
        state[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(h)
        state[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(h)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("tag", ["local", "llava_v1.5_7b_original"])
def test_an_original_llava_checkpoint_given_to_a_config_fails_preflight_in_one_line(mcit_assets, tmp_path, tag):
    """Under any tag, and under the zoo's tag for the original layout, pre-flight names the converter to run."""
    original = original_llava_dir(tmp_path / "llava-v1.5-tiny")
    cfg = mcit_config(mcit_assets, tmp_path, backbone={"kind": "llava", "path": str(original), "tag": tag})
    res = run_main(["--config", str(cfg)])
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "original" in lines[0]
    assert str(original) in lines[0] and "python -m data_prep.convert_llava --llava" in lines[0]
    assert not (tmp_path / "runs" / "mcit").exists()  # nothing written, nothing trained


def test_a_weight_of_another_shape_is_named(assets, tmp_path):
    from mcit.models.vit import ViTBackbone

    def wider(state: dict) -> dict:
        w = state["layernorm.weight"]
        return {**state, "layernorm.weight": torch.ones(w.shape[0] + 1)}

    with pytest.raises(BackboneError, match=r"1 with other shapes \(first: layernorm.weight\)"):
        ViTBackbone.check(_copy(assets["backbone"], tmp_path / "wide", wider))
