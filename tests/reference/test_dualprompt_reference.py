"""DualPrompt against JH-LEE-KR/dualprompt-pytorch on the same tiny ViT, images and parameters, task 1 after
the hand-over of task 0's E-prompt (official/dualprompt.json; the official side ran one sample per forward,
see ``mcit.methods.prompting.gather_prefix`` for why)."""

from __future__ import annotations

import tiny_inputs as T
import torch


def test_dualprompt_matches_the_official_forward_loss_gradients_and_selection():
    ref = T.official("dualprompt")["values"]
    m = T.method("dualprompt", T.vit(), pool_size=10)
    m.before_task(0)
    m.after_task(0)
    m.before_task(1)  # hands task 0's E-prompt to task 1
    b = T.batch(1)
    T.assert_close(m.backbone.cls_features(b.pixel_values), ref["cls_features"], "query")
    out = T.check_train_step(m, b, ref, ["g_prompt", "e_prompt", "e_key", "head.weight", "head.bias"])
    T.assert_close(out["selected_sim"].mean(), ref["reduce_sim"], "reduce_sim")
    with torch.no_grad():
        idx, _ = m.select(m.backbone.cls_features(b.pixel_values))
        assert idx.tolist() == ref["eval_idx"]
        T.assert_close(m.features(b.pixel_values, idx) @ m.head.weight.t() + m.head.bias, ref["eval_logits"],
                       "eval logits")
        m.params.batchwise_selection = True
        idx, _ = m.select(m.backbone.cls_features(b.pixel_values))
        assert idx.tolist() == ref["batchwise_idx"]
