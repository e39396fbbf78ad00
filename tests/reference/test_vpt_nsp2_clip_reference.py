"""VPT-NSP² on CLIP against zugexiaodui/VPTinNSforCL's CLIP runs on the same tiny CLIP image encoder, images,
prompts and text features (official/vpt_nsp2_clip.json): null spaces and projections, task 1's image-text
logits with the trainable logit scale, the loss, the gradients of the prompts and the scale, the projected
update."""

from __future__ import annotations

import torch

import tiny_inputs as T
from mcit.data.types import Batch


def test_vpt_nsp2_clip_matches_the_official_projection_logits_and_gradients():
    ref = T.official("vpt_nsp2_clip")["values"]
    m = T.method("vpt_nsp2", T.clip(), layers=[0, 1, 2, 3], temperature=1.0, eta1=0.98, eta2=0.98,
                 refine_head=False)
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
    T.assert_close(out["logits"][:, 3:], ref["train_logits_task1"], "task 1 image-text logits")
    terms = m.loss(b, out)
    T.assert_close(terms.per_sample.mean(), ref["ce"], "cross-entropy")
    T.assert_close(terms.regularizer, ref["ln"], "L_LN")
    loss = T.train_loss(m, b)
    T.assert_close(loss, ref["loss"], "loss")
    loss.backward()
    g = T.grads(m)
    T.assert_close(g["prompt"], ref["grad.prompt"], "gradient of the prompts")
    T.assert_close(g["logit_scale"].reshape(()), ref["grad.logit_scale"], "gradient of the logit scale")
    T.assert_close(m.project_update("prompt", g["prompt"]), ref["projected_grad.prompt"], "projected update")
