"""Method behaviour that the pipeline relies on: per-sample inference, masking, state."""

import pytest
import torch

from mcit.data.types import Batch
from mcit.methods.l2p import L2P, L2PParams
from mcit.methods.seq import Seq, SeqParams


def _batch(n, seed=0, task=0):
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randn(n, 3, 16, 16, generator=g), torch.zeros(n, dtype=torch.long), torch.ones(n), task)


def test_sequence_maps_labels_to_contiguous_indices(sequence):
    assert sequence.labels == (0, 1, 2, 3, 7, 9)
    assert sequence.tasks[0].classes == (3, 4)  # labels 3, 7


@pytest.mark.parametrize("cls, params", [(L2P, L2PParams(pool_size=6, top_k=3, prompt_length=2)),
                                         (Seq, SeqParams(prompt_length=3))])
def test_predictions_do_not_depend_on_test_batch_size(backbone, sequence, cls, params):
    torch.manual_seed(1)
    m = cls(params, backbone, sequence).eval()
    big = _batch(24, seed=3)
    whole = m.predict(big)
    one_by_one = torch.cat([m.predict(Batch(big.pixel_values[i:i + 1], big.labels[i:i + 1], big.valid[i:i + 1], 0))
                            for i in range(24)])
    assert torch.equal(whole, one_by_one)


def test_l2p_selection_is_per_sample_and_batchwise_is_explicit(backbone, sequence):
    torch.manual_seed(2)
    m = L2P(L2PParams(pool_size=8, top_k=2, prompt_length=2), backbone, sequence)
    q = torch.randn(5, 32)
    idx, sim = m.select(q)
    for i in range(5):  # each row is the top-k of its own similarities
        assert set(idx[i].tolist()) == set(sim[i].topk(2).indices.tolist())
        assert torch.equal(m.select(q[i:i + 1])[0][0], idx[i])
    mb = L2P(L2PParams(pool_size=8, top_k=2, prompt_length=2, batchwise_selection=True), backbone, sequence)
    mb.load_state_dict(m.state_dict())
    bidx, _ = mb.select(q)
    assert (bidx == bidx[0]).all()  # one voted set for the whole batch


def test_l2p_train_mask_and_pull_term(backbone, sequence):
    """Training on task 1 (labels 1, 2): the other tasks' classes cannot win or lose the loss, however
    large their logits (train_mask), unless train_mask is off; one gradient step on the loss turns the
    selected keys towards their queries (the pull term) and leaves the other keys and the other classes'
    head rows alone."""
    batch = _batch(4, task=1)
    batch.labels = torch.tensor([1, 2, 1, 2])
    losses = {}
    for mask in (True, False):
        for boost in (0.0, 50.0):
            torch.manual_seed(3)
            m = L2P(L2PParams(pool_size=6, top_k=2, prompt_length=2, pull_coeff=0.5, train_mask=mask), backbone,
                    sequence)
            with torch.no_grad():
                m.head.bias[[0, 3, 4, 5]] += boost  # other tasks' classes: logits far above the task's own
            losses[mask, boost] = m.loss(batch, m.train_outputs(batch)).per_sample.detach()
    assert torch.isfinite(losses[True, 0.0]).all() and torch.allclose(losses[True, 0.0], losses[True, 50.0])
    assert (losses[False, 50.0] > losses[False, 0.0] + 10).all()

    torch.manual_seed(3)
    m = L2P(L2PParams(pool_size=6, top_k=2, prompt_length=2, pull_coeff=0.5), backbone, sequence)
    out = m.train_outputs(batch)
    m.loss(batch, out).per_sample.mean().backward()
    query = torch.nn.functional.normalize(backbone.cls_features(batch.pixel_values), dim=-1)
    chosen = out["idx"].unique()
    before = torch.nn.functional.normalize(m.prompt_key.detach(), dim=-1)
    after = torch.nn.functional.normalize(m.prompt_key.detach() - 0.1 * m.prompt_key.grad, dim=-1)
    gain = ((after - before) @ query.t()).sum(dim=1)  # summed cosine change to the batch's queries
    assert (gain[chosen] > 0).all()
    others = [i for i in range(6) if i not in chosen.tolist()]
    assert m.prompt_key.grad[others].abs().sum() == 0
    assert m.head.weight.grad[[0, 3, 4, 5]].abs().sum() == 0  # other tasks' classes get no gradient


def test_l2p_prompts_carry_the_cls_position_embedding(backbone, sequence):
    """The official L2P repeats the [CLS] entry of the (frozen) position table over the prompt slots:
    prompts P with it give what prompts P + pos_cls give without it, and not what P alone gives."""
    torch.manual_seed(4)
    m = L2P(L2PParams(pool_size=4, top_k=2, prompt_length=2), backbone, sequence)
    bare = L2P(L2PParams(pool_size=4, top_k=2, prompt_length=2, prompt_position="none"), backbone, sequence)
    bare.load_state_dict(m.state_dict())
    x = _batch(3).pixel_values
    with torch.no_grad():
        got = m.prompted(x)["logits"]
        plain = bare.prompted(x)["logits"]
        bare.prompt += backbone.model.embeddings.position_embeddings[0, 0]
        shifted = bare.prompted(x)["logits"]
    assert torch.allclose(got, shifted, atol=1e-6) and not torch.allclose(got, plain, atol=1e-4)


def test_state_dict_holds_only_method_state(backbone, sequence):
    m = L2P(L2PParams(), backbone, sequence)
    assert set(m.state_dict()) == {"prompt", "prompt_key", "head.weight", "head.bias"}
    assert all(not p.requires_grad for p in backbone.parameters())


def test_allowed_classes_restrict_predictions(backbone, sequence):
    m = Seq(SeqParams(), backbone, sequence).eval()
    b = _batch(10)
    b.allowed_classes = torch.tensor([False, False, False, True, True, False])
    assert set(m.predict(b).tolist()) <= {3, 4}
