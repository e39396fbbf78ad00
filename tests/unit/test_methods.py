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
    torch.manual_seed(3)
    m = L2P(L2PParams(pool_size=6, top_k=2, prompt_length=2, pull_coeff=0.5), backbone, sequence)
    batch = _batch(4, task=1)
    batch.labels = torch.tensor([1, 2, 1, 2])
    out = m.train_outputs(batch)
    terms = m.loss(batch, out)
    logits = out["logits"].float()
    masked = torch.full_like(logits, float("-inf"))
    masked[:, [1, 2]] = logits[:, [1, 2]]
    expected = torch.nn.functional.cross_entropy(masked, batch.labels, reduction="none") - 0.5 * out["selected_sim"]
    assert torch.allclose(terms.per_sample, expected)
    terms.per_sample.mean().backward()
    assert m.prompt_key.grad is not None and m.prompt_key.grad.abs().sum() > 0
    assert m.head.weight.grad[[0, 3, 4, 5]].abs().sum() == 0  # other tasks' classes get no gradient


def test_state_dict_holds_only_method_state(backbone, sequence):
    m = L2P(L2PParams(), backbone, sequence)
    assert set(m.state_dict()) == {"prompt", "prompt_key", "head.weight", "head.bias"}
    assert all(not p.requires_grad for p in backbone.parameters())


def test_allowed_classes_restrict_predictions(backbone, sequence):
    m = Seq(SeqParams(), backbone, sequence).eval()
    b = _batch(10)
    b.allowed_classes = torch.tensor([False, False, False, True, True, False])
    assert set(m.predict(b).tolist()) <= {3, 4}
