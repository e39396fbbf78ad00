"""PGP (on L2P) against JingyangQiao/prompt-gradient-projection (official/pgp.json): task 1's loss with the
batchwise prompt set, the gradients, and the gradient projection of the prompts and keys with the same bases.

The bases themselves are built differently on purpose (mcit/methods/pgp.py: the official PCA works in a
sample space that only matches the feature space because ViT-B's width equals its sample count), so both
sides project with the bases our subspace stage found on task 0; this pins what is projected, in which
space and on which rows.
"""

from __future__ import annotations

import tiny_inputs as T
import torch

from mcit.data.types import Batch


def test_pgp_projects_the_gradients_as_the_official_engine():
    ref = T.official("pgp")["values"]
    m = T.method("l2p+pgp", T.vit(), batchwise_selection=True)
    m.set_task(0)
    m.finalize_statistics(m.statistics(Batch(T.images(8), T.labels(0, 8), torch.ones(8), 0)), 0)
    assert (int(m.pgp_key_rank), int(m.pgp_prompt_rank[0])) == (ref["key_rank"], ref["prompt_rank"])
    m.before_task(1)
    b = T.batch(1)
    out = m.train_outputs(b)
    assert out["idx"][0].tolist() == ref["prompt_idx"]
    loss = T.train_loss(m, b)
    T.assert_close(loss, ref["loss"], "loss")
    loss.backward()
    g = T.grads(m)
    for name in ("prompt", "prompt_key"):
        T.assert_close(g[name], ref[f"grad.{name}"], f"gradient of {name}")
        kept = m.project_update(name, g[name])  # None: the engine keeps the update as it is
        T.assert_close(g[name] if kept is None else kept, ref[f"projected.{name}"], f"projected gradient of {name}")
