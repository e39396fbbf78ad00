"""The CLIP backbone and the CLIP-based continual methods: same outputs as transformers' CLIPModel,
VPT-NSP² reused on CLIP's image encoder, zero-shot CLIP as the baseline, per-sample inference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence


@pytest.fixture(scope="module")
def digits_sequence():
    from data_prep.digits import CLASS_NAMES

    return TaskSequence.from_label_spaces(["t0", "t1"], [[0, 1], [2, 3]], dict(enumerate(CLASS_NAMES)))


def _batch(n: int, seed: int = 0, task: int = 0, classes=(0, 1)) -> Batch:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 16, 16, generator=g)
    y = torch.tensor([classes[i % len(classes)] for i in range(n)])
    return Batch(x, y, torch.ones(n), task)


def test_clip_backbone_matches_transformers_clip(clip):
    x = torch.randn(5, 3, 16, 16)
    ref = F.normalize(clip.model.get_image_features(pixel_values=x).pooler_output, dim=-1)
    assert torch.allclose(clip.image_features(x), ref, atol=1e-6)
    texts = ["a photo of the digit seven.", "a ring"]
    enc = clip.tokenize(texts)
    ref_t = F.normalize(clip.model.get_text_features(**enc).pooler_output, dim=-1)
    assert torch.allclose(clip.text_features(texts), ref_t, atol=1e-6)
    emb = clip.model.text_model.embeddings.token_embedding(enc["input_ids"])
    assert torch.allclose(clip.text_features_from_embeddings(emb, enc["input_ids"], enc["attention_mask"]), ref_t,
                          atol=1e-6)
    # template ensembling: the normalised mean of the normalised template embeddings
    both = clip.class_text_features(["seven"], ["a photo of the digit {}.", "the digit {}."])
    single = clip.text_features(["a photo of the digit seven.", "the digit seven."])
    assert torch.allclose(both[0], F.normalize(single.mean(0), dim=-1), atol=1e-6)


def test_clip_class_names_reach_the_sequence(assets, tmp_path):
    from conftest import tiny_config

    from mcit.core.config import load_config
    from mcit.run.preflight import preflight

    cfg = load_config(tiny_config(assets, tmp_path))
    from data_prep.digits import CLASS_NAMES

    seq = preflight(cfg).sequence
    assert len(seq.class_names) == seq.num_classes == 6
    assert list(seq.class_names) == [CLASS_NAMES[lab] for lab in seq.labels]


def test_vpt_nsp2_on_clip_uses_clip_classifier_and_zero_shot_is_clip(clip, digits_sequence):
    torch.manual_seed(0)
    cls = METHODS.get("vpt_nsp2")
    m = cls(cls.Params(prompt_length=2, layers=[0], temperature=1.0, refine_head=True, refine_epochs=2,
                       refine_samples=16, templates=["a photo of the digit {}."]), clip, digits_sequence)
    assert m.text_classifier and not m.head.weight.requires_grad
    assert {n for n, p in m.named_parameters() if p.requires_grad} == {"prompt", "logit_scale"}
    zs = METHODS.get("clip_zero_shot")
    base = zs(zs.Params(templates=["a photo of the digit {}."]), clip, digits_sequence)
    b = _batch(12)
    with m.zero_shot():
        assert torch.equal(m.predict(b), base.predict(b))
    sim = clip.image_features(b.pixel_values) @ base.text_feats.t()
    assert torch.equal(base.predict(b), sim.argmax(-1))
    # the prompts change the features outside the zero-shot context
    assert not torch.allclose(m.logits(b.pixel_values), m.classify(clip.cls_features(b.pixel_values)))


def test_vpt_nsp2_clip_refine_head_trains_projection_on_class_gaussians(clip, digits_sequence):
    torch.manual_seed(0)
    cls = METHODS.get("vpt_nsp2")
    m = cls(cls.Params(prompt_length=2, layers=[0, 1], refine_head=True, refine_epochs=3, refine_samples=32),
            clip, digits_sequence)
    m.set_task(0)
    stats = m.statistics(_batch(20))
    assert stats["feat_sum"].shape == (2, clip.hidden_size) and stats["n"].tolist() == [10.0, 10.0]
    w0 = m.head.weight.detach().clone()
    m.finalize_statistics(stats, 0)
    assert m.seen[:2].all() and not m.seen[2:].any()
    assert not torch.equal(m.head.weight, w0) and not m.head.weight.requires_grad
    assert int(m.tasks_projected) == 1 and m.proj1.shape == (2, clip.hidden_size, clip.hidden_size)
    assert "refine_loss" in m.subspace_report()


def test_vpt_nsp2_clip_refine_trains_the_zero_bias_and_leaves_the_logit_scale_untouched(clip, digits_sequence):
    """The official head is timm's conversion of CLIP's projection: a Linear with a zero bias, frozen while the
    prompts train and refined (weight and bias) in the subspace stage. The refinement reads the logit scale
    but must leave no gradient on it: DeepSpeed would add it to the next task's first step."""
    torch.manual_seed(0)
    cls = METHODS.get("vpt_nsp2")
    m = cls(cls.Params(prompt_length=2, layers=[0], refine_head=True, refine_epochs=2, refine_samples=16),
            clip, digits_sequence)
    assert m.head.bias is not None and m.head.bias.eq(0).all() and not m.head.bias.requires_grad
    assert m.logit_scale.requires_grad and m.logit_scale.grad is None
    scale = m.logit_scale.detach().clone()
    m.set_task(0)
    m.finalize_statistics(m.statistics(_batch(20)), 0)
    assert m.head.bias.abs().sum() > 0 and not m.head.bias.requires_grad
    assert m.logit_scale.grad is None and torch.equal(m.logit_scale.detach(), scale)
    m2 = cls(cls.Params(prompt_length=2, layers=[0], head_bias=False), clip, digits_sequence)
    assert m2.head.bias is None


@pytest.mark.parametrize("name", ["vpt_nsp2", "clip_zero_shot"])
def test_clip_predictions_do_not_change_with_test_batch_size(name, clip, digits_sequence):
    torch.manual_seed(1)
    cls = METHODS.get(name)
    params = {"vpt_nsp2": {"prompt_length": 2, "layers": [0]}, "clip_zero_shot": {}}[name]
    m = cls(cls.Params(**params), clip, digits_sequence)
    b = _batch(64, seed=3)
    b.allowed_classes = torch.ones(digits_sequence.num_classes, dtype=torch.bool)
    full = m.predict(b)
    one = torch.cat([m.predict(b.select(torch.tensor([i]))) for i in range(64)])
    assert torch.equal(full, one)


def test_residual_prompt_on_values_equals_adding_w_o_p_after_attention():
    """STAR-Prompt's residual p added to V in every head == W_o p added to the attention output."""
    from transformers import ViTConfig, ViTModel

    from mcit.models.base import LayerPrompt
    from mcit.models.vit import ViTBackbone

    torch.manual_seed(0)
    bb = ViTBackbone(ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                        intermediate_size=64, image_size=16, patch_size=4), add_pooling_layer=False),
                     [0.5] * 3, [0.5] * 3)
    h = bb.embed(torch.randn(3, 3, 16, 16))
    p = torch.randn(3, 32)
    layer = bb.layers[0]
    with torch.no_grad():
        residual = layer(h, None, mcit_prompt=LayerPrompt(value_residual=p.view(3, 4, 1, 8)))
        o_proj = layer.attention.o_proj
        hook = o_proj.register_forward_hook(lambda m, i, out: out + (p @ m.weight.t()).unsqueeze(1))
        try:
            after = layer(h, None)
        finally:
            hook.remove()
        plain = layer(h, None)
    assert torch.allclose(residual, after, atol=1e-5)
    assert not torch.allclose(residual, plain, atol=1e-3)


def test_mixture_fit_recovers_known_components():
    from mcit.methods.class_gaussians import fit_mixture, sample_mixture

    g = torch.Generator().manual_seed(0)
    means = torch.tensor([[0.0, 0.0, 0.0], [6.0, 0.0, -3.0], [0.0, 8.0, 4.0]])
    stds = torch.tensor([[1.0, 0.5, 1.0], [0.3, 0.3, 0.3], [2.0, 1.0, 0.5]])
    counts = [600, 300, 900]
    x = torch.cat([means[k] + stds[k] * torch.randn(n, 3, generator=g) for k, n in enumerate(counts)])
    w, mu, var = fit_mixture(x, 3, iters=200, seed=0)
    order = [int(torch.cdist(means[k:k + 1], mu).argmin()) for k in range(3)]
    assert sorted(order) == [0, 1, 2]
    assert torch.allclose(mu[order], means, atol=0.25)
    assert torch.allclose(var[order].sqrt(), stds, rtol=0.15)
    assert torch.allclose(w[order], torch.tensor(counts) / sum(counts), atol=0.02)
    # sampling reproduces the mixture's moments
    s = sample_mixture(w, mu, var, 20000, torch.Generator().manual_seed(1))
    assert torch.allclose(s.mean(0), x.mean(0), atol=0.15)
    # fewer samples than components: the extra components get weight 0
    w2, _, _ = fit_mixture(x[:2], 5, iters=10)
    assert w2[2:].eq(0).all() and torch.isclose(w2.sum(), torch.tensor(1.0))


@pytest.fixture(scope="module")
def vit(assets):
    from mcit.models.vit import ViTBackbone

    return ViTBackbone.from_path(assets["backbone"])


def _star(vit, clip, clip_backbone, sequence, **over):
    cls = METHODS.get("star_prompt")
    params = {"clip_path": str(clip_backbone), "mog_components": 2, "mog_iters_first": 20, "mog_iters_second": 20,
              "gr_first_epochs": 1, "gr_second_epochs": 1, "gr_samples": 8, **over}
    torch.manual_seed(0)
    return cls(cls.Params(**params), vit, sequence, auxiliary={"clip": clip})


def _step(m, batch):
    out = m(batch)
    (out.per_sample.mean() + out.regularizer).backward()
    with torch.no_grad():
        for p in m.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
                p.grad = None


def test_star_prompt_two_levels_train_what_they_should_and_infer_per_sample(vit, clip, clip_backbone, digits_sequence):
    m = _star(vit, clip, clip_backbone, digits_sequence)
    # the second level's head starts as mammoth's ViT head (init_weights_vit_timm): bias 0, weights of std 0.02
    assert not m.head.bias.any() and abs(float(m.head.weight.std()) - 0.02) < 0.004
    for task in (0, 1):
        classes = digits_sequence.tasks[task].classes
        b = _batch(12, seed=task, task=task, classes=classes)
        # first level: only the context tokens train; the subspace stage stores the new keys
        m.set_task(task)
        m.set_phase("first")
        m.before_task(task)
        assert [n for n, p in m.named_parameters() if p.requires_grad] == ["ctx"]
        ctx0 = m.ctx.detach().clone()
        _step(m, b)
        moved = (m.ctx.detach() - ctx0).abs().sum(dim=(1, 2))
        assert moved[list(classes)].gt(0).all() and moved.sum() == moved[list(classes)].sum()
        m.finalize_statistics(m.statistics(b), task)
        assert m.seen[list(classes)].all() and m.keys[list(classes)].norm(dim=-1).sub(1).abs().max() < 1e-5
        # second level: prompts, modulation and head of this task's classes train; earlier ones do not
        m.set_phase("second")
        m.before_task(task)
        assert "ctx" not in {n for n, p in m.named_parameters() if p.requires_grad}
        p0 = m.p_0.detach().clone()
        _step(m, b)
        changed = (m.p_0.detach() - p0).abs().sum(dim=1)
        assert changed[list(classes)].gt(0).any() and changed.sum() == changed[list(classes)].sum()
        m.finalize_statistics(m.statistics(b), task)
        assert m.mog2_w[list(classes)].sum(dim=1).sub(1).abs().max() < 1e-5
    assert "gr_second_loss" in m.subspace_report() and "gr_first_loss" in m.subspace_report()
    big = _batch(64, seed=5, task=1)
    big.allowed_classes = torch.ones(digits_sequence.num_classes, dtype=torch.bool)
    whole = m.predict(big)
    single = torch.cat([m.predict(big.select(torch.tensor([i]))) for i in range(64)])
    assert torch.equal(whole, single)
    with torch.no_grad():  # the first task's loss, as the pipeline measures it after each task
        first = _batch(12, seed=0, task=0, classes=digits_sequence.tasks[0].classes)
        loss = m.task_loss(first)
    assert loss.shape == (12,) and torch.isfinite(loss).all()


def test_star_prompt_names_a_missing_clip_before_loading(assets, tmp_path):
    from conftest import tiny_config

    from mcit.core.config import ConfigError, load_config
    from mcit.run.preflight import preflight

    cfg = load_config(tiny_config(assets, tmp_path,
                                  method={"name": "star_prompt", "clip_path": str(tmp_path / "nope")}))
    with pytest.raises(ConfigError, match=r"method.clip_path: .*nope"):
        preflight(cfg)




def test_star_prompt_clip_goes_through_the_zoo_and_guards_resume(assets, clip_backbone, tmp_path):
    """STAR-Prompt's CLIP is an auxiliary backbone: resolved by the zoo (tag, sha256), checked against a zoo
    tag's architecture, recorded in backbone.json, and a run directory refuses another CLIP checkpoint."""
    import json

    from conftest import tiny_config

    from mcit.core.config import ConfigError, load_config
    from mcit.core.rundir import RunDirError
    from mcit.models import zoo as Z
    from mcit.run.preflight import preflight

    def cfg(**method):
        return load_config(tiny_config(assets, tmp_path, "star_zoo", method={
            "name": "star_prompt", "clip_path": str(clip_backbone), **method},
            backbone={"cache_dir": str(tmp_path / "cache")}))

    plan = preflight(cfg(clip_tag="tiny_clip"))
    rec = plan.auxiliary["clip"].record
    assert rec["tag"] == "tiny_clip" and rec["sha256"] == Z.sha256_path(clip_backbone)
    assert plan.backbone_records()["auxiliary"]["clip"] == rec
    # loaded once per process: every rebuild of the method (after each train stage) gets the same CLIP
    from mcit.run.lifecycle import MethodHost

    host = MethodHost(plan)
    first = host.build().clip
    assert host.load(host.method.state_dict()).clip is first and host.auxiliary == {"clip": first}
    _check_star_prompt_phase_images(host, clip_backbone)
    with pytest.raises(ConfigError, match=r"method.clip_path: .*does not match backbone tag 'clip_vitl14_openai'"):
        preflight(cfg(clip_tag="clip_vitl14_openai"))
    from mcit.core.config import dump_config

    run = tmp_path / "runs" / "star_zoo"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(cfg(clip_tag="tiny_clip")))
    (run / "backbone.json").write_text(json.dumps({**plan.backbone_records(),
                                                   "auxiliary": {"clip": {**rec, "sha256": "0" * 64}}}))
    with pytest.raises(RunDirError, match=r"method.clip_path checkpoint .* is not the one run .* started with"):
        preflight(cfg(clip_tag="tiny_clip"))


def _check_star_prompt_phase_images(host, clip_backbone) -> None:
    """The batches each STAR-Prompt stage streams (mammoth d003b9a): the first level's train and statistics
    batches are CLIP's own preprocess of the raw images (equal to transformers' CLIP image processor on
    this CLIP's preprocessor_config.json, no augmentation); the second level trains on the run's augmented
    crops and fits its statistics on an augmented stream too (another seed: other crops)."""
    import numpy as np
    from transformers import CLIPImageProcessorPil

    from mcit.data.shards import decode_sample, iter_samples

    cls, params = type(host.method), host.method.params
    samples = list(iter_samples(host.plan.train[0], 0, 1))[:6]
    images = [decode_sample(s)[0].convert("RGB") for s in samples]
    want = CLIPImageProcessorPil.from_pretrained(clip_backbone)(images, return_tensors="np")["pixel_values"]
    for stage in ("train", "subspace"):
        got = host.collate(0, train=True, pipeline=cls.image_pipeline(params, "first", stage))(samples, seed=3)
        assert got.pixel_values.shape[-1] == host.auxiliary["clip"].image_size
        assert np.abs(got.pixel_values.numpy() - want).max() < 1e-6, stage
    vit = host.collate(0, train=True)(samples, seed=3).pixel_values  # the run's own (l2p crops, ViT mean / std)
    assert not torch.allclose(vit, torch.from_numpy(want), atol=1e-2)
    second = cls.image_pipeline(params, "second", "subspace")
    assert second.auxiliary is None and second.augment is True
    stats = host.collate(0, train=True, augment=False, pipeline=second)
    assert torch.equal(stats(samples, seed=3).pixel_values, vit)  # the train stream's crops for that seed
    assert not torch.equal(stats(samples, seed=4).pixel_values, vit)
    old = params.model_copy(update={"first_pipeline": "backbone", "second_statistics": "eval"})
    assert cls.image_pipeline(old, "first", "train").auxiliary is None
    assert cls.image_pipeline(old, "second", "subspace").augment is False


@pytest.mark.parametrize("mode", ["all_current", "selected"])
def test_star_prompt_score_mask_gradient_reaches_every_current_class(mode, vit, clip, clip_backbone, digits_sequence):
    """The official second stage zeroes the non-selected scores in place under no_grad, so the masking is
    invisible to autograd: from one image, every current class's modulation vector a_c gets a gradient
    (earlier classes' none). ``map_mask_gradient: selected`` trains the selected class's a_c only."""
    m = _star(vit, clip, clip_backbone, digits_sequence, map_mask_gradient=mode)
    past, cur = list(digits_sequence.tasks[0].classes), list(digits_sequence.tasks[1].classes)
    g = torch.Generator().manual_seed(2)
    b = _batch(1, seed=3, task=1, classes=cur)
    with torch.no_grad():  # keys that make a current class the best one (past keys point away from the query)
        q = torch.nn.functional.normalize(m.clip_query(b.pixel_values)[0], dim=-1)
        noise = 0.3 * torch.randn(len(past + cur), m.keys.shape[1], generator=g)
        sign = torch.tensor([-1.0] * len(past) + [1.0] * len(cur))[:, None]
        m.keys[past + cur] = torch.nn.functional.normalize(sign * q + noise, dim=-1)
    m.seen[past] = True
    m.set_task(1)
    m.set_phase("second")
    m.before_task(1)  # restores the head from its (here untouched, zero) backup: give it weights
    with torch.no_grad():
        m.head.weight.copy_(torch.randn(m.head.weight.shape, generator=g))
    out = m(b)
    (out.per_sample.mean() + out.regularizer).backward()
    for layer in m.layers:
        rows = getattr(m, f"a_{layer}").grad.abs().sum(dim=1)
        assert rows[past].eq(0).all()
        assert int(rows[cur].gt(0).sum()) == (len(cur) if mode == "all_current" else 1), (layer, rows[cur])


def test_star_prompt_gaussian_replay_keeps_the_first_levels_mixture(vit, clip, clip_backbone, digits_sequence):
    """``gr_model: gaussian`` is a second-level ablation: the first level still fits mog_components."""
    m = _star(vit, clip, clip_backbone, digits_sequence, gr_model="gaussian", mog_components=3)
    assert m.mog1_w.shape[1] == 3 and m.mog2_w.shape[1] == 1
    classes = list(digits_sequence.tasks[0].classes)
    m.set_task(0)
    m.set_phase("first")
    b = _batch(12, seed=0, task=0, classes=classes)
    m.finalize_statistics(m.statistics(b), 0)
    assert m.mog1_w[classes].gt(0).sum(dim=1).eq(3).all()
