"""L2P against JH-LEE-KR/l2p-pytorch on the same tiny ViT, images and parameters (official/l2p.json)."""

from __future__ import annotations

import torch

import tiny_inputs as T


def test_l2p_matches_the_official_forward_loss_gradients_and_selection():
    ref = T.official("l2p")["values"]
    m = T.method("l2p", T.vit())
    b = T.batch(0)
    T.assert_close(m.backbone.cls_features(b.pixel_values), ref["cls_features"], "query")
    out = m.train_outputs(b)
    assert out["idx"].tolist() == ref["train_idx"]
    T.assert_close(out["logits"], ref["train_logits"], "train logits")
    T.assert_close(out["selected_sim"].mean(), ref["reduce_sim"], "reduce_sim")
    loss = T.train_loss(m, b)
    T.assert_close(loss, ref["loss"], "loss")
    loss.backward()
    g = T.grads(m)
    for name in ("prompt", "prompt_key", "head.weight", "head.bias"):
        T.assert_close(g[name], ref[f"grad.{name}"], f"gradient of {name}")
    with torch.no_grad():
        o = m.prompted(b.pixel_values)
        assert o["idx"].tolist() == ref["eval_idx"]
        T.assert_close(o["logits"], ref["eval_logits"], "eval logits")
        m.params.batchwise_selection = True
        o = m.prompted(b.pixel_values)
        assert o["idx"].tolist() == ref["batchwise_idx"]
        T.assert_close(o["logits"], ref["batchwise_logits"], "batchwise eval logits")
