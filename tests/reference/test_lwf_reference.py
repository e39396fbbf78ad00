"""LwF against ECNU-SII/Continual-NExT (official/lwf.json): two tasks of sequential LoRA on a tiny causal Llama, each
4 SGD steps; task 0 without distillation (the scripts' ``--use_lwf False``), task 1 distilling from the model as the
task starts (``before_task``: the official trainer caches that model's logits before training).

Pinned: the teacher's logits on task 1's samples (the official cache), every step's loss and gradients, the
distillation term ``alpha * T^2 * KL`` summed over positions and averaged over the batch and its own gradient (zero
at the first step of task 1, where the student is the teacher), and the trained adapters after each task.
"""

from __future__ import annotations

import tiny_inputs as T
import torch
from test_ewc_reference import batch, build, check, ours

from mcit.data.types import Batch

TOL = T.TOLERANCE["lwf"]


def test_lwf_teacher_distillation_and_training_match_the_official_code():
    ref = T.official("lwf")["values"]
    m, named = build("lwf", ref, temperature=ref["temperature"], lwf_alpha=ref["lwf_alpha"])
    trainable = [named[ours(k)] for k in ref["init"]]
    assert {id(p) for p in trainable} == {id(p) for p in m.trainable_parameters()}
    for t, rec in enumerate(ref["tasks"]):
        data = ref["data"][f"task{t}"]
        m.set_task(t)
        m.before_task(t)
        assert int(m.teacher_task) == t - 1
        if t > 0:
            for i, want in rec["teacher_logits"].items():
                logits, _, _ = m.teacher_logits(batch(data, [int(i)], t))
                T.assert_close(logits[0], want, f"task {t}: teacher logits of sample {i}", TOL)
        opt = torch.optim.SGD(m.trainable_parameters(), lr=ref["lr"])
        for s, (rows, want) in enumerate(zip(ref["batches"], rec["steps"])):
            opt.zero_grad()
            b: Batch = batch(data, rows, t)
            terms = m(b)
            if "lwf_term" in want:  # alpha * T^2 * sum_positions KL, averaged over the batch, and its gradient
                term = (terms.per_sample - terms.task).mean()
                grads = torch.autograd.grad(term, trainable, retain_graph=True)
                got = {ours(k): g for k, g in zip(ref["init"], grads)}
                if s == 0:  # the student is the teacher
                    assert abs(want["lwf_term"]) < 1e-6 and float(term.detach().abs()) < 1e-6
                    assert max(float(g.abs().max()) for g in grads) < 1e-5
                else:
                    T.assert_close(term, want["lwf_term"], f"task {t} step {s}: distillation term",
                                   TOL * abs(want["lwf_term"]) / max(1.0, abs(want["lwf_term"])))
                    check(got, want["lwf_term_grad"], f"task {t} step {s}: gradient of the distillation term", TOL)
            else:
                assert torch.equal(terms.per_sample, terms.task)  # no teacher in the first task
            loss = terms.per_sample.mean()
            T.assert_close(loss, want["loss"], f"task {t} step {s}: loss", TOL)
            loss.backward()
            check({n: p.grad for n, p in named.items() if p.grad is not None}, want["grad"], f"task {t} step {s}: grad",
                  TOL)
            opt.step()
        check(named, rec["trained"], f"task {t}: trained adapters", TOL)
