"""The prompt-based CIL methods on ViT: what each paper's algorithm pins down, and per-sample inference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.instruction import InstructionMethod
from mcit.methods.prompting import gather_prefix, mask_to_classes
from mcit.models.vit import ViTBackbone

# Small settings that fit the 32-wide, 2-block test backbone; every CIL method must appear here.
SMALL = {
    "seq": {"prompt_length": 3},
    "l2p": {"pool_size": 6, "top_k": 3, "prompt_length": 2},
    "dualprompt": {"g_layers": [0], "e_layers": [1], "g_prompt_length": 2, "e_prompt_length": 3},
    "coda_prompt": {"pool_size": 6, "prompt_length": 4, "layers": [0, 1]},
    "vpt_nsp2": {"prompt_length": 3, "temperature": 1.0},
    "l2p+pgp": {"pool_size": 6, "top_k": 3, "prompt_length": 2},
    "dualprompt+pgp": {"g_layers": [0], "e_layers": [1], "g_prompt_length": 2, "e_prompt_length": 3},
    "hide_prompt": {"prompt_length": 3, "e_layers": [0, 1], "ca_epochs": 2, "n_centroids": 2},
    "norga": {"prompt_length": 3, "e_layers": [0, 1], "ca_epochs": 2, "activation": "tanh"},
    "soft_tf": {"g_layers": [0], "e_layers": [1], "g_prompt_length": 2, "e_prompt_length": 3},
    # "name:variant" rows: the same method with another inference rule
    "soft_tf:gradient_id": {"g_layers": [0], "e_layers": [1], "g_prompt_length": 2, "e_prompt_length": 3,
                            "task_inference": "gradient_id", "mask_mlp": True},
    "l2p+soft_tf": {"pool_size": 6, "top_k": 3, "prompt_length": 2},
    "l2p+soft_tf:gradient_id": {"pool_size": 6, "top_k": 3, "prompt_length": 2, "task_inference": "gradient_id"},
}
CLIP_ONLY = {"clip_zero_shot", "star_prompt"}  # need the tiny CLIP: covered by tests/unit/test_clip_methods.py


def _cil_methods() -> list[str]:
    """The shipped CIL methods (tests elsewhere register their own helpers in the same registry)."""
    return [n for n in METHODS.names()
            if METHODS.get(n).__module__.startswith("mcit.methods.")
            and not issubclass(METHODS.get(n), InstructionMethod)]


def test_every_cil_method_is_covered():
    assert sorted({k.split(":")[0] for k in SMALL} | CLIP_ONLY) == _cil_methods()


# The official code's classifier-head init (its ViT's init_weights_vit_timm: weight N(0, 0.02), bias 0), checked per
# code base: l2p-pytorch, dualprompt-pytorch, HiDe-Prompt, NoRGa (MoE_PromptCL), PGP, Soft-TF, mammoth's STAR-Prompt
# (tests/unit/test_clip_methods.py); CODA-Prompt keeps nn.Linear's default (models/zoo.py), as VPT-NSP²'s heads after
# its first task.
TIMM_HEADS = {"seq", "l2p", "dualprompt", "l2p+pgp", "dualprompt+pgp", "hide_prompt", "norga", "soft_tf", "l2p+soft_tf"}


@pytest.mark.parametrize("name", sorted(TIMM_HEADS | {"coda_prompt"}))
def test_classifier_heads_start_as_the_official_code_s(name, backbone, sequence):
    """timm's init by default where the official code has it (every bias 0, weights of std 0.02: a task's masked
    rows keep their shared part from the start, so the tasks' logits do not start apart by a random bias);
    ``head_init: torch`` gives nn.Linear's default, CODA-Prompt's own."""
    torch.manual_seed(0)
    m = _build(name, backbone, sequence)
    heads = [m.head] + ([m.tii.head] if hasattr(m, "tii") else [])
    for head in heads:
        w, b = head.weight.detach(), head.bias.detach()
        if name in TIMM_HEADS:
            assert not b.any() and abs(float(w.std()) - 0.02) < 0.004, (name, float(w.std()))
        else:
            assert b.abs().max() > 0 and float(w.std()) > 0.06, name  # uniform +-1/sqrt(32): std 0.10
    if name in TIMM_HEADS:
        torch.manual_seed(0)
        assert _build(name, backbone, sequence, head_init="torch").head.bias.abs().max() > 0


def _build(name, backbone, sequence, **over):
    cls = METHODS.get(name.split(":")[0])
    return cls(cls.Params(**{**SMALL[name], **over}), backbone, sequence)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_predictions_do_not_change_with_test_batch_size(name, backbone, sequence):
    """Batch of 64 vs one sample at a time, after one training step of task 0 and the task-1 set-up."""
    torch.manual_seed(1)
    m = _build(name, backbone, sequence)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 3, 16, 16, generator=g)
    m.before_task(0)
    b = Batch(x[:8], torch.tensor([3, 4] * 4), torch.ones(8), 0)
    out = m(b)
    (out.per_sample.mean() + (out.regularizer if out.regularizer is not None else 0)).backward()
    with torch.no_grad():
        for p in m.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    m.after_task(0)
    m.eval()
    allowed = torch.ones(sequence.num_classes, dtype=torch.bool)
    big = Batch(x, torch.zeros(64, dtype=torch.long), torch.ones(64), 0, allowed_classes=allowed)
    whole = m.predict(big)
    single = torch.cat([m.predict(Batch(x[i:i + 1], big.labels[i:i + 1], big.valid[i:i + 1], 0,
                                        allowed_classes=allowed)) for i in range(64)])
    assert torch.equal(whole, single)
    # the first task's loss as the pipeline measures it after a later task (training interference)
    m.set_task(1)
    with torch.no_grad():
        loss = m.task_loss(Batch(x[:8], torch.tensor([3, 4] * 4), torch.ones(8), 0))
    assert loss.shape == (8,) and torch.isfinite(loss).all()


def test_dualprompt_prefix_is_built_per_sample_with_a_permute():
    """The public ports reshape (layers, 2, B, k, L, H, hd) to (layers, B, 2, ...): sample b then gets
    a mix of other samples' key and value halves. gather_prefix moves the batch axis first."""
    torch.manual_seed(0)
    pool = torch.randn(3, 2, 5, 4, 2, 6)  # layers, key/value, M prompts, L, H, hd
    idx = torch.tensor([[1], [4], [0]])
    pre = gather_prefix(pool, idx)
    assert pre.shape == (3, 3, 2, 4, 2, 6)
    for b in range(3):
        for kv in range(2):
            assert torch.equal(pre[:, b, kv], pool[:, kv, idx[b, 0]])
    wrong = pool[:, :, idx].reshape(3, 3, 2, 4, 2, 6)  # what the public code does
    assert not torch.equal(wrong[:, 1, 0], pool[:, 0, 4])


def test_dualprompt_trains_its_task_prompt_and_pulls_its_key(backbone, sequence):
    torch.manual_seed(2)
    m = _build("dualprompt", backbone, sequence)
    m.before_task(1)
    assert torch.equal(m.e_prompt[:, :, 1], m.e_prompt[:, :, 0])  # shared_prompt_pool initialisation
    b = Batch(torch.randn(4, 3, 16, 16), torch.tensor([1, 2, 1, 2]), torch.ones(4), 1)
    m(b).per_sample.sum().backward()
    g = m.e_prompt.grad
    assert g[:, :, 1].abs().sum() > 0 and g[:, :, [0, 2]].abs().sum() == 0
    assert m.e_key.grad[1].abs().sum() > 0 and m.e_key.grad[[0, 2]].abs().sum() == 0


def test_coda_components_are_orthogonal_and_old_ones_frozen(backbone, sequence):
    torch.manual_seed(4)
    m = _build("coda_prompt", backbone, sequence)
    before = m.key.detach().clone()
    m.after_task(0)
    m.before_task(1)
    assert torch.equal(m.key[:, :2], before[:, :2])  # task 0's components kept
    for t in (m.key, m.attn, m.prompt):
        flat = t[0, :4].reshape(4, -1)
        assert torch.allclose(flat @ flat.t(), torch.eye(4), atol=1e-5)  # orthonormal across tasks
    b = Batch(torch.randn(4, 3, 16, 16), torch.tensor([1, 2, 1, 2]), torch.ones(4), 1)
    m(b).per_sample.sum().backward()
    assert m.prompt.grad[:, :2].abs().sum() == 0 and m.prompt.grad[:, 2:4].abs().sum() > 0
    assert m.prompt.grad[:, 4:].abs().sum() == 0  # later tasks' components are not used yet


def _digit_tasks(backbone: ViTBackbone, tasks: list[list[int]], n_train: int = 160, n_test: int = 80):
    """Real images (scikit-learn's digits) per task: (train x, train y, test x, test y)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    seq = TaskSequence.from_label_spaces([f"t{i}" for i in range(len(tasks))], tasks)
    lab = seq.label_to_index()
    rng = np.random.RandomState(0)
    out = []
    for classes in tasks:
        idx = np.where(np.isin(d.target, classes))[0]
        rng.shuffle(idx)
        split = []
        for part in (idx[:n_train], idx[n_train:n_train + n_test]):
            ims = [Image.fromarray(np.clip(np.rint(d.images[i] * 255 / 16), 0, 255).astype(np.uint8), mode="L")
                   for i in part]
            split += [backbone.preprocess(ims), torch.tensor([lab[int(c)] for c in d.target[part]])]
        out.append(tuple(split))
    return seq, out


def _train_sequence(method, data, epochs: int = 4, lr: float = 0.01):
    """Adam over the method's parameters, the method's projection applied to every update (as the
    engine does), the subspace stage after each task. Returns per task: task-0 test features, loss."""
    seen = []
    for t, (xtr, ytr, _xte, _yte) in enumerate(data):
        method.before_task(t)
        method.set_task(t)
        method.train()
        opt = torch.optim.Adam([p for p in method.parameters() if p.requires_grad], lr=lr, weight_decay=5e-5)
        g = torch.Generator().manual_seed(t)
        for _ in range(epochs):
            perm = torch.randperm(len(ytr), generator=g)
            for i in range(0, len(ytr), 24):
                b = perm[i:i + 24]
                out = method(Batch(xtr[b], ytr[b], torch.ones(len(b)), t))
                loss = out.per_sample.mean() + (out.regularizer if out.regularizer is not None else 0)
                opt.zero_grad()
                loss.backward()
                old = {n: p.detach().clone() for n, p in method.named_parameters()}
                opt.step()
                with torch.no_grad():
                    for n, p in method.named_parameters():
                        kept = method.project_update(n, p - old[n])
                        if kept is not None:
                            p.copy_(old[n] + kept)
        method.after_task(t)
        method.eval()
        with torch.no_grad():
            sums = None
            for i in range(0, len(ytr), 40):
                s = method.statistics(Batch(xtr[i:i + 40], ytr[i:i + 40], torch.ones(len(ytr[i:i + 40])), t))
                if s is not None:
                    sums = s if sums is None else {k: sums[k] + s[k] for k in s}
            if sums is not None:
                method.finalize_statistics(sums, t)
            x0, y0 = data[0][2], data[0][3]
            feats = method.hidden(x0)[:, 0]
            logits = mask_to_classes(method.head(feats), method.sequence.tasks[0].classes)
            seen.append((feats, float(torch.nn.functional.cross_entropy(logits, y0))))
    return seen


def test_vpt_nsp2_keeps_old_task_features_in_place(assets):
    """Tasks 1 and 2 trained with the null-space projection at eta = 1 vs without it (same seed, data):
    the task-1 test features move >= 10x less, and the task-1 loss rises < 1% (relative)."""
    from mcit.methods.vpt_nsp2 import VPTNSP2, VPTNSP2Params

    torch.manual_seed(0)
    backbone = ViTBackbone.from_path(assets["backbone"])
    seq, data = _digit_tasks(backbone, [[0, 1], [2, 3]])
    moves, rises = {}, {}
    for null in (True, False):
        torch.manual_seed(0)
        m = VPTNSP2(VPTNSP2Params(null_space=null, eta1=1.0, eta2=1.0), backbone, seq)
        (f1, loss1), (f2, loss2) = _train_sequence(m, data)
        moves[null] = float((f2 - f1).norm(dim=-1).mean() / f1.norm(dim=-1).mean())
        rises[null] = loss2 / loss1 - 1
    print(f"VPT-NSP2 task-1 feature move (relative): eta=1 {moves[True]:.5f}, no projection {moves[False]:.5f}, "
          f"ratio {moves[False] / moves[True]:.1f}x; task-1 loss change: eta=1 {rises[True] * 100:+.3f}%, "
          f"no projection {rises[False] * 100:+.3f}%")
    assert moves[False] >= 10 * moves[True]
    assert rises[True] < 0.01


def test_hide_prompt_statistics_tap_and_task_inference(backbone, sequence):
    """Class Gaussians from the subspace stage, task-adaptive prediction after task 1, and inference
    that picks each sample's prompt from the TII head's class prediction."""
    torch.manual_seed(5)
    m = _build("hide_prompt", backbone, sequence, ca_storage="covariance")
    g = torch.Generator().manual_seed(0)
    for t, labels in enumerate(([3, 4], [1, 2])):
        m.before_task(t)
        m.set_task(t)
        y = torch.tensor(labels * 6)
        b = Batch(torch.randn(12, 3, 16, 16, generator=g), y, torch.ones(12), t)
        out = m(b)
        (out.per_sample.mean() + out.regularizer).backward()
        m.after_task(t)
        with torch.no_grad():
            stats = m.statistics(b)
        assert stats["n"].tolist() == [6.0, 6.0]
        before = m.head.weight.detach().clone()
        m.finalize_statistics(stats, t)
        assert torch.equal(m.seen.nonzero().flatten(), torch.tensor(sorted({3, 4} | ({1, 2} if t else set()))))
        assert torch.allclose(m.frozen_mean[labels[0]], backbone.cls_features(b.pixel_values[y == labels[0]]).mean(0),
                              atol=1e-5)
        assert torch.equal(m.head.weight, before) == (t == 0)  # TAP re-trains the head only after task 0
    assert set(m.subspace_report()) == {"tii_ca_loss", "tap_loss"}
    m.eval()
    b = Batch(torch.randn(6, 3, 16, 16), torch.zeros(6, dtype=torch.long), torch.ones(6), 0,
              allowed_classes=m.seen.clone())
    tii_class = m.restrict(m.tii(backbone.cls_features(b.pixel_values)), b).argmax(-1)
    assert torch.equal(m.infer_task(b), m.task_of_class[tii_class])


def test_hide_prompt_multi_centroid_is_the_default_and_stores_each_cluster(backbone, sequence):
    """The official default storage: k-means per class; each cluster's mean and population variance; TAP
    draws from every cluster of two or more samples (one Gaussian each), the contrastive term reads every
    centroid. Features: class 3 in two tight blobs (one of them a single sample), class 4 in two blobs."""
    torch.manual_seed(5)
    m = _build("hide_prompt", backbone, sequence)
    assert m.params.ca_storage == "multi-centroid" and m.prompted_mean.shape == (6, 2, 32)
    g = torch.Generator().manual_seed(0)
    centres = {3: (torch.full((32,), 5.0), torch.full((32,), -5.0)), 4: (torch.full((32,), 20.0), torch.zeros(32))}
    counts = {3: (5, 1), 4: (3, 3)}
    feats, labels = [], []
    for c in (3, 4):
        for centre, n in zip(centres[c], counts[c]):
            feats.append(centre + 0.1 * torch.randn(n, 32, generator=g))
            labels += [c] * n
    x, y = torch.cat(feats), torch.tensor(labels)
    reduced = {"cat:frozen": x, "cat:prompted": x + 1.0, "cat:labels": y}
    m.finalize_statistics(reduced, 0)
    for c in (3, 4):
        got = sorted(range(2), key=lambda i: float(m.frozen_mean[c, i, 0]))
        for i, (centre, n) in zip(got, sorted(zip(centres[c], counts[c]), key=lambda p: float(p[0][0]))):
            members = x[(y == c) & ((x - centre).abs().amax(1) < 1)]
            assert len(members) == n
            assert torch.allclose(m.frozen_mean[c, i], members.mean(0), atol=1e-5)
            assert torch.allclose(m.frozen_cov[c, i], members.var(0, unbiased=False), atol=1e-6)
            assert torch.allclose(m.prompted_mean[c, i], members.mean(0) + 1.0, atol=1e-5)
    assert m.frozen_used[[3, 4]].all() and not m.frozen_used[[0, 1, 2, 5]].any()
    factors = m.replay_gaussians("frozen")
    assert sorted(c for c, _, _ in factors) == [3, 4, 4]  # class 3's single-sample cluster has zero variance
    for c, mean, scale in factors:
        i = int((m.frozen_mean[c] - mean.float()).abs().sum(1).argmin())
        assert torch.allclose(scale ** 2, m.frozen_cov[c, i].double() + 1e-4)
    # the contrastive term: 4 centroids + the batch's features
    feats_b = torch.randn(3, 32, generator=g)
    expected = torch.cat([m.prompted_mean[3], m.prompted_mean[4], feats_b])
    sim = expected @ expected.t() / 0.8
    assert torch.allclose(m.contrastive(feats_b), torch.nn.functional.cross_entropy(sim, torch.arange(7)), atol=1e-5)


def _hide_task(m, t, labels, g):
    """One HiDe task as the pipeline runs it: hooks, one SGD step, after_task, statistics stage."""
    m.before_task(t)
    m.set_task(t)
    b = Batch(torch.randn(12, 3, 16, 16, generator=g), torch.tensor(labels * 6), torch.ones(12), t)
    out = m(b)
    (out.per_sample.mean() + out.regularizer).backward()
    with torch.no_grad():
        m.e_prompt -= 0.5 * m.e_prompt.grad
    m.e_prompt.grad = None
    m.after_task(t)
    return b


@pytest.mark.parametrize("name", ["hide_prompt", "norga"])
def test_hide_prompt_hands_the_previous_prompt_over_to_the_next_task(name, backbone, sequence):
    """The official engines copy task t-1's E-prompt into task t's slot before training task t
    (shared_prompt_pool, on by default); switched off, task t starts from its own initial prompt."""
    for shared in (True, False):
        torch.manual_seed(5)
        m = _build(name, backbone, sequence, shared_prompt_pool=shared)
        _hide_task(m, 0, [3, 4], torch.Generator().manual_seed(0))
        initial = m.e_prompt[:, :, 1].detach().clone()
        m.before_task(1)
        expected = m.e_prompt[:, :, 0] if shared else initial
        assert torch.equal(m.e_prompt[:, :, 1], expected)
        assert not torch.equal(m.e_prompt[:, :, 0], initial)


def test_hide_prompt_class_statistics_read_the_stored_prompt(backbone, sequence):
    """after_task writes (1 - m) P_t + m mean(P_<t) into P_t once; the class statistics (official
    ``_compute_mean``: momentum 0) are the features of that stored prompt, not the mix applied again."""
    torch.manual_seed(5)
    m = _build("hide_prompt", backbone, sequence, prompt_momentum=0.5, ca_epochs=0, ca_storage="covariance")
    g = torch.Generator().manual_seed(0)
    _hide_task(m, 0, [3, 4], g)
    m.before_task(1)
    m.set_task(1)
    b = Batch(torch.randn(12, 3, 16, 16, generator=g), torch.tensor([1, 2] * 6), torch.ones(12), 1)
    with torch.no_grad():
        m.e_prompt[:, :, 1] += torch.randn_like(m.e_prompt[:, :, 1])  # task 1 moved away from task 0
        trained = m.e_prompt[:, :, 1].clone()
    m.after_task(1)
    mix = 0.5 * trained + 0.5 * m.e_prompt[:, :, 0]
    assert torch.allclose(m.e_prompt[:, :, 1], mix)  # momentum applied once, in place
    with torch.no_grad():
        stats = m.statistics(b)
        prefix = mix.unsqueeze(1).expand(-1, 12, -1, -1, -1, -1)
        feats = m.prompted_features(b.pixel_values, prefix)
    expected = torch.stack([feats[b.labels == c].sum(0) for c in (1, 2)]).double()
    assert torch.allclose(stats["prompted_sum"], expected, atol=1e-4)


def test_hide_prompt_task_adaptive_prediction_has_no_weight_decay_by_default(backbone, sequence):
    """The official TAP parameter group carries args.weight_decay = 0.0 (it overrides the optimizer's
    5e-4): the default equals an explicit 0, and 5e-4 gives another head."""
    heads = {}
    for wd in (None, 0.0, 5e-4):
        torch.manual_seed(5)
        m = _build("hide_prompt", backbone, sequence, **({} if wd is None else {"ca_weight_decay": wd}))
        g = torch.Generator().manual_seed(0)
        for t, labels in enumerate(([3, 4], [1, 2])):
            b = _hide_task(m, t, labels, g)
            with torch.no_grad():
                m.finalize_statistics(m.statistics(b), t)
        heads[wd] = m.head.weight.detach().clone()
    assert torch.equal(heads[None], heads[0.0]) and not torch.allclose(heads[None], heads[5e-4])


def test_hide_prompt_aligns_the_tii_head_with_its_own_lr_and_epochs(backbone, sequence):
    """The official TII run and prompt run align their heads with separate settings (NoRGa CIFAR-100:
    TII 0.005 x 128/256 for 30 epochs, TAP 0.05 for 80): tii_ca_lr / tii_ca_epochs move the TII head
    only, ca_lr / ca_epochs the prompted head only; by default both use ca_*."""
    def run(**over):
        torch.manual_seed(5)
        m = _build("hide_prompt", backbone, sequence, ca_epochs=2, **over)
        g = torch.Generator().manual_seed(0)
        for t, labels in enumerate(([3, 4], [1, 2])):
            b = _hide_task(m, t, labels, g)
            with torch.no_grad():
                m.finalize_statistics(m.statistics(b), t)
        return m

    base, same, off, lr = run(), run(tii_ca_lr=0.005, tii_ca_epochs=2), run(tii_ca_epochs=0), run(tii_ca_lr=0.05)
    tii = lambda m: torch.cat([p.detach().flatten() for p in m.tii.parameters()])  # noqa: E731
    assert torch.equal(tii(base), tii(same)) and torch.equal(base.head.weight, same.head.weight)
    assert "tii_ca_loss" not in off.subspace_report() and "tap_loss" in off.subspace_report()
    assert not torch.allclose(tii(off), tii(base)) and not torch.allclose(tii(lr), tii(base))
    # the TAP head's samples are drawn after the TII head's: equal TII sampling, equal TAP head
    assert torch.equal(lr.head.weight, base.head.weight)


def test_norga_gate_trains_on_the_first_task_only(backbone, sequence):
    """The official NoRGa engine freezes act_scale (tau, alpha) from task 1 on: task 0 trains it, later
    tasks neither differentiate nor hand it to the optimizer; ``gate_trainable: all_tasks`` keeps it."""
    for mode in ("first_task", "all_tasks"):
        m = _build("norga", backbone, sequence, gate_trainable=mode)
        for t in (0, 1, 2):
            m.before_task(t)
            m.set_task(t)
            trains = t == 0 or mode == "all_tasks"
            names = {n for g in m.param_groups() for p in g["params"] if p.requires_grad
                     for n, q in m.named_parameters() if q is p}
            assert ({"gate_tau", "gate_alpha"} <= names) == trains, (mode, t, names)
            b = Batch(torch.randn(4, 3, 16, 16), torch.tensor(list(sequence.tasks[t].classes) * 2), torch.ones(4), t)
            m(b).per_sample.sum().backward()
            assert (m.gate_tau.grad is not None) == trains
            m.zero_grad(set_to_none=True)


def test_norga_gate_rewrites_only_prefix_scores(backbone, sequence):
    m = _build("norga", backbone, sequence)
    with torch.no_grad():
        m.gate_tau[1] = 0.5
        m.gate_alpha[1] = 2.0
    s = torch.randn(2, 2, 5, 3 + 5)
    out = m.gate(1)(s, 3)
    assert torch.allclose(out[..., :3], s[..., :3] + 2.0 * torch.tanh(0.5 * s[..., :3]))
    assert torch.equal(out[..., 3:], s[..., 3:])
    b = Batch(torch.randn(4, 3, 16, 16), torch.tensor([3, 4, 3, 4]), torch.ones(4), 0)
    m.before_task(0)
    m(b).per_sample.sum().backward()
    assert m.gate_tau.grad.abs().sum() > 0 and m.gate_alpha.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["l2p+pgp", "dualprompt+pgp"])
def test_pgp_confines_updates_to_the_complement_of_old_features(name, backbone, sequence):
    """After task 0's statistics, keys move orthogonally to old queries and prompts (prefix keys)
    orthogonally to the old prompt-side features; with the switch off nothing is projected."""
    torch.manual_seed(6)
    m = _build(name, backbone, sequence)
    b = Batch(torch.randn(16, 3, 16, 16), torch.tensor([3, 4] * 8), torch.ones(16), 0)
    m.before_task(0)
    m.set_task(0)
    with torch.no_grad():
        m.finalize_statistics(m.statistics(b), 0)
    assert int(m.pgp_key_rank) > 0 and all(int(r) > 0 for r in m.pgp_prompt_rank)
    m.before_task(1)
    m.set_task(1)
    key_name, prompt_name = ("prompt_key", "prompt") if name == "l2p+pgp" else ("e_key", "e_prompt")
    params = dict(m.named_parameters())
    dk = m.project_update(key_name, torch.randn_like(params[key_name]))
    if name == "l2p+pgp":
        assert (dk @ m.key_basis()).abs().max() < 1e-4
    else:  # the official dualprompt-pgp engine leaves E-prompt keys free; project_e_key confines them
        assert dk is None
        m.params.project_e_key = True
        dk = m.project_update(key_name, torch.randn_like(params[key_name]))
        assert (dk @ m.key_basis()).abs().max() < 1e-4
    dp = m.project_update(prompt_name, torch.randn_like(params[prompt_name]))
    if name == "l2p+pgp":
        assert (dp @ m.prompt_basis(0)).abs().max() < 1e-4
    else:
        i = m.prompted.index(m.params.e_layers[0])
        assert (dp[0, 0] @ m.prompt_basis(i)).abs().max() < 1e-4  # key half of the prefix
    assert m.project_update("head.weight", torch.randn_like(m.head.weight)) is None


def test_ablation_switches_vpt_nsp2_conditions_and_norga_gate(backbone, sequence):
    """VPT-NSP²: ``eta`` sets eta1 and eta2 over their own values; ``project_qk: false`` (B2 only) and
    ``project_sp: false`` (B1 only) leave that projection the identity. NoRGa ``gate: false``: no
    score rewrite, gate parameters neither trained nor in the optimizer, features change."""
    cls = METHODS.get("vpt_nsp2")
    assert cls.Params(eta=0.9, eta1=0.5).eta1 == cls.Params(eta=0.9).eta2 == 0.9
    x = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    projections = {}
    for flags in ({}, {"project_qk": False}, {"project_sp": False}):
        torch.manual_seed(0)  # the same prompts each time
        m = _build("vpt_nsp2", backbone, sequence, eta=1.0, **flags)
        m.finalize_statistics(m.statistics(Batch(x, torch.tensor([3, 4] * 8), torch.ones(16), 0)), 0)
        projections[tuple(flags)] = (m.proj1[0].clone(), m.proj2[0].clone())
    eye1, eye2 = torch.eye(projections[()][0].shape[0]), torch.eye(projections[()][1].shape[0])
    assert not torch.allclose(projections[()][0], eye1) and not torch.allclose(projections[()][1], eye2)
    assert (torch.equal(projections[("project_qk",)][0], eye1)
            and torch.equal(projections[("project_qk",)][1], projections[()][1]))
    assert (torch.equal(projections[("project_sp",)][1], eye2)
            and torch.equal(projections[("project_sp",)][0], projections[()][0]))
    torch.manual_seed(0)
    on = _build("norga", backbone, sequence)
    torch.manual_seed(0)
    off = _build("norga", backbone, sequence, gate=False)
    assert on.gate(0) is not None and off.gate(0) is None
    assert not off.gate_tau.requires_grad and not off.gate_alpha.requires_grad
    assert {id(p) for g in off.param_groups() for p in g["params"]}.isdisjoint({id(off.gate_tau), id(off.gate_alpha)})
    prefix = on.e_prompt[:, :, 0].unsqueeze(1).expand(-1, 4, -1, -1, -1, -1)
    assert not torch.allclose(on.prompted_features(x[:4], prefix), off.prompted_features(x[:4], prefix))


def test_vpt_nsp2_null_space_criterion_matches_the_official_rule():
    """The knee of a spectrum with a clear drop, the >= 128-value smoothed branch, offsets, 'times'."""
    from mcit.methods.vpt_nsp2 import null_projection, null_space_start

    s = np.array([10.0, 9.5, 9.0, 1.0, 0.9, 0.8, 0.7])
    # first differences .5 .5 8 .1 .1 .1; second 0 -7.5 7.9 0 0: argmax 2, + 1 -> threshold s[3] = 1.0; the
    # null space starts at the last value >= it (the official i_thres), i.e. right after the drop
    assert null_space_start(s, "adaptive", 0.0) == 3
    assert null_space_start(s, "adaptive", 2) == 5
    assert null_space_start(s, "times", 2) == 3  # values <= 2 x the smallest
    big = np.concatenate([np.linspace(100, 90, 60), np.linspace(5, 1, 140)])
    start = null_space_start(big, "adaptive", 0.0)
    assert 50 <= start <= 70  # the knee of the smoothed curve, near the drop at 60
    assert null_space_start(np.array([3.0, 1.0]), "adaptive", 0.0) == 1
    cov = torch.diag(torch.tensor([10.0, 9.5, 9.0, 1.0, 0.9, 0.8, 0.7], dtype=torch.float64))
    p, k = null_projection(cov, "adaptive", 0.0, 1.0)
    assert k == 4 and torch.allclose(p[:3, :3], torch.zeros(3, 3), atol=1e-6)
    assert torch.allclose(torch.linalg.norm(p), torch.tensor(1.0), atol=1e-5)  # Frobenius-normalised


def test_soft_tf_defaults_are_the_official_target_layer_with_its_mlp(backbone, sequence):
    """The official configs mask only the last E-prompt block (``target_layers``: 11 on CIFAR-100, 5 on
    ImageNet-R), attention and MLP, with masks drawn from uniform(0.99, 1)."""
    torch.manual_seed(0)
    m = _build("soft_tf", backbone, sequence, g_layers=[], e_layers=[0, 1])
    names = [n for n, _ in m.named_parameters() if n.startswith("wmask")]
    assert {n.split("_")[1] for n in names} == {"l1"}
    assert {n.split("_", 2)[2] for n in names} == {"q", "k", "v", "o", "fc1", "fc2"}
    w = m.wmask_l1_q.detach()
    assert w.min() >= 0.99 and w.max() <= 1.0 and w.std() > 1e-4
    l2p = _build("l2p+soft_tf", backbone, sequence)
    assert {n.split("_")[1] for n, _ in l2p.named_parameters() if n.startswith("wmask")} == {"l1"}


@pytest.mark.parametrize("name", ["soft_tf", "l2p+soft_tf"])
def test_soft_tf_gradient_id_picks_the_task_whose_masks_make_the_sample_confident(name, backbone, sequence):
    """The one-shot rule: raising the weight of the sample's own task's masks sharpens its logits (the
    entropy falls), raising another task's flattens them, so the task is the most *negative* gradient.
    The logits under each task's masks are set here (a sample of task k: its class peaked under k's
    masks, the same class pushed down under the others'); a rule that takes the most positive gradient,
    always task 0, or one task for the batch gets these wrong."""
    m = _build(name, backbone, sequence, task_inference="gradient_id")
    g = torch.Generator().manual_seed(0)
    true = torch.tensor([0, 1, 2, 2, 1, 0, 1, 2])
    own = torch.tensor([list(sequence.tasks[int(k)].classes)[int(i) % 2] for i, k in enumerate(true)])
    per_task = torch.randn(3, len(true), sequence.num_classes, generator=g) * 0.1
    for t in range(3):
        per_task[t, torch.arange(len(true)), own] += torch.where(true == t, 9.0, -3.0)
    m.superposed_logits = lambda rows, mix: torch.einsum("bt,tbc->bc", mix[:, :3], per_task[:, : len(rows)])
    allowed = torch.ones(sequence.num_classes, dtype=torch.bool)
    b = Batch(torch.zeros(len(true), 3, 16, 16), own, torch.ones(len(true)), 2, allowed_classes=allowed)
    assert torch.equal(m.gradient_id(b), true)
    assert torch.equal(m.infer_task(b), true)


def test_soft_tf_masks_at_one_reproduce_the_unmasked_backbone(backbone, sequence):
    """Masks initialised at 1 (``mask_init: ones``): the masked network is the pre-trained one, up to rounding for
    one task's masks (bit for bit with MKL's default kernels; 4.8e-7 on its reproducible path, MKL_CBWR=COMPATIBLE,
    which rounds the per-sample masked product apart from the plain one) and for a superposition of all tasks' masks
    (up to 5.4e-7 over the kernel sets of `make test-numerics`; features of scale 2.3)."""
    torch.manual_seed(0)
    m = _build("soft_tf", backbone, sequence, mask_mlp=True, mask_init="ones")
    assert {n.split("_l")[0] for n, _ in m.named_parameters() if n.startswith(("wmask", "bmask"))} == {"wmask", "bmask"}
    x = torch.randn(5, 3, 16, 16)
    idx = torch.tensor([0, 1, 2, 1, 0])
    plain = m.features(x, idx.view(-1, 1))
    assert torch.allclose(m.task_features(x, idx), plain, atol=1e-5)
    with m.masks(torch.full((5, 3), 1 / 3)):
        mixed = m.features(x, idx.view(-1, 1))
    assert torch.allclose(mixed, plain, atol=1e-5)
    tokens = backbone.embed(x)
    with m.masks(torch.eye(3)[idx]):
        assert torch.equal(backbone.encode(tokens), backbone.encode(backbone.embed(x)))
    # a changed mask changes only the samples of its task (0.096 there; the others within rounding: 0 with MKL's
    # default kernels, 4.8e-7 on its reproducible path)
    with torch.no_grad():
        m.wmask_l1_v[2].mul_(0.5)
    moved = (m.task_features(x, idx) - plain).abs().flatten(1).amax(1)
    assert moved[idx == 2].min() > 1e-2 and moved[idx != 2].max() <= 1e-5
    # on L2P: masks on both blocks, the L2P forward unchanged at 1
    torch.manual_seed(0)
    l2p = _build("l2p+soft_tf", backbone, sequence, mask_init="ones", mask_layers=[0, 1])
    assert l2p.mask_layers == [0, 1] and l2p.task_key.shape == (3, backbone.hidden_size)
    assert torch.allclose(l2p.task_logits(x, idx), l2p.prompted(x)["logits"], atol=1e-5)


def test_soft_tf_trains_only_the_current_tasks_masks_and_infers_task_per_sample(backbone, sequence):
    torch.manual_seed(0)
    m = _build("soft_tf", backbone, sequence)
    m.before_task(1)
    out = m(Batch(torch.randn(6, 3, 16, 16), torch.tensor([1, 2] * 3), torch.ones(6), 1))
    out.per_sample.mean().backward()
    g = m.wmask_l1_q.grad
    assert g[1].abs().sum() > 0 and g[0].abs().sum() == 0 and g[2].abs().sum() == 0
    kept = m.project_update("wmask_l1_q", torch.ones_like(m.wmask_l1_q))
    assert kept[1].eq(1).all() and kept[0].eq(0).all() and kept[2].eq(0).all()
    assert m.project_update("e_prompt", torch.ones(3)) is None
    # gradient-ID per sample vs the official batch rule (one task for the whole batch)
    x = torch.randn(16, 3, 16, 16)
    allowed = torch.ones(sequence.num_classes, dtype=torch.bool)
    b = Batch(x, torch.zeros(16, dtype=torch.long), torch.ones(16), 0, allowed_classes=allowed)
    with torch.no_grad():
        m.wmask_l1_o[0].mul_(0.2)  # make the tasks' masks differ
        m.wmask_l1_o[2].mul_(3.0)
    per_sample = m.gradient_id(b)
    batch_rule = m.gradient_id(b, per_sample=False)
    assert per_sample.shape == (16,) and batch_rule.unique().numel() == 1
    assert torch.equal(per_sample[:7], torch.cat([m.gradient_id(b.select(torch.tensor([i]))) for i in range(7)]))


def test_collate_normalises_on_the_cpu_after_the_model_moved(backbone):
    """The collate builds batches on the CPU (in loader workers) after the backbone went to the GPU, so
    ``preprocess`` must not read the device-side mean / std buffers. Found on an H100: every ViT run stopped
    at the zero-shot evaluation ("cuda:0 and cpu"). The meta device stands in for the GPU here."""
    import copy

    from PIL import Image

    ims = [Image.new("RGB", (16, 16), (200, 30, 90)), Image.new("RGB", (20, 20), (0, 255, 10))]
    ref = backbone.preprocess(ims)
    moved = copy.deepcopy(backbone).to("meta")
    assert moved.mean.device.type == "meta"
    out = moved.preprocess(ims)
    assert out.device.type == "cpu" and torch.equal(out, ref)
    assert not torch.equal(ref, backbone.preprocess(ims[::-1]))


def test_hide_prompt_regularizer_is_zero_on_a_padding_only_micro_batch(backbone, sequence):
    """A rank whose micro-batch is all padding (the other rank holds the last real samples) before any class
    mean is stored: the contrastive term has no rows. It was the NaN of an empty cross-entropy, which the
    non-finite guard (rightly) stopped a 2-rank HiDe run on; it is 0."""
    m = _build("hide_prompt", backbone, sequence)
    out = m.contrastive(torch.zeros(0, backbone.hidden_size, requires_grad=True))
    assert torch.isfinite(out) and float(out) == 0.0
