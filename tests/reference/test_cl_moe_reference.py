"""CL-MoE against the official code (official/cl_moe.json): MCITlib's copy of CLMoEMOELoraLinear (ECNU-ICALK/CL-MoE's
layer, the copy that imports) on every linear layer of a tiny Llama with 4 experts of rank 2 (r 8, alpha 16), router
and experts set to the same values on both sides; two tasks of three SGD steps each on mse(hidden states), the second
from the first's state; after each task one counting pass of the trained routers over the task's inputs, ECNU's
statistic.py on the counts (its top-8 set to 2 experts, and as released) and, after the second task, ECNU's params.py
(momentum 0.7, its key test as meant: as released it merges nothing, which the official run records).

Pinned: the instance router's softmax weights and the routed output of one layer, the losses, every trained parameter
after each task (so the gradients through router and experts), the per-expert top-2 counts summed over layers (the
task-level routing statistic), each task's experts, which experts the merge treats as the previous task's own and
with which coefficients, every expert after the merge (the router keeps its trained values) and the outputs.
"""

from __future__ import annotations

import tiny_inputs as T
import torch

from mcit.core.registry import METHODS
from mcit.data.types import TaskSequence
from mcit.methods.cl_moe import most_counted


def _slot(m, key: str) -> tuple[torch.Tensor, slice | None, str]:
    """``layers.0.mlp.down_proj.lora_A.1`` (expert 1's A) / ``lora_B.1`` / ``lora_router``: our tensor and the
    rows (A) or columns (B) that hold it."""
    module, part = key.rsplit(".lora_", 1)
    a = m.adapters[module.replace(".", "__")]
    if part == "router":
        return a["A"].router, None, "router"
    kind, i = part.split(".")
    k = a["A"].A.shape[0] // a["A"].experts
    return (a["A"].A if kind == "A" else a["B"].weight), slice(int(i) * k, (int(i) + 1) * k), kind


def _get(m, key: str) -> torch.Tensor:
    w, s, kind = _slot(m, key)
    return w if s is None else (w[s] if kind == "A" else w[:, s])


def _set(m, key: str, value) -> None:
    w, s, kind = _slot(m, key)
    with torch.no_grad():
        if s is None:
            w.copy_(torch.tensor(value))
        elif kind == "A":
            w[s] = torch.tensor(value)
        else:
            w[:, s] = torch.tensor(value)


def test_cl_moe_routes_trains_counts_and_merges_as_the_official_code():
    ref = T.official("cl_moe")["values"]
    lm = T.llama_lm()
    cls = METHODS.get("cl_moe")
    seq = TaskSequence.from_label_spaces(["recognition", "location"], [[], []])
    m = cls(cls.Params(r=ref["r"], alpha=ref["alpha"], experts=ref["experts"], dropout=0.0,
                       task_experts=ref["task_experts"], momentum=ref["momentum"], train_projector=False),
            T.LanguageModelHolder(lm), seq)
    assert len(m.adapters) * (1 + 2 * ref["experts"]) == len(ref["init"])  # router + every expert's A and B
    for key, value in ref["init"].items():
        _set(m, key, value)
    first_x = torch.tensor(ref["data"][0][0])
    q0 = lm.layers[0].self_attn.q_proj
    for t, ((x, y), rec) in enumerate(zip(ref["data"], ref["tasks"])):
        x, y = torch.tensor(x), torch.tensor(y)
        m.set_task(t)
        m.before_task(t)
        with torch.no_grad():
            router = m.adapters["layers__0__self_attn__q_proj"]["A"].router
            T.assert_close(torch.softmax(x @ router.T, -1), rec["router_q0"], f"task {t}: instance router weights")
            T.assert_close(q0(x), rec["routed_q0"], f"task {t}: routed output of layer 0's q_proj")
            T.assert_close(lm(inputs_embeds=x).last_hidden_state, rec["out_before"], f"task {t}: output before")
        opt = torch.optim.SGD(m.trainable_parameters(), lr=ref["lr"])
        for s, want in enumerate(rec["losses"]):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(lm(inputs_embeds=x).last_hidden_state, y)
            T.assert_close(loss, want, f"task {t} step {s}: loss")
            loss.backward()
            opt.step()
        for key, value in rec["trained"].items():
            T.assert_close(_get(m, key), value, f"task {t}: trained {key}")
        with torch.no_grad():
            T.assert_close(lm(inputs_embeds=first_x).last_hidden_state, rec["out_after"], f"task {t}: output after")
        # the task-level routing: top-2 counts of the trained routers over the task's tokens, summed over layers
        counts = m.count_experts(lambda x=x: lm(inputs_embeds=x))
        assert {str(i): int(c) for i, c in enumerate(counts) if c > 0} == rec["counts"], f"task {t}: expert counts"
        assert most_counted([int(c) for c in counts], 8) == rec["index_top8"], f"task {t}: statistic.py's top 8"
        m.finalize_statistics({"expert_counts": counts}, t)
        assert m.task_experts(t) == rec["index"], f"task {t}: the task's experts"
        if t == 0:
            for key, value in rec["trained"].items():  # no merge after the first task
                T.assert_close(_get(m, key), value, f"task 0: {key} after the statistics stage")
            continue
        # Dynamic Momentum MoE: the previous task's experts that this task does not use get 1 - momentum
        assert rec["released_merge_is_the_new_state"] and rec["fixed_merge_changes"] > 0
        assert [i for i in m.task_experts(0) if i not in m.task_experts(1)] == rec["exclusive"] != []
        lam = m.momentum_weights(1).tolist()
        want = [1 - ref["momentum"] if i in rec["exclusive"] else ref["momentum"] for i in range(ref["experts"])]
        assert lam == want, f"momentum coefficients {lam} != {want}"
        report = m.subspace_report()
        assert report["previous_experts"] == ref["tasks"][0]["index"] and report["task_experts"] == rec["index"]
        for key, value in rec["merged"].items():
            T.assert_close(_get(m, key), value, f"merged {key}")
            if key.endswith("router"):
                T.assert_close(_get(m, key), rec["trained"][key], f"merged {key}: the trained router")
        with torch.no_grad():
            T.assert_close(lm(inputs_embeds=first_x).last_hidden_state, rec["out_merged"], "output after the merge")
            T.assert_close(q0(x), rec["routed_q0_merged"], "routed output of layer 0's q_proj after the merge")
