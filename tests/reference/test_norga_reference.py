"""NoRGa against Minhchuyentoancbn/MoE_PromptCL on the same tiny ViT, images, prompts and gate
(official/norga.json): the gated prefix scores in task 0's forward, the loss, the gradients of the prompt,
the gate's tau and alpha and the head, and inference with a given task's prompt."""

from __future__ import annotations

import tiny_inputs as T
import torch

from mcit.methods.prompting import gather_prefix


def test_norga_matches_the_official_gated_forward_loss_and_gradients():
    ref = T.official("norga")["values"]
    m = T.method("norga", T.vit(), reg=0.1, prompt_momentum=0.01)
    with torch.no_grad():
        m.gate_tau.copy_(1 + 0.3 * torch.randn(5, generator=torch.Generator().manual_seed(6)))
        m.gate_alpha.copy_(1 + 0.3 * torch.randn(5, generator=torch.Generator().manual_seed(7)))
    m.before_task(0)
    b = T.batch(0)
    T.check_wtp_step(m, b, ref, ["e_prompt", "gate_tau", "gate_alpha", "head.weight", "head.bias"])
    with torch.no_grad():
        prefix = gather_prefix(m.e_prompt, torch.ones(4, 1, dtype=torch.long))
        T.assert_close(m.head(m.prompted_features(b.pixel_values, prefix)), ref["eval_logits_prompt1"],
                       "eval logits with task 1's prompt")
