"""DISCO on the tiny LLaVA with the tiny CLIP as its auxiliary backbone: CLIP's text features key the subspaces, a
training step moves only the current task's subspace (and the projector), the subspace stage sets a task's key,
inference activates the subspaces per sample, and pre-flight resolves the CLIP. (Numbers against the official code:
tests/reference/test_disco_reference.py.)"""

from __future__ import annotations

import pytest
import torch

from mcit.core.registry import METHODS
from mcit.data.types import TaskSequence

SMALL = {"r": 4, "alpha": 8, "dropout": 0.0}


@pytest.fixture(scope="module")
def llava(mcit_assets):
    from mcit.data.shards import iter_samples, open_split
    from mcit.models.mllm import MLLMBackbone

    bb = MLLMBackbone.from_path(str(mcit_assets["backbone"]))  # its own: the method injects its layers into it
    splits = [open_split(mcit_assets["shards"] / t / "train") for t in ("colour", "count")]
    samples = [list(iter_samples(s, 0, 1, policy="sample"))[:4] for s in splits]
    return bb, splits, samples


def _method(bb, clip, clip_backbone, tasks: int = 2, seed: int = 0, **over):
    cls = METHODS.get("disco")
    torch.manual_seed(seed)
    seq = TaskSequence.from_label_spaces([f"t{i}" for i in range(tasks)], [[] for _ in range(tasks)])
    return cls(cls.Params(**{**SMALL, "clip_path": str(clip_backbone), **over}), bb, seq, auxiliary={"clip": clip})


def test_text_features_are_clips_own_and_per_sample(llava, clip, clip_backbone):
    """The key feature is CLIP's text pooler output of the question without its <image> placeholder; each row is its
    sample's alone."""
    bb, splits, samples = llava
    m = _method(bb, clip, clip_backbone)
    batch = bb.make_collate(splits[0], 0, train=True)(samples[0][:3])
    text = m.text_features(batch)
    questions = [s["question"] for s in batch.meta]
    assert all(q.startswith("<image>") for q in questions)
    enc = clip.tokenize([q.replace("<image>", "").strip() for q in questions])
    assert torch.allclose(text, clip.model.text_model(**enc).pooler_output, atol=1e-6)
    alone = [m.text_features(bb.make_collate(splits[0], 0, train=True)([s])) for s in samples[0][:3]]
    assert torch.allclose(text, torch.cat(alone), atol=1e-6)


def _train(m, batch, steps: int = 3) -> set[str]:
    """``steps`` SGD steps of the method's training forward; the names of the parameters that moved."""
    m.train()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    opt = torch.optim.SGD(m.trainable_parameters(), lr=0.5)
    for _ in range(steps):
        opt.zero_grad()
        loss = m(batch).per_sample.mean()
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
    return {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}


def test_disco_trains_its_subspace_sets_keys_and_generates_per_sample(llava, clip, clip_backbone):
    """Untrained (B = 0) it is the pre-trained model; training task t moves task t's subspace (and the projector)
    only; the subspace stage's sums set task t's key (later tasks' stay zero, their cosine 0 keeps a share of the
    activation); after both tasks each task's samples lean to their own subspace; generation is per sample, the same
    in a batch mixing both tasks' samples as alone; a rebuilt method loading the state generates the same."""
    bb, splits, samples = llava
    batches = [bb.make_collate(s, 0, train=True)(x) for s, x in zip(splits, samples)]
    plain = METHODS.get("prompt_tuning")(METHODS.get("prompt_tuning").Params(), bb,
                                         TaskSequence.from_label_spaces(["a"], [[]])).eval()
    with torch.no_grad(), plain.zero_shot():
        pretrained = plain(batches[0]).per_sample
    m = _method(bb, clip, clip_backbone)
    m.eval()
    with torch.no_grad():
        assert torch.allclose(m(batches[0]).per_sample, pretrained, atol=1e-6)
        with m.zero_shot():
            assert torch.equal(m(batches[0]).per_sample, pretrained)
    for t in (0, 1):
        m.set_task(t)
        m.before_task(t)
        moved = _train(m, batches[t])
        assert moved and all(n.endswith(f".task{t}") or n.startswith("projector.") for n in moved)
        assert any(n.endswith(f"B.task{t}") for n in moved) and any(n.startswith("projector.") for n in moved)
        # the subspace stage of task t: the mean text feature of its training samples (a padding row: nothing)
        train = bb.make_collate(splits[t], 0, train=True)
        parts = [train(samples[t][:2]), train(samples[t][2:])]
        parts[1].valid[-1] = 0
        stats = [m.statistics(p) for p in parts]
        m.finalize_statistics({k: sum(s[k].double() for s in stats) for k in stats[0]}, t)
        feats = m.text_features(batches[t])[:3]
        assert torch.allclose(m.keys[t], feats.mean(0), atol=1e-5) and float(m.key_count[t]) == 3
        if t == 0:
            assert not m.keys[1].any() and m.subspace_report() == {"key_samples": [3, 0]}
            m.eval()
            f = m.text_features(batches[0])
            cos = torch.nn.functional.cosine_similarity(f, m.keys[0][None], dim=-1)
            assert torch.allclose(m.route_weights(f)[:, 0], torch.sigmoid(cos / 0.05), atol=1e-6)
    m.eval()
    mixed = samples[0][:3] + samples[1][:3]
    collate = bb.make_collate(splits[0], 0, train=False)
    f = m.text_features(collate(mixed))
    w = m.route_weights(f)
    cos = torch.stack([torch.nn.functional.cosine_similarity(f, m.keys[t][None], dim=-1) for t in (0, 1)], dim=1)
    assert torch.allclose(w, torch.softmax(cos / 0.05, dim=1), atol=1e-6)  # both keys, per sample
    # each task's samples lean to their own subspace on average, softly (the instructions come in many phrasings:
    # a single question may sit nearer the other task's mean)
    assert float(w[:3, 0].mean()) > 0.5 > float(w[3:, 0].mean())
    with torch.no_grad():
        assert not torch.allclose(m(batches[0]).per_sample, pretrained)
        # each sample's loss under its own activation, the same in the mixed batch as alone
        train = bb.make_collate(splits[0], 0, train=True)
        losses = m(train(mixed)).per_sample
        assert torch.allclose(losses, torch.cat([m(train([s])).per_sample for s in mixed]), rtol=1e-5, atol=1e-6)
    together = m.generate(collate(mixed), 4)
    alone = [m.generate(collate([s]), 4)[0] for s in mixed]
    assert together == alone
    again = _method(bb, clip, clip_backbone, seed=1)
    again.load_state_dict(m.state_dict())
    again.eval()
    assert again.generate(collate(mixed), 4) == together


def test_disco_checks_the_rank_against_the_tasks_and_declares_its_clip(llava, clip, clip_backbone):
    bb, _, _ = llava
    with pytest.raises(ValueError, match=r"method.r: 4 does not split over the 3 tasks"):
        _method(bb, clip, clip_backbone, tasks=3)
    cls = METHODS.get("disco")
    p = cls.Params(clip_path="x", clip_tag="t")
    assert (p.r, p.alpha, p.dropout, p.temperature, p.target_modules, p.train_projector, p.projector_lr) == \
        (96, 192.0, 0.05, 0.05, "all-linear", True, 2e-5)
    spec = cls.auxiliary_backbones(p)["clip"]
    assert (spec.kind, spec.path, spec.tag, spec.key) == ("clip", "x", "t", "method.clip_path")
    with pytest.raises(ValueError, match="needs its auxiliary backbone 'clip'"):
        cls(cls.Params(**SMALL, clip_path="x"), bb, TaskSequence.from_label_spaces(["a"], [[]]))


def test_preflight_resolves_the_disco_clip(mcit_assets, clip_backbone, tmp_path):
    import yaml
    from conftest import mcit_config

    from mcit.core.config import ConfigError, load_config
    from mcit.run.preflight import preflight

    def cfg(path):
        file = mcit_config(mcit_assets, tmp_path, "disco")
        data = yaml.safe_load(file.read_text())
        data["method"] = {"name": "disco", "r": 4, "alpha": 8, "clip_path": str(path), "clip_tag": "tiny_clip"}
        file.write_text(yaml.safe_dump(data))
        return load_config(file)

    plan = preflight(cfg(clip_backbone))
    assert plan.auxiliary["clip"].record["tag"] == "tiny_clip"
    with pytest.raises(ConfigError, match=r"method.clip_path: .*nope"):
        preflight(cfg(tmp_path / "nope"))
