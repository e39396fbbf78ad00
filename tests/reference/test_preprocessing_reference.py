"""Every shipped CIL config feeds its backbone the pixels its method's official code feeds it, and every backbone
tag's own pipeline is its release's (official/preprocessing.json: each repository's transform code run with
torchvision outside this repository; its "source" says how, each pipeline names repository, commit and function).

Evaluation: the four fixed images through the config's eval pipeline (the preset, then the normalisation the run
sets on the backbone, as ``mcit.run.preflight.image_pipeline`` decides it) must give the official tensor: the same
uint8 pixels everywhere (sha256) and the same values at 64 positions and per-channel mean / std to 1e-5.
Training: the config's train steps must have the official parameters (crop scale, ratio, interpolation, flip
probability, jitter ranges, AutoAugment policy) and normalisation, and the crop box, flip, jitter factors and
AutoAugment draw the official code drew, applied by our steps, must give the official tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
from preprocessing_inputs import images, sample_positions

from mcit.core.config import load_config
from mcit.data import transforms as X
from mcit.models import zoo as Z
from mcit.run.plan import ResolvedBackbone
from mcit.run.preflight import image_pipeline

ROOT = Path(__file__).resolve().parents[2]
REF = json.loads((Path(__file__).parent / "official" / "preprocessing.json").read_text())
CONFIGS = sorted((ROOT / "configs" / "cil").glob("*.yaml"))
TOL = 1e-5

# Which official code base each shipped config follows (the config's header says the same): the method's own
# repository, except where that repository has no config for the data set and the config follows the one that
# does (L2P and DualPrompt on CUB-200 and L2P on ImageNet-R run as HiDe-Prompt's configs/{cub,imr}_{l2p,dualprompt}.py).
BENCH = {"cifar100": "cifar100", "cub": "cub200", "domainnet": "domainnet", "imr": "imagenet-r"}
REPOSITORY = {"l2p": "l2p-pytorch", "dualprompt": "dualprompt-pytorch", "l2p_pgp": "pgp-l2p",
              "dualprompt_pgp": "pgp-dualprompt", "soft_tf": "soft-tf", "soft_tf_gradient_id": "soft-tf",
              "l2p_soft_tf": "soft-tf", "coda_prompt": "coda-prompt", "hide_prompt": "hide-prompt", "norga": "norga",
              "vpt_nsp2": "vpt-nsp2", "vpt_nsp2_clip": "vpt-nsp2-clip", "star_prompt": "mammoth-2024-07",
              "clip_zero_shot": "openai-clip"}
FOLLOWS = {("l2p", "cub"): "hide-prompt", ("l2p", "imr"): "hide-prompt", ("dualprompt", "cub"): "hide-prompt"}


def official_pipeline(config: Path) -> str:
    bench, _, method = config.stem.split("_", 2)
    repo = FOLLOWS.get((method, bench), REPOSITORY[method])
    return f"{repo}/any" if repo == "openai-clip" else f"{repo}/{BENCH[bench]}"


def _cmp_record(t: np.ndarray, px: np.ndarray, ref: dict) -> list[str]:
    """What differs between our (3, H, W) tensor ``t`` (made from uint8 HWC ``px``) and an official record."""
    bad = []
    if list(t.shape) != ref["shape"]:
        return [f"shape {list(t.shape)} != {ref['shape']}"]
    if hashlib.sha256(np.ascontiguousarray(px).tobytes()).hexdigest() != ref["pixels_sha256"]:
        bad.append("pixels differ")
    flat = t.reshape(-1)
    got = flat[sample_positions(flat.size)]
    worst = float(np.abs(got - np.asarray(ref["samples"])).max())
    if worst > TOL:
        bad.append(f"sampled values differ by up to {worst:.3g}")
    for key, ours in (("channel_mean", t.astype(np.float64).mean(axis=(1, 2))),
                      ("channel_std", t.astype(np.float64).std(axis=(1, 2)))):
        if not np.allclose(ours, ref[key], rtol=0, atol=TOL):
            bad.append(f"{key} {ours.tolist()} != {ref[key]}")
    return bad


def _ours(compose: X.Compose, img, norm, params=None) -> tuple[np.ndarray, np.ndarray]:
    out = compose(img) if params is None else compose.replay(img, params)
    out = out.convert("RGB")
    return X.to_tensor([out], *norm)[0].numpy(), np.asarray(out)


def _same_steps(ours: list[dict], theirs: list[dict]) -> bool:
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        if a.keys() != b.keys():
            return False
        for k in a:
            x, y = a[k], b[k]
            if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
                if len(x) != len(y) or not all(math.isclose(u, v, rel_tol=1e-9) for u, v in zip(x, y)):
                    return False
            elif isinstance(x, float) or isinstance(y, float):
                if not math.isclose(x, y, rel_tol=1e-9):
                    return False
            elif x != y:
                return False
    return True


def _config_pipeline(config: Path):
    cfg = load_config(config)
    tag = cfg.backbone.tag
    assert tag in Z.ZOO, f"{config.name}: backbone.tag {tag!r} is not a zoo tag"
    pre, norm = image_pipeline(cfg, ResolvedBackbone(cfg.backbone.kind, str(ROOT / cfg.backbone.path), {"tag": tag}))
    return cfg, pre, norm


def test_every_shipped_cil_config_has_an_official_pipeline_on_record():
    missing = [c.name for c in CONFIGS if official_pipeline(c) not in REF["pipelines"]]
    assert len(CONFIGS) == 56 and not missing, missing


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_evaluation_tensors_equal_the_official_pipeline(config):
    cfg, pre, norm = _config_pipeline(config)
    recipe = REF["recipes"][REF["pipelines"][official_pipeline(config)]["recipe"]]
    assert norm is not None and np.allclose(norm[0], recipe["normalize"]["mean"], rtol=0, atol=1e-9) \
        and np.allclose(norm[1], recipe["normalize"]["std"], rtol=0, atol=1e-9), (norm, recipe["normalize"])
    compose = X.build(cfg.data.eval_transform, train=False, size=pre.size, backbone=pre)
    assert _same_steps(compose.describe(), recipe["eval_steps"]), (compose.describe(), recipe["eval_steps"])
    bad = {}
    for name, img in images().items():
        t, px = _ours(compose, img, norm)
        if diff := _cmp_record(t, px, recipe["images"][name]):
            bad[name] = diff
    assert not bad, bad


def _params(compose: X.Compose, draw: dict) -> list:
    """The official draw as our random steps' parameters, in step order."""
    out = []
    for step in compose.steps:
        if isinstance(step, X.RandomResizedCrop):
            out.append(tuple(draw["crop"]))
        elif isinstance(step, X.RandomHorizontalFlip):
            out.append(bool(draw["flip"]))
        elif isinstance(step, X.ColorJitter):
            j = draw["jitter"]
            out.append((j["order"], [j["brightness"], j["contrast"], j["saturation"]]))
        elif isinstance(step, X.AutoAugment):
            a = draw["autoaugment"]
            out.append((a["policy"], a["probs"], a["signs"]))
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_training_steps_and_drawn_augmentations_equal_the_official_pipeline(config):
    cfg, pre, norm = _config_pipeline(config)
    recipe = REF["recipes"][REF["pipelines"][official_pipeline(config)]["recipe"]]
    assert X.normalization(cfg.data.train_transform, pre) == norm
    compose = X.build(cfg.data.train_transform, train=True, size=pre.size, backbone=pre)
    assert _same_steps(compose.describe(), recipe["train_steps"]), (compose.describe(), recipe["train_steps"])
    ims = images()
    bad = {}
    for d in recipe["draws"]:
        t, px = _ours(compose, ims[d["image"]], norm, _params(compose, d))
        if diff := _cmp_record(t, px, d["out"]):
            bad[(d["image"], d["seed"])] = diff
    assert len(recipe["draws"]) == 5 and not bad, bad


def test_our_own_draws_follow_torchvision_s_random_stream():
    """With the generator torchvision's global RNG would be (``manual_seed(seed)``), our steps draw exactly what the
    official train pipelines drew: the crop box, the flip, the jitter order and factors, the AutoAugment draw."""
    import torch

    ims = images()
    checked = 0
    for preset, rid in (("hide_cifar", "hide-prompt/cifar100"), ("vpt_nsp2_cifar", "vpt-nsp2/cifar100"),
                        ("l2p", "l2p-pytorch/cifar100"), ("star_imagenet_r", "mammoth-2024-07/imagenet-r")):
        recipe = REF["recipes"][REF["pipelines"][rid]["recipe"]]
        compose = X.build(preset, train=True, size=224)
        for d in recipe["draws"]:
            g = torch.Generator().manual_seed(d["seed"])
            img, drawn = ims[d["image"]].convert("RGB"), []
            for step in compose.steps:
                p = step.draw(img, g) if step.random else None
                drawn.append(p) if step.random else None
                img = step.apply(img, p)
            assert [tuple(x) if isinstance(x, list) else x for x in drawn] == \
                [tuple(x) if isinstance(x, list) else x for x in _params(compose, d)], (preset, d["seed"])
            checked += 1
    assert checked == 20


@pytest.mark.parametrize("tag", sorted(REF["backbones"]))
def test_a_tag_s_own_pipeline_is_its_release_s(tag):
    """What a config without a preset gets (``data.*_transform: backbone``): the release's own evaluation resize,
    crop, filter and mean / std, never a squash to the input size."""
    ref = REF["backbones"][tag]
    ref = REF["backbones"][ref["same_as"]] if "same_as" in ref else ref
    pre = Z.ZOO[tag].preprocessing()
    compose = X.build(X.BACKBONE, train=False, size=pre.size, backbone=pre)
    assert _same_steps(compose.describe(), ref["steps"]), (compose.describe(), ref["steps"])
    assert X.build(X.BACKBONE, train=True, size=pre.size, backbone=pre) == compose  # no augmentation either
    norm = X.normalization(X.BACKBONE, pre)
    assert (np.allclose(norm[0], ref["normalize"]["mean"], atol=1e-7)
            and np.allclose(norm[1], ref["normalize"]["std"], atol=1e-7))
    bad = {name: diff for name, img in images().items()
           if (diff := _cmp_record(*_ours(compose, img, norm), ref["images"][name]))}
    assert not bad, bad


def test_every_tag_in_a_shipped_config_is_a_zoo_tag_of_its_kind():
    """Including a method's own backbones (STAR-Prompt's ``clip_tag``) and the MCIT and demo configs."""
    import yaml

    bad = []
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if not isinstance(doc, dict) or "backbone" not in doc:
            continue
        bb = doc["backbone"]
        if Z.ZOO.get(bb.get("tag"), None) is None or Z.ZOO[bb["tag"]].kind != bb.get("kind"):
            bad.append(f"{path.name}: backbone.tag {bb.get('tag')!r}")
        for key, value in (doc.get("method") or {}).items():
            if key.endswith("_tag") and value not in Z.ZOO:
                bad.append(f"{path.name}: method.{key} {value!r}")
    assert not bad, bad


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.stem.endswith("_star_prompt")], ids=lambda p: p.stem)
def test_star_prompt_s_two_levels_stream_the_official_pixels(config):
    """mammoth d003b9a: the first level trains and fits its statistics on ``clip.load``'s preprocess
    (``end_to_end_model.py`` 244-249, ``first_stage_model.py`` 54: openai/CLIP ``_transform(224)``), so its
    batches are the CLIP zoo tag's own pipeline, pixel for pixel and value for value (0.0 on the portrait and
    landscape ImageNet-R sizes); the second level fits its statistics on the augmented train stream
    (``update_statistics`` iterates ``dataset.train_loader``), whose steps the training test above checks."""
    from mcit.core.registry import METHODS
    from mcit.run.preflight import auxiliary_preprocessing

    cfg = load_config(config)
    cls, params = METHODS.get("star_prompt"), cfg.method.params()
    assert [cls.image_pipeline(params, "first", s).auxiliary for s in ("train", "subspace")] == ["clip", "clip"]
    second = cls.image_pipeline(params, "second", "subspace")
    assert second.auxiliary is None and second.augment is True
    assert cls.image_pipeline(params, "second", "train").augment is None  # the run's augmented train stream
    aux = {"clip": ResolvedBackbone("clip", str(ROOT / params.clip_path), {"tag": params.clip_tag})}
    pre = auxiliary_preprocessing(aux)["clip"]
    recipe = REF["recipes"][REF["pipelines"]["openai-clip/any"]["recipe"]]
    assert list(pre.mean) == recipe["normalize"]["mean"] and list(pre.std) == recipe["normalize"]["std"]
    compose = pre.steps()
    assert _same_steps(compose.describe(), recipe["eval_steps"]), (compose.describe(), recipe["eval_steps"])
    bad = {}
    for name, img in images().items():
        t, px = _ours(compose, img, (pre.mean, pre.std))
        ref = recipe["images"][name]
        flat = t.reshape(-1)
        worst = float(np.abs(flat[sample_positions(flat.size)] - np.asarray(ref["samples"])).max())
        if diff := _cmp_record(t, px, ref) + ([f"sampled values differ by {worst:.3g}"] if worst != 0.0 else []):
            bad[name] = diff
    assert not bad, bad
