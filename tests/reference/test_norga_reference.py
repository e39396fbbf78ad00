"""NoRGa against Minhchuyentoancbn/MoE_PromptCL (official/norga.json) on ``tiny_inputs.distinct_vit()``, whose
[CLS] features differ from image to image (pairwise cosines 0.3-0.8), so the contrastive term is neither log 4
nor 0 and moves with its temperature, and the gate's gradients are large.

Task 0: the gated forward (logits, features), the contrastive term, the loss, the gradients of the prompt, the
gate's tau and alpha and the head, and inference with task 1's prompt. The boundary: the class means and
covariances of task 0, the hand-over of the prompt, the gate frozen from task 1 on. Task 1: the forward with
prompt momentum, the contrastive term against the stored class means, the loss, the gradients (none for the
gate, as the official ``act_scale.requires_grad_(False)``) and the momentum written into the stored prompt.
Every tolerance is TOL (``tiny_inputs.TOLERANCE``) of the quantity's own scale (``assert_rel_close``)."""

from __future__ import annotations

import math

import tiny_inputs as T
import torch
import torch.nn.functional as F

from mcit.data.types import Batch
from mcit.methods.prompting import gather_prefix

TOL = T.TOLERANCE["norga"]


def _norga():
    m = T.method("norga", T.distinct_vit(), reg=0.1, prompt_momentum=0.1)
    with torch.no_grad():
        m.gate_tau.copy_(1 + 0.3 * torch.randn(5, generator=torch.Generator().manual_seed(6)))
        m.gate_alpha.copy_(1 + 0.3 * torch.randn(5, generator=torch.Generator().manual_seed(7)))
    return m


def _wtp_step(m, b: Batch, ref: dict, key: str, names: list[str]) -> None:
    """The official train_one_epoch's loss (cross-entropy over the task's classes + reg * orth_loss; our TII
    head's cross-entropy, trained in the same pass, reaches none of the compared gradients) and its gradients."""
    out = m.train_outputs(b)
    T.assert_rel_close(out["logits"], ref[f"{key}train_logits"], f"{key}train logits", TOL)
    T.assert_rel_close(out["feats"], ref[f"{key}train_features"], f"{key}prompted [CLS] features", TOL)
    terms = m.loss(b, out)
    T.assert_rel_close(terms.regularizer, ref[f"{key}orth"], f"{key}contrastive term", TOL)
    loss = terms.task.mean() + terms.regularizer
    T.assert_rel_close(loss, ref[f"{key}loss"], f"{key}loss", TOL)
    loss.backward()
    for name in names:
        T.assert_rel_close(T.grads(m)[name], ref[f"{key}grad.{name}"], f"{key}gradient of {name}", TOL)


def test_norga_matches_the_official_forward_gradients_and_task_boundary():
    ref = T.official("norga")["values"]
    m = _norga()
    m.before_task(0)
    _wtp_step(m, T.batch(0), ref, "", ["e_prompt", "gate_tau", "gate_alpha", "head.weight", "head.bias"])
    with torch.no_grad():
        prefix = gather_prefix(m.e_prompt, torch.ones(4, 1, dtype=torch.long))
        T.assert_rel_close(m.head(m.prompted_features(T.images(4), prefix)), ref["eval_logits_prompt1"],
                           "eval logits with task 1's prompt", TOL)
    m.zero_grad(set_to_none=True)
    m.after_task(0)
    m.set_task(0)
    m.finalize_statistics(m.statistics(Batch(T.images(8), T.labels(0, 8), torch.ones(8), 0)), 0)
    T.assert_rel_close(m.prompted_mean[:3], ref["mean0"], "task 0 class means", TOL)
    T.assert_rel_close(m.prompted_cov[:3], ref["cov0"], "task 0 class covariances", TOL)

    m.before_task(1)
    with torch.no_grad():  # the fixture moves task 1's prompt off the handed-over copy, so the momentum shows
        m.e_prompt[:, :, 1] += 0.5 * torch.randn(m.e_prompt[:, :, 1].shape, generator=torch.Generator().manual_seed(5))
    _wtp_step(m, T.batch(1), ref, "t1.", ["e_prompt", "head.weight", "head.bias"])
    assert ref["act_scale_has_grad"] and not ref["t1.act_scale_has_grad"]
    assert m.gate_tau.grad is None and m.gate_alpha.grad is None, "the gate trains at task 1 (officially frozen)"
    m.after_task(1)
    T.assert_rel_close(m.e_prompt[:, :, 1], ref["t1.stored_prompt1"], "task 1's stored prompt after the momentum", TOL)


def test_the_norga_fixture_keeps_every_checked_quantity_far_from_trivial():
    """On the official numbers themselves: distinct features, a contrastive term far from log(n) and from 0 that
    the temperature moves, and gate gradients (every layer's) far above the tolerance."""
    ref = T.official("norga")["values"]
    tol = 1e3 * T.TOL  # "far": a thousand of the tolerance the other fixtures use, 200 of this one's
    for key, n in (("", 4), ("t1.", 7)):
        f = torch.tensor(ref[f"{key}train_features"])
        u = F.normalize(f, dim=-1)
        assert float((u @ u.t() - 2 * torch.eye(4)).max()) < 0.85, "features nearly parallel"
        m = torch.cat([torch.tensor(ref["mean0"]), f]) if key else f
        assert m.shape[0] == n
        orth = ref[f"{key}orth"]
        assert 1e-3 < orth / (0.1 * math.log(n)) < 0.9, "the contrastive term is near log(n) or near 0"
        at_1 = 0.1 * float(F.cross_entropy(m @ m.t() / 1.0, torch.arange(n)))
        assert abs(at_1 - orth) > tol * orth, "the temperature barely moves the contrastive term"
    for name in ("gate_tau", "gate_alpha"):
        g = torch.tensor(ref[f"grad.{name}"]).abs()
        assert float(g.min()) > tol * float(g.max()), f"a layer's {name} gradient is within the tolerance's reach"
