"""SEFE's RegLoRA against jinpeng0528/SEFE (official/sefe.json): a tiny Llama (16 wide, 2 layers, MLP 24, vocab 32)
with LoRA r 4, alpha 8 on all 7 projections of both layers, three tasks of three SGD steps each on the official
LlavaLlamaForCausalLM loss (cross-entropy of the shifted logits + 2.5e3 * loss_reg), each task's fresh pair set
to the same values on both sides (the second task's to the first's trained pair, so that a key element repeats in
the concatenation the third task is regularised on); after each task the official key_elements_identification.py
ran on the saved adapter and the official merge (merge_and_unload) built the next task's model.

Pinned: the logits of the merged model plus the new pair, the regulariser (loss_reg, before the 2.5e3) and the
total loss at every step, the trained pair after each task (so the gradients of both terms, and that the earlier
pair stays frozen), the key elements (row, col) after each task (the second task's concatenated onto the first's),
and the merged model's logits after each task.
"""

from __future__ import annotations

import tiny_inputs as T
import torch

from mcit.core.registry import METHODS
from mcit.data.types import TaskSequence
from mcit.methods.instruction import lm_outputs

H, LAYERS, HEADS, MLP, VOCAB = 16, 2, 2, 24, 32


def wide_llama():
    """The official run's LLM (LlavaLlamaForCausalLM's .model, 16 wide) and lm_head, as there: every weight
    0.3 * randn (norms 1 + 0.3 * randn) from Generator seed 0 in sorted name order, the head from seed 5."""
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                      intermediate_size=MLP, vocab_size=VOCAB)
    lm = LlamaModel(cfg)
    g = torch.Generator().manual_seed(0)
    names = []
    with torch.no_grad():
        for name, p in sorted(lm.named_parameters()):
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
            names.append(name)
    head = 0.3 * torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(5))
    return lm, head, names


TOL = T.TOLERANCE["sefe"]


def close(ours: torch.Tensor, ref, what: str) -> float:
    """``assert_close`` with the tolerance TOL of the official value's largest magnitude, also below 1."""
    scale = float(T.as_tensor(ref).abs().max())
    assert scale > 0, f"{what}: the official value is zero"
    return T.assert_close(ours, ref, what, tol=TOL * min(1.0, scale))


def logits(lm, head: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return lm(inputs_embeds=x).last_hidden_state @ head.T


def cross_entropy(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """LlavaLlamaForCausalLM's CrossEntropyLoss of the shifted logits (ignore index -100)."""
    return torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def test_sefe_regularises_the_key_elements_and_trains_as_the_official_code():
    ref = T.official("sefe")["values"]
    lm, head, names = wide_llama()
    assert names == ref["param_names"]
    cls = METHODS.get("sefe")
    n = len(ref["tasks"]) + 1  # one more task reads the last task's key elements
    seq = TaskSequence.from_label_spaces([f"t{i}" for i in range(n)], [[] for _ in range(n)])
    m = cls(cls.Params(r=ref["r"], alpha=ref["alpha"], dropout=0.0, train_projector=False), T.LanguageModelHolder(lm),
            seq)
    stacks = m.stacks()
    assert sorted(stacks) == sorted(ref["tasks"][0]["init"])  # all 7 projections of both layers
    x, labels = torch.tensor(ref["x"]), torch.tensor(ref["labels"])
    for t, rec in enumerate(ref["tasks"]):
        m.set_task(t)
        m.before_task(t)
        with torch.no_grad():
            for name, pair in rec["init"].items():
                stacks[name].a(t).copy_(torch.tensor(pair["A"]))
                stacks[name].b(t).copy_(torch.tensor(pair["B"]))
            close(logits(lm, head, x), rec["logits_before"], f"task {t}: logits before training")
        if t > 0:
            for name, rows in ref["tasks"][t - 1]["key_elements"].items():
                assert m.key_elements()[name].tolist() == rows, f"task {t}: key elements of {name}"
        opt = torch.optim.SGD(m.trainable_parameters(), lr=ref["lr"])
        for s, want in enumerate(rec["steps"]):
            opt.zero_grad()
            out = logits(lm, head, x)
            ce = cross_entropy(out, labels).reshape(1)  # the official mean over the batch's answer tokens
            terms = m.loss(None, lm_outputs((ce, torch.ones(1, dtype=torch.long))))
            total = terms.per_sample.mean()
            if t == 0:
                assert terms.regularizer is None and want["reg"] == 0
            else:
                close(torch.tensor(terms.logs["reg_loss"]), want["reg"], f"task {t} step {s}: regularisation loss")
                total = total + terms.regularizer
            close(total, want["total"], f"task {t} step {s}: total loss")
            total.backward()
            if s == 0:
                for name, grad in rec["grad_first_step"].items():
                    close(stacks[name].a(t).grad, grad["A"], f"task {t}: first step's gradient of {name} A")
                    close(stacks[name].b(t).grad, grad["B"], f"task {t}: first step's gradient of {name} B")
            opt.step()
        for name, pair in rec["trained"].items():
            close(stacks[name].a(t), pair["A"], f"task {t}: trained {name} A")
            close(stacks[name].b(t), pair["B"], f"task {t}: trained {name} B")
        m.after_task(t)
        with torch.no_grad():
            close(logits(lm, head, x), rec["logits_merged"], f"task {t}: merged model's logits")
    m.set_task(len(ref["tasks"]))
    m.before_task(len(ref["tasks"]))
    for name, rows in ref["tasks"][-1]["key_elements"].items():
        assert m.key_elements()[name].tolist() == rows, f"after the last task: key elements of {name}"
