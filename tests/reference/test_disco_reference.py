"""DISCO against the official code (official/disco.json: MCITlib's DISCO/ copy of Ghy0501/FCIT's method, run on the
same fixed inputs): every linear layer of a tiny Llama (2 layers) with one LoRA subspace per task (2 tasks, rank 2
each: r 4, alpha 8), every subspace set to the same values on both sides, fixed CLIP text features (5 wide) in place
of the text tower.

Pinned, for each task: the loss of each SGD step on mse(hidden states) (training uses the task's own subspace in every
layer), every subspace after the steps (the task's moved, the other untouched), the text keys after the task (the
official running sum = our mean times the count; the untrained task's key still zero), and for four queries the
activation weights over both tasks (the untrained task's zero key included), two routed layers' outputs and the LLM's
output; the official batch-level routing for the record.
"""

from __future__ import annotations

import types

import tiny_inputs as T
import torch

from mcit.core.registry import METHODS
from mcit.data.types import TaskSequence
from mcit.methods.hide_llava import instruction_text

TOL = T.TOLERANCE["disco"]


def _close(ours: torch.Tensor, ref, what: str) -> None:
    """Max abs difference at most TOL times the official quantity's own largest magnitude (no floor)."""
    T.assert_rel_close(ours, ref, what, TOL)


def _slot(m, key: str) -> torch.nn.Parameter:
    """``layers.0.self_attn.q_proj.lora_A.1`` (task 1's A) -> our block."""
    module, part = key.rsplit(".lora_", 1)
    kind, i = part.split(".")
    return getattr(m.adapters[module.replace(".", "__")][kind], f"task{i}")


def _build(ref):
    lm = T.llama_lm()
    clip = types.SimpleNamespace(text_hidden_size=len(ref["data"][0]["text"][0][0]))  # the keys' size
    cls = METHODS.get("disco")
    seq = TaskSequence.from_label_spaces(["a", "b"], [[], []])
    m = cls(cls.Params(r=ref["r"], alpha=ref["alpha"], dropout=0.0, target_modules="all-linear", train_projector=False,
                       clip_path="unused"), T.LanguageModelHolder(lm), seq, auxiliary={"clip": clip})
    return m, lm


def test_disco_trains_keys_and_activates_subspaces_as_the_official_code():
    ref = T.official("disco")["values"]
    m, lm = _build(ref)
    E = ref["experts"]
    assert m.params.temperature == 0.05 and len(m.adapters) == 2 * len(ref["targets"])
    assert len(ref["init"]) == 2 * len(m.adapters) * E
    with torch.no_grad():
        for key, value in ref["init"].items():
            _slot(m, key).copy_(torch.tensor(value))
    assert torch.equal(m.keys, torch.zeros(E, m.keys.shape[1]))  # the official zeros
    z = torch.tensor(ref["z"])
    zd = torch.cat([z, z[:, :4]], dim=1)  # down_proj's 12 inputs, as the official run built them
    q0, down1 = lm.layers[0].self_attn.q_proj, lm.layers[1].mlp.down_proj
    for t, (d, rec) in enumerate(zip(ref["data"], ref["tasks"])):
        m.set_task(t)
        m.before_task(t)
        m.train()
        # dynamic knowledge organization, centralised: task t trains its own subspace in every layer, nothing else
        mine = {id(p) for p in m.trainable_parameters()}
        assert mine == {id(_slot(m, k)) for k in ref["init"] if k.endswith(f".{t}")}
        assert sorted(rec["untouched"]) == sorted(k for k in ref["init"] if not k.endswith(f".{t}"))
        m.select_prompts(None, None, None)  # the method's train mode: the current task's subspace
        x, y = torch.tensor(d["x"]), torch.tensor(d["y"])
        opt = torch.optim.SGD(m.trainable_parameters(), lr=ref["lr"])
        for s, want in enumerate(rec["losses"]):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(lm(inputs_embeds=x).last_hidden_state, y)
            _close(loss, want, f"task {t} step {s}: loss")
            loss.backward()
            opt.step()
        for key, value in rec["trained"].items():
            _close(_slot(m, key), value, f"task {t}: trained {key}")
        # the task boundary: the task's key from its training features (the subspace stage's sums)
        text = torch.tensor(d["text"])
        n = text.shape[0] * text.shape[1]
        m.finalize_statistics({"text": text.sum((0, 1)).double(), "count": torch.tensor(float(n))}, t)
        official_keys = torch.tensor(rec["text_keys"])
        assert rec["text_boundary"] == [1.0] * len(rec["text_boundary"])  # never incremented: a running sum
        for i in range(E):
            if i <= t:  # the official running sum over the task's batches = our mean times the count
                _close(m.keys[i] * m.key_count[i], official_keys[i], f"task {t}: key {i}")
                assert float(m.key_count[i]) == n
            else:  # not trained yet: zero on both sides
                assert not official_keys[i].any() and not m.keys[i].any() and float(m.key_count[i]) == 0
        # subspace selective activation after task t (every task's key, trained or not)
        m.eval()
        with torch.no_grad():
            for j, (q, want) in enumerate(zip(ref["queries"], rec["queries"])):
                # the selection as a forward makes it, from the sample's text feature (CLIP's, fixed here)
                m.text_features = lambda batch, q=q: torch.tensor(q["text"])
                m.select_prompts(None, None, None)
                w = m.route.gates
                assert m.route.mode == "infer" and w is not None
                _close(w, [want["weights"]], f"task {t} query {j}: activation weights")
                # the official lora_AB is block-diag(w_i I): what our weights scale A's blocks by
                k = m.params.r // E
                assert torch.allclose(torch.tensor(want["lora_AB_q0"]),
                                      torch.block_diag(*[wi * torch.eye(k) for wi in want["weights"]]))
                _close(q0(z), want["q0"], f"task {t} query {j}: routed q_proj of layer 0")
                _close(down1(zd), want["down1"], f"task {t} query {j}: routed down_proj of layer 1")
                _close(lm(inputs_embeds=torch.tensor(q["x"])).last_hidden_state, want["out"],
                       f"task {t} query {j}: output")


def test_disco_routes_each_sample_where_the_official_code_routes_the_batch_mean():
    """The departure: the official evaluation branch routes a batch by its mean text feature (its evaluation runs one
    sample at a time); here each sample by its own."""
    ref = T.official("disco")["values"]
    m, _ = _build(ref)
    last = ref["tasks"][-1]
    n = len(ref["data"][0]["text"]) * len(ref["data"][0]["text"][0])
    for t, rec in enumerate(ref["tasks"]):
        m.finalize_statistics({"text": torch.tensor(rec["text_keys"][t]).double(), "count": torch.tensor(float(n))}, t)
    pair = torch.cat([torch.tensor(ref["queries"][j]["text"]) for j in (0, 1)])
    _close(m.route_weights(pair.mean(0, keepdim=True)), [ref["batch_weights"]], "batch-mean routing")
    per_sample = m.route_weights(pair)
    _close(per_sample, [last["queries"][j]["weights"] for j in (0, 1)], "per-sample routing")
    assert (per_sample - torch.tensor(ref["batch_weights"])).abs().max() > 0.1


def test_disco_reads_the_instruction_the_official_code_hands_clip():
    """The official text: the decoded input without its first line, cut at the first " ASSISTANT" -- for LLaVA's
    "<image>\\n" + question layout, the first question without its placeholder."""
    texts = T.official("disco")["values"]["texts"]
    questions = ["<image>\nWhat colour is the shape?", "<image>\nWhich option?\nA. one\nB. two"]
    assert [instruction_text(q) for q in questions] == texts["clip_texts"]
