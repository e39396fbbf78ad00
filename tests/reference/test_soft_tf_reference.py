"""Soft-TransFormers (on DualPrompt) against ihaeyong/Soft-TF on the same tiny ViT, images, prompts and masks,
task 1 (official/soft_tf.json): the masked block's forward, the loss, and the gradients of every mask, prompt,
key and the head. The official bias mask is one tensor shared by all tasks (a documented fix here: one per task);
it was set to our task-1 bias masks, so its gradient is our task-1 row's."""

from __future__ import annotations

import tiny_inputs as T
import torch


def test_soft_tf_matches_the_official_masked_forward_loss_and_gradients():
    ref = T.official("soft_tf")["values"]
    m = T.method("soft_tf", T.vit(), pool_size=10)
    m.before_task(0)
    m.after_task(0)
    m.before_task(1)
    b = T.batch(1)
    T.check_train_step(m, b, ref, ["e_prompt", "g_prompt", "e_key", "head.weight"])
    g = T.grads(m)
    for role in ("q", "k", "v", "o", "fc1", "fc2"):
        T.assert_close(g[f"wmask_l4_{role}"], ref[f"grad.wmask_l4_{role}"], f"gradient of the {role} weight masks")
    T.assert_close(torch.cat([g[f"bmask_l4_{r}"][1] for r in "qkv"]), ref["grad.bmask_l4_qkv_task1"], "qkv bias masks")
    for role in ("o", "fc1", "fc2"):
        T.assert_close(g[f"bmask_l4_{role}"][1], ref[f"grad.bmask_l4_{role}_task1"], f"{role} bias mask")
        assert not g[f"bmask_l4_{role}"][0].any()  # task 0's masks get nothing while task 1 trains
