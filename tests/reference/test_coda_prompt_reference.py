"""CODA-Prompt against GT-RIPL/CODA-Prompt on the same tiny ViT, images and components, task 1 (old components
detached, the new ones trained; official/coda_prompt.json)."""

from __future__ import annotations

import tiny_inputs as T
import torch


def test_coda_prompt_matches_the_official_forward_loss_and_gradients():
    ref = T.official("coda_prompt")["values"]
    m = T.method("coda_prompt", T.vit(), pool_size=10, ortho_mu=0.1)
    m.before_task(0)
    m.after_task(0)
    m.before_task(1)
    b = T.batch(1)
    T.assert_close(m.backbone.cls_features(b.pixel_values), ref["query"], "query")
    T.assert_close(m.ortho_penalty(1) * m.params.ortho_mu, ref["ortho"], "orthogonality penalty")
    T.check_train_step(m, b, ref, ["prompt", "key", "attn", "head.weight", "head.bias"])
    m.after_task(1)
    with torch.no_grad():
        T.assert_close(m.logits(b.pixel_values, None), ref["eval_logits"], "eval logits (all components)")
