"""L2P against JH-LEE-KR/l2p-pytorch on the same tiny ViT, images and parameters (official/l2p.json)."""

from __future__ import annotations

import tiny_inputs as T
import torch


def test_l2p_matches_the_official_forward_loss_gradients_and_selection():
    ref = T.official("l2p")["values"]
    m = T.method("l2p", T.vit())
    b = T.batch(0)
    T.assert_close(m.backbone.cls_features(b.pixel_values), ref["cls_features"], "query")
    out = T.check_train_step(m, b, ref, ["prompt", "prompt_key", "head.weight", "head.bias"])
    assert out["idx"].tolist() == ref["train_idx"]
    T.assert_close(out["selected_sim"].mean(), ref["reduce_sim"], "reduce_sim")
    with torch.no_grad():
        o = m.prompted(b.pixel_values)
        assert o["idx"].tolist() == ref["eval_idx"]
        T.assert_close(o["logits"], ref["eval_logits"], "eval logits")
        m.params.batchwise_selection = True
        o = m.prompted(b.pixel_values)
        assert o["idx"].tolist() == ref["batchwise_idx"]
        T.assert_close(o["logits"], ref["batchwise_logits"], "batchwise eval logits")
