"""VPT-NSP² against zugexiaodui/VPTinNSforCL on the same tiny ViT / CLIP image encoder, images and prompts
(official/vpt_nsp2.json, official/vpt_nsp2_clip.json): the null spaces and projections from task 0's
statistics, task 1's forward (linear heads on the ViT; image-text logits with the trainable logit scale on
CLIP), the loss with L_LN, the gradients and the projected update."""

from __future__ import annotations

import pytest
import tiny_inputs as T
import torch

from mcit.data.types import Batch

CASES = {  # official numbers -> (backbone, method params: the official CLIP runs' prompt blocks, temperature, eta)
    "vpt_nsp2": (T.vit, {}),
    "vpt_nsp2_clip": (T.clip, {"layers": [0, 1, 2, 3], "temperature": 1.0, "eta1": 0.98, "eta2": 0.98,
                               "refine_head": False}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_vpt_nsp2_matches_the_official_null_space_projection_loss_and_gradients(case):
    ref = T.official(case)["values"]
    backbone, params = CASES[case]
    m = T.method("vpt_nsp2", backbone(), **params)
    m.before_task(0)
    m.after_task(0)
    m.set_task(0)
    m.finalize_statistics(m.statistics(Batch(T.images(8), T.labels(0, 8), torch.ones(8), 0)), 0)
    assert m.null_dims == {"null_dims_qk": ref["null_dims_qk"], "null_dims_sp": ref["null_dims_sp"]}
    T.assert_close(m.proj1, ref["proj1"], "P1 (from Q_X W_k)")
    T.assert_close(m.proj2, ref["proj2"], "P2 (from S_P)")
    m.before_task(1)
    with torch.no_grad():
        m.prompt += 0.1 * torch.randn(m.prompt.shape, generator=torch.Generator().manual_seed(5))
    b = T.batch(1)
    out = m.train_outputs(b)
    T.assert_close(out["logits"][:, 3:], ref["train_logits_task1"], "task 1 logits")
    terms = m.loss(b, out)
    T.assert_close(terms.per_sample.mean(), ref["ce"], "cross-entropy")
    T.assert_close(terms.regularizer, ref["ln"], "L_LN")
    loss = T.train_loss(m, b)
    T.assert_close(loss, ref["loss"], "loss")
    loss.backward()
    g = T.grads(m)
    T.assert_close(g["prompt"], ref["grad.prompt"], "gradient of the prompts")
    T.assert_close(m.project_update("prompt", g["prompt"]), ref["projected_grad.prompt"], "projected update")
    if case == "vpt_nsp2":  # per-task heads: task 1's rows
        T.assert_close(g["head.weight"][3:], ref["grad.head.weight_task1"], "gradient of task 1's head")
        T.assert_close(g["head.bias"][3:], ref["grad.head.bias_task1"], "gradient of task 1's head bias")
    else:
        T.assert_close(g["logit_scale"].reshape(()), ref["grad.logit_scale"], "gradient of the logit scale")
