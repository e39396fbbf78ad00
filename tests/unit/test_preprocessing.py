"""What reaches the backbone when a config names no preset, and the one normalisation a run has."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from mcit.core.config import ConfigError, load_config
from mcit.data import transforms as X
from mcit.models.clip import CLIPBackbone
from mcit.models.vit import ViTBackbone
from mcit.run.plan import ResolvedBackbone
from mcit.run.preflight import image_pipeline

pytestmark = pytest.mark.unit


def _dir(tmp_path, name, config, processor):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "preprocessor_config.json").write_text(json.dumps(processor))
    return d


def test_a_directory_s_own_pipeline_is_its_image_processor_s(tmp_path):
    """CLIP's processor (shortest edge + centre crop) keeps the aspect ratio and crops; ViT's resizes the whole
    image; a directory without one gets the class's defaults. The ``backbone`` preset is that pipeline."""
    clip = _dir(tmp_path, "clip", {"vision_config": {"image_size": 24}},
                {"size": {"shortest_edge": 24}, "crop_size": {"height": 24, "width": 24}, "do_center_crop": True,
                 "resample": 3, "image_mean": [0.1, 0.2, 0.3], "image_std": [0.4, 0.5, 0.6]})
    vit = _dir(tmp_path, "vit", {"image_size": 16}, {"size": {"height": 16, "width": 16}, "resample": 2,
                                                     "image_mean": [0.5] * 3, "image_std": [0.5] * 3})
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"image_size": 8}))
    c, v, b = (CLIPBackbone.own_preprocessing(clip), ViTBackbone.own_preprocessing(vit),
               ViTBackbone.own_preprocessing(bare))
    assert (c.size, c.resize, c.interpolation, c.mean, c.std) == (24, 24, "bicubic", (0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    assert (v.size, v.resize, v.interpolation) == (16, None, "bilinear")
    assert (b.size, b.resize, b.mean) == (8, None, (0.5, 0.5, 0.5))
    wide = Image.fromarray(np.arange(48 * 30 * 3, dtype=np.uint8).reshape(30, 48, 3) % 251)
    out = X.build(X.BACKBONE, train=False, size=24, backbone=c)(wide)
    # shorter side 30 -> 24, longer 48 -> 38, then the central 24 columns: not the squashed picture
    expected = wide.resize((38, 24), 3).crop((7, 0, 31, 24))
    assert out.size == (24, 24) and np.array_equal(np.asarray(out), np.asarray(expected))
    assert X.build(X.BACKBONE, train=False, size=16, backbone=v)(wide).size == (16, 16)
    assert X.normalization(X.BACKBONE, c) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    assert (X.normalization("l2p", c) == X.NO_NORM
            and X.normalization("vpt_nsp2_cifar", c) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6)))


def test_train_and_eval_presets_must_normalise_alike(tmp_path):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text("name: c\nbackbone: {kind: vit, path: x, tag: vit_b16_in21k}\n"
                        "data: {root: r, tasks: [t0], train_transform: l2p, eval_transform: hide_cifar}\n"
                        "method: {name: seq}\n")
    cfg = load_config(cfg_path)
    with pytest.raises(ConfigError, match=r"data.eval_transform: preset 'hide_cifar' normalises with mean/std "
                                          r"\(\(0.5071, 0.4867, 0.4408\).*but data.train_transform 'l2p' with "
                                          r"\(\(0.0, 0.0, 0.0\), \(1.0, 1.0, 1.0\)\)"):
        image_pipeline(cfg, ResolvedBackbone("vit", str(tmp_path / "x"), {"tag": "vit_b16_in21k"}))
    cfg = load_config(cfg_path, ["data.eval_transform=l2p"])
    pre, norm = image_pipeline(cfg, ResolvedBackbone("vit", str(tmp_path / "x"), {"tag": "vit_b16_in21k"}))
    assert norm == X.NO_NORM and (pre.resize, pre.mean) == (248, (0.5, 0.5, 0.5))
    cfg = load_config(cfg_path, ["data.train_transform=backbone", "data.eval_transform=backbone"])
    assert image_pipeline(cfg, ResolvedBackbone("vit", str(tmp_path / "x"), {"tag": "vit_b16_in21k"}))[1] == \
        ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    cfg = load_config(cfg_path, ["data.normalization=backbone"])  # the named option: l2p's crops, the ViT's mean / std
    assert image_pipeline(cfg, ResolvedBackbone("vit", str(tmp_path / "x"), {"tag": "vit_b16_in21k"}))[1] == \
        ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
