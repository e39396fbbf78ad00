"""CL-MoE (mcit/methods/cl_moe.py) on the tiny LLaVA: it trains, answers per sample, counts the routers' top-2 experts
over real tokens only, and merges its experts by momentum at the task boundary through the hooks in the pipeline's
order (the trained state goes into a fresh build, then the subspace stage). Numbers against the official code:
tests/reference/test_cl_moe_reference.py."""

from __future__ import annotations

import pytest
import torch

from mcit.core.registry import METHODS
from mcit.data.types import TaskSequence
from mcit.methods.cl_moe import most_counted, top2_counts

SMALL = {"r": 8, "alpha": 16, "experts": 4, "dropout": 0.0, "train_projector": False}


@pytest.fixture(scope="module")
def tiny(mcit_assets):
    """One tiny LLaVA for every build here (the layers are injected once; each build installs its own experts) and
    a few training samples of two tasks."""
    from mcit.data.shards import iter_samples, open_split
    from mcit.models.mllm import MLLMBackbone

    bb = MLLMBackbone.from_path(str(mcit_assets["backbone"]))
    data = []
    for task in ("colour", "position"):  # prompts of different lengths: mixed batches pad
        split = open_split(mcit_assets["shards"] / task / "train")
        data.append((split, list(iter_samples(split, 0, 1, policy="sample"))[:6]))
    return bb, data


def _build(bb, seed: int = 0, **params):
    cls = METHODS.get("cl_moe")
    torch.manual_seed(seed)
    return cls(cls.Params(**{**SMALL, **params}), bb, TaskSequence.from_label_spaces(["a", "b"], [[], []]))


def _train(m, batch, steps: int = 3, lr: float = 0.02) -> None:
    opt = torch.optim.Adam(m.trainable_parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        m(batch).per_sample.mean().backward()
        opt.step()


def test_params_defaults_are_mcitlibs_ucit_scripts_and_checked():
    cls = METHODS.get("cl_moe")
    p = cls.Params()
    assert (p.r, p.alpha, p.experts, p.dropout, p.target_modules) == (96, 192.0, 6, 0.05, "all-linear")
    assert (p.momentum, p.task_experts, p.momentum_merge) == (0.7, 8, True)
    assert p.train_projector and p.projector_lr == 2e-5  # --mm_projector_lr 2e-5, which the LLaVA trainer applies
    with pytest.raises(ValueError, match="divide evenly"):
        cls.Params(r=10, experts=4)
    with pytest.raises(ValueError):
        cls.Params(r=4, experts=1)  # the top-2 statistic needs two experts


def test_top2_counts_drop_ties_and_padding_and_the_selection_keeps_counted_experts():
    gate = torch.tensor([[[0.5, 0.3, 0.2], [0.4, 0.4, 0.2], [0.1, 0.2, 0.7]],
                         [[0.2, 0.1, 0.7], [0.3, 0.6, 0.1], [0.6, 0.3, 0.1]]])
    assert top2_counts(gate).tolist() == [4, 4, 2]  # the tied token (0, 1) counts for neither expert
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert top2_counts(gate, mask).tolist() == [3, 3, 2]
    assert most_counted([5, 9, 0, 9], 8) == [1, 3, 0]  # by count, ties by index, never an uncounted expert
    assert most_counted([5, 9, 0, 9], 2) == [1, 3]


def test_the_router_reads_the_input_before_the_experts_dropout():
    """The official layer (MCITlib 2956dfd CL-MoE/CLMoE/peft/tuners/clitmoelora.py:395) routes on x itself; only
    the experts see dropout(x). The fixture trains without dropout, so this is pinned here, in training mode."""
    import torch.nn.functional as F

    from mcit.methods.cl_moe import CountedExperts

    torch.manual_seed(0)
    m = CountedExperts(in_features=6, r=4, experts=2, dropout=0.5).train()
    x = torch.randn(3, 5, 6)
    torch.manual_seed(1)
    got = m(x)
    torch.manual_seed(1)
    gate = torch.softmax(F.linear(x, m.router), dim=-1).repeat_interleave(2, dim=-1)
    want = F.linear(F.dropout(x, 0.5, training=True), m.A) * gate
    assert torch.allclose(got, want, atol=1e-6) and float(got.abs().max()) > 1e-2


def test_trains_a_step_and_answers_per_sample(tiny):
    """Untrained, the experts add nothing (B = 0); a step moves router, experts and loss; a batch's answers are each
    sample's alone."""
    bb, [(split, samples), _] = tiny
    m = _build(bb)
    batch = bb.make_collate(split, 0, train=True)(samples[:4])
    with torch.no_grad(), m.zero_shot():
        pretrained = m(batch).per_sample
    with torch.no_grad():
        assert torch.equal(m(batch).per_sample, pretrained)
    _train(m, batch, steps=2)
    m(batch).per_sample.mean().backward()
    a = next(iter(m.adapters.values()))
    assert all(float(p.grad.abs().sum()) > 0 for p in (a["A"].router, a["A"].A, a["B"].weight))
    with torch.no_grad():
        assert not torch.allclose(m(batch).per_sample, pretrained)
    m.eval()
    collate = bb.make_collate(split, 0, train=False)
    assert m.generate(collate(samples[:4]), 3) == [m.generate(collate([s]), 3)[0] for s in samples[:4]]


def test_counts_cover_real_tokens_only(tiny):
    """Two top-2 picks per real token and adapted layer; a padded batch counts what its samples count alone."""
    bb, [(split, samples), (_, other)] = tiny
    m = _build(bb)
    _train(m, bb.make_collate(split, 0, train=True)(samples[:4]))
    collate = bb.make_collate(split, 0, train=True)
    samples = samples[:2] + other[:2]  # two tasks' prompts: rows of different lengths
    batch = collate(samples)
    assert int(batch.inputs["attention_mask"].sum()) < batch.inputs["attention_mask"].numel()  # some padding
    with torch.no_grad():
        together = m.statistics(batch)["expert_counts"]
        alone = sum(m.statistics(collate([s]))["expert_counts"] for s in samples)
    assert int(together.sum()) == 2 * len(m.adapters) * int(batch.inputs["attention_mask"].sum())
    assert torch.equal(together, alone)
    assert all(a["A"].tally is None for a in m.adapters.values())  # counting stops with the statistics


def test_the_task_boundary_merges_by_momentum_through_the_hooks(tiny):
    """As MethodHost runs it: before_task keeps theta_{t-1}, the trained state goes into a fresh build, the subspace
    stage counts and (from the second task on) merges each expert by its share of theta_{t-1}; the router keeps its
    trained values; a resumed build (the trained state loaded again) merges to the same bytes."""
    from mcit.core import distributed as dist
    from mcit.run.subspace_stage import stream_statistics

    dist.init()
    bb, data = tiny
    m = _build(bb)
    for t, (split, samples) in enumerate(data):
        m.set_task(t)
        m.before_task(t)
        start = {k: v.clone() for k, v in m.state_dict().items()}
        for a in m.adapters.values():
            assert torch.equal(a["A"].prev, a["A"].A) and torch.equal(a["B"].prev, a["B"].weight)
        _train(m, bb.make_collate(split, t, train=True)(samples))
        trained = {k: v.clone() for k, v in m.state_dict().items()}
        m = _build(bb, seed=1)  # a different initialisation: the trained state must replace all of it
        m.load_state_dict(trained)
        m.set_task(t)
        m.after_task(t)
        batches = [bb.make_collate(split, t, train=True)(samples[i:i + 3]) for i in (0, 3)]
        report = stream_statistics(m, batches, t)
        counts = m.expert_counts[t]
        assert int(counts.sum()) > 0 and report["task_experts"] == most_counted(counts.tolist(), 8)
        merged = m.state_dict()
        if t == 0:
            assert all(torch.equal(merged[k], trained[k]) for k in trained if k != "expert_counts")  # no merge yet
            continue
        lam = m.momentum_weights(t)
        assert report["previous_share"] == [round(float(x), 6) for x in lam]
        assert set(lam.tolist()) <= {0.7, 1 - 0.7}
        k = m.params.r // m.params.experts
        rows = lam.float().repeat_interleave(k)
        for name in m.adapters:
            p = f"adapters.{name}."
            want_a = rows[:, None] * start[p + "A.A"] + (1 - rows[:, None]) * trained[p + "A.A"]
            want_b = rows[None, :] * start[p + "B.weight"] + (1 - rows[None, :]) * trained[p + "B.weight"]
            assert torch.allclose(merged[p + "A.A"], want_a, atol=1e-7)
            assert torch.allclose(merged[p + "B.weight"], want_b, atol=1e-7)
            assert torch.equal(merged[p + "A.router"], trained[p + "A.router"])
        assert not torch.allclose(merged[p + "A.A"], trained[p + "A.A"])
        again = _build(bb, seed=2)  # resumed before the subspace stage
        again.load_state_dict(trained)
        again.set_task(t)
        stream_statistics(again, batches, t)
        assert all(torch.equal(v, merged[k]) for k, v in again.state_dict().items())


def test_without_momentum_merge_there_is_no_statistic(tiny):
    """``momentum_merge: false`` (MCITlib's scripts, which never run statistic.py / params.py): the subspace stage
    has nothing to stream and the trained experts stay."""
    from mcit.run.subspace_stage import stream_statistics

    bb, [(split, samples), _] = tiny
    m = _build(bb, momentum_merge=False)
    m.set_task(1)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert stream_statistics(m, [bb.make_collate(split, 1, train=True)(samples)], 1) is None
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
