"""EWC and LwF on the tiny LLaVA: a training step of each, the Fisher as the statistics stage computes it (summed over
ranks = one process; the sample cap; padding rows skipped), the penalty's gradient (which the official ``p.data``
dropped), the state a rebuilt method resumes from (Fisher and anchor; LwF's teacher = the previous task's adapters),
LwF's term per sample (not over its batch's padding), and generation per sample.
(Against the official numbers: tests/reference/test_ewc_reference.py, test_lwf_reference.py.)"""

from __future__ import annotations

import pytest
import torch

from mcit.core.registry import METHODS
from mcit.data.loader import pad_batch
from mcit.data.types import TaskSequence
from mcit.models.mllm import answer_token_ce
from mcit.run.subspace_stage import stream_statistics

SMALL = {"r": 2, "alpha": 4.0, "dropout": 0.0}


@pytest.fixture(scope="module")
def tiny(mcit_assets):
    """One tiny LLaVA for the module (every method here adapts the same target modules: all-linear), 8 samples of one
    task and 2 of another (a token shorter: a batch of both pads)."""
    from mcit.data.shards import iter_samples, open_split
    from mcit.models.mllm import MLLMBackbone

    bb = MLLMBackbone.from_path(str(mcit_assets["backbone"]))
    split = open_split(mcit_assets["shards"] / "count" / "test")
    samples = list(iter_samples(split, 0, 1, policy="sample"))[:8]
    shorter = list(iter_samples(open_split(mcit_assets["shards"] / "position" / "test"), 0, 1, policy="sample"))[:2]
    return bb, bb.make_collate(split, 0, train=True), bb.make_collate(split, 0, train=False), samples, shorter


def build(name: str, bb, seed: int = 0, **params):
    cls = METHODS.get(name)
    torch.manual_seed(seed)
    return cls(cls.Params(**{**SMALL, **params}), bb, TaskSequence.from_label_spaces(["a", "b"], [[], []]))


def step(m, batch, lr: float = 0.02) -> None:
    opt = torch.optim.Adam(m.trainable_parameters(), lr=lr)
    terms = m(batch)
    (terms.per_sample.mean() + (terms.regularizer if terms.regularizer is not None else 0)).backward()
    opt.step()
    opt.zero_grad()


def test_ewc_trains_computes_its_fisher_in_the_stage_and_penalises_the_next_task(tiny):
    bb, train, _, samples, _ = tiny
    b = train(samples[:4])
    m = build("ewc", bb, ewc_lambda=10.0)
    m.set_task(0)
    m.before_task(0)
    terms = m(b)
    assert float(terms.regularizer.detach()) == 0 and terms.logs["ewc_penalty"] == 0  # no Fisher in the first task
    step(m, b)
    assert m.merged_delta_norm() > 0
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.set_task(0)
    report = stream_statistics(m, [b], 0)  # under no_grad, as the pipeline streams it
    assert report["fisher_task"] == 0 and report["fisher_max"] > 0
    after = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert after.keys() == grads.keys() and all(torch.equal(after[n], g) for n, g in grads.items())  # none added
    fisher, anchor = m.fisher(), m.anchor()
    params = dict(m.named_parameters())
    assert set(fisher) == {n for n, p in params.items() if p.requires_grad} and len(fisher) == 2 * len(m.adapters)
    assert all(torch.equal(anchor[n], params[n].detach()) for n in anchor)
    m.set_task(1)
    m.before_task(1)
    assert float(m(b).regularizer.detach()) == 0  # at the anchor
    step(m, b)
    terms = m(b)
    assert terms.logs["ewc_penalty"] > 0
    grads = torch.autograd.grad(terms.regularizer, [params[n] for n in fisher])
    for (n, f), g in zip(fisher.items(), grads):  # the official p.data made this zero
        torch.testing.assert_close(g, 2 * 10.0 * f * (params[n].detach() - anchor[n]), rtol=1e-5, atol=1e-9)
    assert max(float(g.abs().max()) for g in grads) > 0


def test_ewc_fisher_summed_over_two_ranks_is_the_fisher_of_one_process(tiny):
    """Each rank's squared gradients and sample count are summed by the stage: two halves give what one process gives
    on all four samples (with dropout on: each group's draws are seeded by its samples). Padding rows (valid 0)
    count for nothing, and the sample cap stops a rank's stream."""
    bb, train, _, samples, _ = tiny
    b = train(samples[:4])
    m = build("ewc", bb, dropout=0.1, fisher_batch_size=2, fisher_limit=None)
    m.set_task(0)
    whole = m.statistics(b)
    halves = [m.statistics(b.select(torch.arange(0, 2))), m.statistics(b.select(torch.arange(2, 4)))]
    assert float(whole["samples"]) == 4 and set(whole) == set(halves[0])
    for k in whole:
        torch.testing.assert_close(halves[0][k] + halves[1][k], whole[k], rtol=1e-5, atol=1e-12)
    assert max(float(v.max()) for k, v in whole.items() if k != "samples") > 0
    padded = m.statistics(pad_batch(b.select(torch.arange(0, 2)), b, 4))
    assert float(padded["samples"]) == 2 and all(torch.equal(padded[k], halves[0][k]) for k in padded)
    m.finalize_statistics({k: v.double() for k, v in whole.items()}, 0)
    for name, f in m.fisher().items():
        torch.testing.assert_close(f, whole[f"fisher:{name}"] / 4)
    capped = build("ewc", bb, fisher_batch_size=2, fisher_limit=3)
    capped.set_task(0)
    first, second = capped.statistics(b), capped.statistics(b)
    assert float(first["samples"]) == 3 and second is None
    capped.set_task(0)  # a new stage counts again
    three = capped.statistics(b.select(torch.arange(0, 3)))
    assert all(torch.equal(first[k], three[k]) for k in first)


def test_ewc_state_resumes_in_a_rebuilt_method(tiny):
    bb, train, _, samples, _ = tiny
    b = train(samples[:4])
    m = build("ewc", bb, ewc_lambda=5.0)
    m.set_task(0)
    step(m, b)
    stream_statistics(m, [b], 0)
    m.set_task(1)
    step(m, b)
    penalty = m(b).logs["ewc_penalty"]
    assert penalty > 0
    state = m.state_dict()
    assert {k for k in state if "ewc_fisher_" in k} and {k for k in state if "ewc_anchor_" in k}
    again = build("ewc", bb, seed=1, ewc_lambda=5.0)  # another initialisation: the state must replace all of it
    again.load_state_dict(state)
    again.set_task(1)
    assert int(again.fisher_task) == 0
    assert all(torch.equal(again.fisher()[n], f) for n, f in m.fisher().items())
    assert all(torch.equal(again.anchor()[n], a) for n, a in m.anchor().items())
    assert again(b).logs["ewc_penalty"] == pytest.approx(penalty, rel=1e-6)


def test_lwf_teacher_is_the_previous_tasks_state_after_a_rebuild(tiny):
    bb, train, _, samples, _ = tiny
    b = train(samples[:4])
    m = build("lwf", bb, lwf_alpha=1.0)
    m.set_task(0)
    m.before_task(0)
    assert int(m.teacher_task) == -1 and "distillation" not in m.train_outputs(b)  # the first task: no teacher
    step(m, b)
    end0 = {k: v.clone() for k, v in m.adapters.state_dict().items()}
    state = m.state_dict()  # the committed state of task 0
    again = build("lwf", bb, seed=1, lwf_alpha=1.0)
    again.load_state_dict(state)
    again.set_task(1)
    again.before_task(1)  # the teacher: task 0's adapters
    assert int(again.teacher_task) == 0
    assert all(torch.equal(v, end0[k]) for k, v in again.teacher.state_dict().items())
    assert not any(p.requires_grad for p in again.teacher.parameters())
    first = again.train_outputs(b)
    assert first["distillation"].abs().max() < 1e-4  # the student is the teacher
    step(again, b)
    assert again.train_outputs(b)["distillation"].min() > 0
    with torch.no_grad():  # the teacher is not the student any more
        logits, _, labels = again.teacher_logits(b)
        sums, n = answer_token_ce(logits, labels)
        assert not torch.allclose(sums / n.clamp_min(1), again.task_loss(b))
    resumed = build("lwf", bb, seed=2, lwf_alpha=1.0)  # a train stage resumed mid-task 1: before_task again
    resumed.load_state_dict(again.state_dict())
    resumed.set_task(1)
    resumed.before_task(1)
    assert all(torch.equal(v, end0[k]) for k, v in resumed.teacher.state_dict().items())  # still task 0's
    with torch.no_grad():
        assert torch.equal(resumed.train_outputs(b)["lm_loss"], again.train_outputs(b)["lm_loss"])


def test_lwf_term_is_each_samples_own_not_its_batchs_padding(tiny):
    """The official cache runs the KL over the padded row; here a sample's term is the same alone and in a batch that
    pads it (``kl_positions: all``; ``answer``: the answer positions only, a part of it)."""
    bb, train, _, samples, shorter = tiny
    rows = [*samples[:2], *shorter]
    b = train(rows)
    lengths = b.inputs["attention_mask"].sum(1)
    assert lengths.min() < lengths.max()  # the batch pads its shorter rows
    m = build("lwf", bb)
    m.set_task(0)
    step(m, b)
    m.set_task(1)
    m.before_task(1)
    step(m, b, lr=0.05)
    together = m.train_outputs(b)["distillation"].detach()
    alone = torch.cat([m.train_outputs(train([s]))["distillation"].detach() for s in rows])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-7)
    assert together.min() > 0
    m.params = m.params.model_copy(update={"kl_positions": "answer"})
    answer = m.train_outputs(b)["distillation"].detach()
    assert (answer > 0).all() and (answer < together).all()


@pytest.mark.parametrize("name", ["ewc", "lwf"])
def test_generation_does_not_depend_on_the_batch(tiny, name):
    bb, train, evaluate, samples, _ = tiny
    m = build(name, bb)
    m.set_task(0)
    step(m, train(samples[:4]), lr=0.05)
    m.eval()
    together = m.generate(evaluate(samples), 4)
    assert together == [m.generate(evaluate([s]), 4)[0] for s in samples]


def test_a_trained_projector_is_regularised_and_distilled_from_too(tiny):
    """With ``train_projector`` (not the official default: ms-swift freezes the aligner) the projector is one more
    trainable module: its Fisher, anchor and penalty gradient (EWC); its frozen copy computes the teacher's image
    features (LwF)."""
    bb, train, _, samples, _ = tiny
    b = train(samples[:4])
    ewc = build("ewc", bb, train_projector=True, ewc_lambda=100.0)
    ewc.set_task(0)
    step(ewc, b)
    stream_statistics(ewc, [b], 0)
    fisher = {k: v for k, v in ewc.fisher().items() if k.startswith("projector.")}
    assert fisher and max(float(v.max()) for v in fisher.values()) > 0
    ewc.set_task(1)
    step(ewc, b)
    grads = torch.autograd.grad(ewc(b).regularizer, ewc.projector_parameters())
    assert max(float(g.abs().max()) for g in grads) > 0
    lwf = build("lwf", bb, train_projector=True, lwf_alpha=1.0)
    lwf.set_task(0)
    step(lwf, b)
    lwf.set_task(1)
    lwf.before_task(1)
    assert all(torch.equal(t, s) for t, s in zip(lwf.teacher_projector.parameters(), lwf.projector.parameters()))
    step(lwf, b, lr=0.05)
    assert not all(torch.equal(t, s) for t, s in zip(lwf.teacher_projector.parameters(), lwf.projector.parameters()))
    with lwf.as_teacher():
        assert bb.projector() is lwf.teacher_projector
    assert bb.projector() is lwf.projector and lwf.train_outputs(b)["distillation"].min() > 0
