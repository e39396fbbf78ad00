"""HiDe-LLaVA against the official code (official/hide_llava.json: MCITlib's HiDe/ copy of Ghy0501/HiDe-LLaVA, run on
the same fixed inputs): every linear layer of a tiny Llama (2 layers: the top one is layer 1) with one LoRA pair per
task (2 tasks, rank 2 each: r 4, alpha 8), every pair set to the same values on both sides, the anchors' random
start copied over, fixed CLIP features (image 6 wide, text 5) in place of the towers.

Pinned, for each task: the loss of each SGD step on mse(hidden states) (training uses the task's own pair in every
layer), every pair after the steps (the task's pair moved, the other untouched: the top layer's expansion), the
anchors after the task's features are folded in, the fused A and the fused LoRA delta of two layers below the top
(the task-general fusion after the task), a fused layer's output, and for three queries the routing weights over
both tasks, the top layer's routed output and the LLM's output.
"""

from __future__ import annotations

import types

import tiny_inputs as T
import torch

from mcit.core.registry import METHODS
from mcit.data.types import TaskSequence
from mcit.methods.hide_llava import instruction_text

TOL = T.TOLERANCE["hide_llava"]


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
    rows = ref["data"][0]
    # the anchors' sizes (the CLIP features come fixed: (steps, batch, size))
    clip = types.SimpleNamespace(projection_dim=len(rows["image"][0][0]), text_hidden_size=len(rows["text"][0][0]))
    cls = METHODS.get("hide_llava")
    seq = TaskSequence.from_label_spaces(["a", "b"], [[], []])
    m = cls(cls.Params(r=ref["r"], alpha=ref["alpha"], dropout=0.0, target_modules="all-linear", train_projector=False,
                       clip_path="unused"), T.LanguageModelHolder(lm), seq, auxiliary={"clip": clip})
    return m, lm


def test_hide_llava_expands_fuses_routes_and_trains_as_the_official_code():
    ref = T.official("hide_llava")["values"]
    m, lm = _build(ref)
    E = ref["experts"]
    assert len(m.adapters) == 2 * len(ref["targets"]) and m.top_layer == 1
    assert len(ref["init"]) == 2 * len(m.adapters) * E
    with torch.no_grad():
        for key, value in ref["init"].items():
            _slot(m, key).copy_(torch.tensor(value))
        start = ref["anchors_init"]
        m.image_anchors.copy_(torch.tensor(start["image_anchors"][:E]))
        m.text_anchors.copy_(torch.tensor(start["text_anchors"][:E]))
    assert torch.equal(m.anchor_count, torch.full((E,), start["boundary"]))
    z = torch.tensor(ref["z"])
    for t, (d, rec) in enumerate(zip(ref["data"], ref["tasks"])):
        m.set_task(t)
        m.before_task(t)
        m.train()
        # the expansion: task t trains its own pair in every layer, and nothing else
        mine = {id(p) for p in m.trainable_parameters()}
        assert mine == {id(_slot(m, k)) for k in ref["init"] if k.endswith(f".{t}")}
        assert sorted(rec["untouched"]) == sorted(k for k in ref["init"] if not k.endswith(f".{t}"))
        m.set_adapter_mode("train")
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
        # the anchors: the task's training features folded into the running means
        image, text = torch.tensor(d["image"]), torch.tensor(d["text"])
        m.finalize_statistics({"image": image.sum((0, 1)).double(), "text": text.sum((0, 1)).double(),
                               "count": torch.tensor(float(image.shape[0] * image.shape[1]))}, t)
        _close(m.image_anchors, rec["image_anchors"], f"task {t}: image anchors")
        _close(m.text_anchors, rec["text_anchors"], f"task {t}: text anchors")
        assert m.anchor_count.tolist() == rec["image_boundary"] == rec["text_boundary"]
        # inference after task t
        m.eval()
        with torch.no_grad():
            m.set_adapter_mode("infer", torch.full((1, E), 1.0 / E))  # (the fused layers read no weights)
            for name, want in rec["fused"].items():
                layer = lm.get_submodule(name)
                eye = torch.eye(layer.in_features)
                a = layer.lora_A["default"](eye)
                k = a.shape[1] // E
                _close(a[:, :k], want["A_T"], f"task {t}: fused A of {name}")
                for i in range(E):  # the fused A feeds B_0 .. B_t, nothing else
                    assert torch.equal(a[:, i * k:(i + 1) * k], a[:, :k] if i <= t else torch.zeros_like(a[:, :k]))
                delta = layer.lora_B["default"](a) * layer.scaling["default"]
                _close(delta, want["delta_T"], f"task {t}: fused LoRA delta of {name}")
            q0 = lm.layers[0].self_attn.q_proj
            _close(q0(z), rec["fused_q0"], f"task {t}: fused layer output")
            for j, (q, want) in enumerate(zip(ref["queries"], rec["queries"])):
                w = m.route(torch.tensor(q["image"]), torch.tensor(q["text"]))
                _close(w, want["weights"], f"task {t} query {j}: routing weights")
                m.set_adapter_mode("infer", w)
                _close(lm.layers[1].self_attn.q_proj(z), want["routed_q1"], f"task {t} query {j}: routed top layer")
                _close(lm(inputs_embeds=torch.tensor(q["x"])).last_hidden_state, want["out"],
                       f"task {t} query {j}: output")


def test_hide_llava_reads_the_instruction_the_official_code_hands_clip():
    """The official text: the decoded input without its first line, cut at the first " ASSISTANT" -- for LLaVA's
    "<image>\\n" + question layout, the first question without its placeholder."""
    texts = T.official("hide_llava")["values"]["texts"]
    questions = ["<image>\nWhat colour is the shape?", "<image>\nWhich option?\nA. one\nB. two"]
    assert [instruction_text(q) for q in questions] == texts["clip_texts"]
