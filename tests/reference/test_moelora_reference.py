"""MoELoRA against zackschen/CoIN's CoINMOELoraLinear (official/moelora.json): every linear layer of a tiny
Llama with 2 experts of rank 2 (r 4, alpha 8), router and experts set to the same values on both sides,
two tasks of three SGD steps each on mse(hidden states), the second continuing from the first.

Pinned: the router's softmax weights, the routed output, every trained parameter after each task (so the
gradients through the router and the experts) and the output after each task.
"""

from __future__ import annotations

import tiny_inputs as T
import torch

from mcit.core.registry import METHODS
from mcit.data.types import TaskSequence

TOL = T.TOLERANCE["moelora"]


def _set(m, key: str, value) -> None:
    """``layers.0.mlp.down_proj.lora_A.1`` (expert 1's A) / ``lora_B.1`` / ``lora_router`` into our stacks."""
    module, part = key.rsplit(".lora_", 1)
    a = m.adapters[module.replace(".", "__")]
    v = torch.tensor(value)
    with torch.no_grad():
        if part == "router":
            a["A"].router.copy_(v)
            return
        kind, i = part.split(".")
        w = a["A"].A if kind == "A" else a["B"].weight
        k = int(i) * (w.shape[0] if kind == "A" else w.shape[1]) // a["A"].experts
        if kind == "A":
            w[k: k + v.shape[0]] = v
        else:
            w[:, k: k + v.shape[1]] = v


def _get(m, key: str) -> torch.Tensor:
    module, part = key.rsplit(".lora_", 1)
    a = m.adapters[module.replace(".", "__")]
    if part == "router":
        return a["A"].router
    kind, i = part.split(".")
    w = a["A"].A if kind == "A" else a["B"].weight
    n = (w.shape[0] if kind == "A" else w.shape[1]) // a["A"].experts
    return w[int(i) * n: (int(i) + 1) * n] if kind == "A" else w[:, int(i) * n: (int(i) + 1) * n]


def test_moelora_routes_and_trains_as_coin():
    ref = T.official("moelora")["values"]
    lm = T.llama_lm()
    cls = METHODS.get("moelora")
    seq = TaskSequence.from_label_spaces(["a", "b"], [[], []])
    m = cls(cls.Params(r=ref["r"], alpha=ref["alpha"], experts=ref["experts"], dropout=0.0,
                             train_projector=False), T.LanguageModelHolder(lm),
            seq)
    assert len(m.adapters) * 5 == len(ref["init"])  # router + 2 experts' A and B on every linear layer of the LLM
    for key, value in ref["init"].items():
        _set(m, key, value)
    first_x = torch.tensor(ref["data"][0][0])
    for t, ((x, y), rec) in enumerate(zip(ref["data"], ref["tasks"])):
        x, y = torch.tensor(x), torch.tensor(y)
        m.set_task(t)
        m.before_task(t)
        with torch.no_grad():
            q0 = m.adapters["layers__0__self_attn__q_proj"]["A"]
            T.assert_close(torch.softmax(x @ q0.router.T, -1), rec["router_q0"], f"task {t}: router weights", TOL)
            T.assert_close(lm(inputs_embeds=x).last_hidden_state, rec["out_before"],
                           f"task {t}: output before training", TOL)
        opt = torch.optim.SGD(m.trainable_parameters(), lr=ref["lr"])
        for s, want in enumerate(rec["losses"]):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(lm(inputs_embeds=x).last_hidden_state, y)
            T.assert_close(loss, want, f"task {t} step {s}: loss", TOL)
            loss.backward()
            opt.step()
        for key, value in rec["trained"].items():
            T.assert_close(_get(m, key), value, f"task {t}: trained {key}", TOL)
        with torch.no_grad():
            T.assert_close(lm(inputs_embeds=first_x).last_hidden_state, rec["out_after"],
                           f"task {t}: output after training", TOL)
