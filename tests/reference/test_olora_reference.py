"""O-LoRA against cmnfriend/O-LoRA (official/olora.json): three tasks on a tiny Llama, each starting from the
official fresh pair (loranew_A/B, set to the same values on both sides), three SGD steps on
mse(hidden states) + lamda_1 * orthogonal + lamda_2 * l2 through the official training_step's regulariser,
then the official save (the new pair concatenated onto lora_A/B) and a reload for the next task.

Pinned: the forward with the frozen old pairs and the new pair, both regulariser terms, the trained pair
(so the gradients of every term, and that the old pairs stay frozen), the concatenated adapters after each
task and the merged model's output.
"""

from __future__ import annotations

import tiny_inputs as T
import torch

from mcit.core.registry import METHODS
from mcit.data.types import TaskSequence
from mcit.methods.instruction import lm_outputs

TOL = T.TOLERANCE["olora"]


def _block(m, key: str):
    """``layers.0.self_attn.q_proj.loranew_A.weight`` -> our (module, "A") entry."""
    module, kind = key.split(".lora")[0], key.split(".lora")[1]
    return m.adapters[module.replace(".", "__")]["A" if kind.startswith(("new_A", "_A")) else "B"]


def test_olora_trains_merges_and_regularises_as_the_official_code():
    ref = T.official("olora")["values"]
    lm = T.llama_lm()
    cls = METHODS.get("olora")
    seq = TaskSequence.from_label_spaces(["a", "b", "c"], [[], [], []])
    m = cls(cls.Params(r=ref["r"], alpha=ref["alpha"], dropout=0.0, lamda_1=ref["lamda_1"], lamda_2=ref["lamda_2"],
                     train_projector=False),
            T.LanguageModelHolder(lm), seq)
    x, y = torch.tensor(ref["x"]), torch.tensor(ref["y"])
    for t, rec in enumerate(ref["tasks"]):
        m.set_task(t)
        with torch.no_grad():
            for key, value in rec["loranew_init"].items():
                _block(m, key).blocks[t].copy_(torch.tensor(value))
        with torch.no_grad():
            T.assert_close(lm(inputs_embeds=x).last_hidden_state, rec["out_before"],
                           f"task {t}: output before training", TOL)
        opt = torch.optim.SGD(m.trainable_parameters(), lr=ref["lr"])
        for s, want in enumerate(rec["losses"]):
            opt.zero_grad()
            task = torch.nn.functional.mse_loss(lm(inputs_embeds=x).last_hidden_state, y)
            terms = m.loss(None, lm_outputs((task.reshape(1), torch.ones(1, dtype=torch.long))))
            total = terms.per_sample.mean() + terms.regularizer
            T.assert_close(torch.tensor(terms.logs["orthogonal_loss"]), want["orthogonal"],
                           f"task {t} step {s}: orthogonal loss", TOL)
            T.assert_close(torch.tensor(terms.logs["l2_loss"]), want["l2"], f"task {t} step {s}: l2 loss", TOL)
            T.assert_close(total, want["total"], f"task {t} step {s}: total loss", TOL)
            total.backward()
            opt.step()
        for key, value in rec["loranew_trained"].items():
            T.assert_close(_block(m, key).blocks[t], value, f"task {t}: trained {key}", TOL)
        for key, value in rec["merged"].items():
            stack = _block(m, key)
            T.assert_close(torch.cat(stack.blocks[: t + 1], dim=stack.dim), value, f"task {t}: merged {key}", TOL)
        with torch.no_grad():
            T.assert_close(lm(inputs_embeds=x).last_hidden_state, rec["out_merged"], f"task {t}: merged model output",
                           TOL)
