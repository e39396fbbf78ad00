"""The offline converter (data_prep/convert_llava.py) against haotian-liu/LLaVA's own model code
(official/llava15.json: repository, commit, functions): a tiny checkpoint in the original LLaVA-1.5 layout and as
Vicuna + mm_projector.bin (tests/reference/llava_original.py, the same bytes the official numbers came from)
converts into a transformers LlavaForConditionalGeneration directory whose

* processor gives LLaVA's pixel values (expand2square with the mean colour + CLIP processing) and, with the
  vicuna_v1 format, LLaVA's token ids (tokenizer_image_token, the image token expanded to its 16 features);
* logits through mcit's wrapper and through transformers' own forward equal LLaVA's to 1e-5 of their scale, and
  its greedy answer is LLaVA's greedy answer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import tiny_inputs as T
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
OFFICIAL = HERE / "official"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(official tensors, official record, {layout: converted directory}, the builder's paths)."""
    import llava_original as L

    from data_prep.convert_llava import check_sources, convert

    L.skip_unless_this_randn_draws_the_weights()
    base = tmp_path_factory.mktemp("llava_original")
    paths = L.build(base / "src")
    rec = json.loads((OFFICIAL / "llava15.json").read_text())
    for rel, digest in rec["sha256"].items():  # the inputs are the bytes LLaVA's code ran on
        assert hashlib.sha256((base / "src" / rel).read_bytes()).hexdigest() == digest, rel
    out = {"llava": base / "hf", "vicuna": base / "hf_vicuna"}
    convert(check_sources(paths["llava"], None, None, paths["clip"]), out["llava"], progress=False)
    convert(check_sources(None, paths["vicuna"], paths["mm_projector"], paths["clip"]), out["vicuna"],
            max_shard_bytes=20_000, progress=False)  # several output shards
    return load_file(str(OFFICIAL / "llava15.safetensors")), rec, out, paths


@pytest.mark.parametrize("layout", ["llava", "vicuna"])
@torch.no_grad()
def test_converted_checkpoint_gives_llavas_pixels_tokens_logits_and_answer(converted, layout):
    import llava_original as L

    from mcit.models.base import load_backbone

    ref, rec, out, _ = converted
    bb = load_backbone("llava", str(out[layout]), chat_format="vicuna_v1")
    assert bb.model.config.text_config.hidden_size == 48 and bb.model.config.vision_feature_layer == -2
    batch = bb.make_collate(None, 0, train=False)([L.sample(L.image())])
    # pixels: LLaVA's expand2square (a 40 x 24 image, so the padding matters) + CLIP processing
    pv = ref["pixel_values"]
    T.compare(batch.pixel_values, pv, f"{layout}: pixels", 1e-5, float(pv.abs().max()))
    # tokens: LLaVA's tokenizer_image_token of the vicuna_v1 prompt, -200 expanded to the 16 image tokens
    ids = ref["input_ids"][0].tolist()
    at = ids.index(-200)
    n_image = bb.model.config.image_seq_length
    assert batch.inputs["input_ids"][0].tolist() == ids[:at] + [bb.image_token_id] * n_image + ids[at + 1:]
    # logits over LLaVA's vocabulary (the added <image> / <pad> columns are llava-hf's, not LLaVA's)
    want = ref["logits" if layout == "llava" else "logits_vicuna"][0]
    V = want.shape[-1]
    scale = float(want.abs().max())
    assert scale > 1.0 and float(want.std(-1).min()) > 0.1  # far from trivial
    embeds, _ = bb.input_embeddings(batch)
    mine = bb.logits(embeds, batch.inputs["attention_mask"])[0, :, :V]
    theirs = bb.model(**bb.model_inputs(batch)).logits[0, :, :V]
    for path, got in (("the method's logits", mine), ("the model's own forward", theirs)):
        T.compare(got, want, f"{layout}: logits ({path})", 1e-5, scale)
    # greedy decoding: LLaVA's 5 new tokens (the added rows are means: never a strict maximum)
    answer = bb.generate(embeds, batch.inputs["attention_mask"], 5)
    assert answer == [bb.tokenizer.decode(ref["greedy_ids"][0].tolist(), skip_special_tokens=True).strip()]
    assert rec["max_abs_diff_logits_vicuna"] == 0.0


def test_the_converted_directory_loads_strictly_and_records_its_inputs_and_outputs(converted):
    from mcit.models.mllm import MLLMBackbone
    from mcit.models.zoo import sha256_path

    _, _, out, paths = converted
    for layout, d in out.items():
        MLLMBackbone.check(str(d))  # every weight of LlavaForConditionalGeneration, none left over
        zoo = json.loads((d / "zoo.json").read_text())
        assert zoo["format"] == ("llava_original" if layout == "llava" else "vicuna_mm_projector")
        assert zoo["sources_sha256"]["llm"] == sha256_path(paths[layout])
        assert zoo["sources_sha256"]["clip"] == sha256_path(paths["clip"])
        for name, digest in zoo["outputs_sha256"].items():
            assert hashlib.sha256((d / name).read_bytes()).hexdigest() == digest or name.endswith(".json"), name
        assert zoo["keys_dropped_by_rule"] == {"clip": 39}  # CLIPModel's text tower, projections, logit scale
        assert zoo["added_tokens"] == ["<image>", "<pad>"]
    assert len(list(out["vicuna"].glob("model-*.safetensors"))) > 1
    a = load_file(str(next(out["llava"].glob("model-*.safetensors"))))
    b = {}
    for f in out["vicuna"].glob("model-*.safetensors"):
        b.update(load_file(str(f)))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("major", [5, 4])
def test_a_clip_vision_model_directory_converts_to_the_same_checkpoint(converted, tmp_path, major):
    """The CLIP tower saved as ``CLIPVisionModel``: transformers 5's ``save_pretrained`` writes its keys without
    ``vision_model.`` (the layout used to be refused: "no rule maps it"), transformers 4's with it. Either converts
    to the weights the full ``CLIPModel`` directory gives, bit for bit (and so to the logits checked above)."""
    import shutil

    from transformers import CLIPVisionConfig, CLIPVisionModel

    from data_prep.convert_llava import check_sources, convert

    _, _, out, paths = converted
    full = load_file(str(paths["clip"] / "model.safetensors"))
    vision = {k[len("vision_model."):]: v for k, v in full.items() if k.startswith("vision_model.")}
    clip = tmp_path / f"clip_vision_v{major}"
    cfg = CLIPVisionConfig(**json.loads((paths["clip"] / "config.json").read_text())["vision_config"])
    model = CLIPVisionModel(cfg)
    model.load_state_dict(vision, strict=True)
    model.save_pretrained(clip)  # transformers 5's own layout
    if major == 4:  # the same tensors under transformers 4's names
        from safetensors.torch import save_file

        saved = load_file(str(clip / "model.safetensors"))
        assert not any(k.startswith("vision_model.") for k in saved)
        save_file({"vision_model." + k: v for k, v in saved.items()}, clip / "model.safetensors",
                  metadata={"format": "pt"})
    shutil.copy(paths["clip"] / "preprocessor_config.json", clip)
    convert(check_sources(paths["llava"], None, None, clip), tmp_path / "hf", progress=False)
    a = load_file(str(next(out["llava"].glob("model-*.safetensors"))))
    b = load_file(str(next((tmp_path / "hf").glob("model-*.safetensors"))))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_converter_refuses_what_it_cannot_convert_in_one_line(converted, tmp_path):
    import shutil
    import subprocess
    import sys

    _, _, out, paths = converted

    def run(*args) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "data_prep.convert_llava", "--no-progress", *map(str, args)],
                              capture_output=True, text=True, cwd=HERE.parent.parent)

    def one_line(r: subprocess.CompletedProcess, *words: str) -> None:
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert r.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), r.stderr

    before = sorted(p.name for p in out["llava"].iterdir())
    one_line(run("--llava", paths["llava"], "--clip", paths["clip"], "--out", out["llava"]), "already exists")
    assert sorted(p.name for p in out["llava"].iterdir()) == before
    one_line(run("--llava", paths["vicuna"], "--clip", paths["clip"], "--out", tmp_path / "o"),
             "not an original LLaVA checkpoint", "--vicuna")
    one_line(run("--vicuna", paths["vicuna"], "--clip", paths["clip"], "--out", tmp_path / "o"), "--mm-projector")
    # a checkpoint with a key no rule knows, and one whose projector is missing: named, nothing written
    bad = tmp_path / "bad"
    shutil.copytree(paths["llava"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "mm_projector_type": "linear"}))
    one_line(run("--llava", bad, "--clip", paths["clip"], "--out", tmp_path / "o"), "mm_projector_type", "'linear'")
    (bad / "config.json").write_text(json.dumps(cfg))
    shard = bad / "pytorch_model-00002-of-00002.bin"
    sd = torch.load(shard, weights_only=True)
    sd["model.extra_head.weight"] = torch.zeros(2)
    torch.save(sd, shard)
    one_line(run("--llava", bad, "--clip", paths["clip"], "--out", tmp_path / "o"), "model.extra_head.weight",
             str(shard))
    del sd["model.extra_head.weight"]
    sd = {k: v for k, v in sd.items() if "mm_projector" not in k}
    torch.save(sd, shard)
    one_line(run("--llava", bad, "--clip", paths["clip"], "--out", tmp_path / "o"), "multi_modal_projector")
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("o.partial*"))


def test_every_shape_comes_from_the_checkpoints_own_configs():
    """liuhaotian/llava-v1.5-13b's config and CLIP ViT-L/14-336's give a 13B llava-hf config (LLaVA's defaults are
    the 7B's: nothing may come from them)."""
    import llava_original as L
    from accelerate import init_empty_weights
    from transformers import LlavaForConditionalGeneration

    from data_prep.convert_llava import Sources, llava_config

    llm = {"model_type": "llava", "architectures": ["LlavaLlamaForCausalLM"], "hidden_size": 5120,
           "intermediate_size": 13824, "num_attention_heads": 40, "num_key_value_heads": 40, "num_hidden_layers": 40,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "vocab_size": 32000, "mm_hidden_size": 1024,
           "mm_projector_type": "mlp2x_gelu", "mm_vision_select_layer": -2, "mm_vision_select_feature": "patch"}
    clip = {"model_type": "clip", "vision_config": {"hidden_size": 1024, "intermediate_size": 4096,
                                                    "num_attention_heads": 16, "num_hidden_layers": 24,
                                                    "image_size": 336, "patch_size": 14, "projection_dim": 768}}
    tok = L.tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"], "pad_token": "<pad>"})
    cfg = llava_config(Sources(Path("llm"), Path("clip"), None, llm, clip), tok)
    t, v = cfg.text_config, cfg.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.intermediate_size, t.num_attention_heads) == (5120, 40, 13824, 40)
    assert (v.hidden_size, v.num_hidden_layers, v.image_size, v.patch_size) == (1024, 24, 336, 14)
    assert cfg.image_seq_length == 576 and cfg.vision_feature_layer == -2 and t.vocab_size % 64 == 0
    with init_empty_weights():
        model = LlavaForConditionalGeneration(cfg)
    n = sum(p.numel() for p in model.parameters()) + 2 * (32064 - t.vocab_size) * 5120  # the real vocabulary
    assert 13.3e9 < n < 13.4e9, n
