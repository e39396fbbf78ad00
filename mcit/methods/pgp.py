"""PGP (Qiao et al., ICLR 2024, "Prompt Gradient Projection for Continual Learning") as a switch on
L2P and DualPrompt: ``l2p+pgp`` and ``dualprompt+pgp``.

After each task the subspace stage accumulates (summed over ranks) the uncentred covariance of
  * the query features (the frozen [CLS] feature, D) -- the space the prompt keys are matched in, and
  * the prompt-side features: for L2P's prompt tuning the embedded image tokens the prompts are
    inserted among (D); for DualPrompt's prefixes, per prompted block, the image tokens' per-head
    queries (head_dim), since a prefix key changes old attention scores only through q . dk,
and GPM's energy criterion (``mcit.core.subspace.energy_basis``: new directions until the old basis plus
them hold ``prompt_threshold`` / ``key_threshold`` of the task's energy) grows an orthonormal basis
U of each space. From the second task on every update of a prompt or key is confined to the
orthogonal complement, dP <- dP - dP U U^T (DualPrompt: the key half of each prefix, in its block's
basis), so old tasks' query-key matches and attention scores stay where they were. L2P's prompt keys
are projected in the query basis as in the official l2p-pgp engine; DualPrompt's E-prompt keys are not
(the official dualprompt-pgp engine projects only the prefixes' key halves, so every task can still
learn its own key); ``project_e_key: true`` projects them too.

Differences from JingyangQiao/prompt-gradient-projection, and why: that code projects the raw
gradient before Adam, which does not keep Adam's step in the complement (docs/architecture.md, "Known faults"), so the
update itself is projected here; and its prompt basis comes from a PCA of flattened sample
representations whose sample count (768) happens to equal ViT-B's width, so its "feature space" is
a sample space -- here the bases live in the spaces the paper's conditions are about. Its energy
criterion also differs from GPM's: ``memory.update_memory`` takes the SVD of R R^T and squares those
singular values (the fourth power of R's), and on the first task keeps only the directions whose
cumulative share stays strictly below the threshold; here GPM's criterion on the covariance's
eigenvalues (``energy_basis``). Given the same bases, the projection is the official one
(tests/reference/test_pgp_reference.py). Thresholds
default to the official 0.50 (prompt) and 0.97 (key).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.core.subspace import energy_basis, project_out
from mcit.data.types import Batch, TaskSequence
from mcit.methods.dualprompt import DualPrompt, DualPromptParams, task_prompt_ids
from mcit.methods.l2p import L2P, L2PParams
from mcit.methods.prompting import gather_prefix
from mcit.models.base import LayerPrompt


class PGPMixin:
    """Bases, statistics and update projection shared by both PGP variants."""

    has_subspace_stage = True
    projects_updates = True

    def _init_pgp(self, n_sets: int, set_dim: int, d: int) -> None:
        self.register_buffer("pgp_key_basis", torch.zeros(d, d))
        self.register_buffer("pgp_key_rank", torch.zeros((), dtype=torch.long))
        self.register_buffer("pgp_prompt_basis", torch.zeros(n_sets, set_dim, set_dim))
        self.register_buffer("pgp_prompt_rank", torch.zeros(n_sets, dtype=torch.long))
        self.pgp_log: dict = {}

    def key_basis(self) -> torch.Tensor:
        return self.pgp_key_basis[:, : int(self.pgp_key_rank)]

    def prompt_basis(self, i: int) -> torch.Tensor:
        return self.pgp_prompt_basis[i, :, : int(self.pgp_prompt_rank[i])]

    def finalize_statistics(self, reduced: dict[str, torch.Tensor], task: int) -> None:
        p = self.params
        new = energy_basis(reduced["key"], p.key_threshold, self.key_basis().double())
        r = int(self.pgp_key_rank)
        self.pgp_key_basis[:, r:r + new.shape[1]] = new.to(self.pgp_key_basis)
        self.pgp_key_rank.fill_(r + new.shape[1])
        for i in range(self.pgp_prompt_basis.shape[0]):
            new = energy_basis(reduced[f"prompt_{i}"], p.prompt_threshold, self.prompt_basis(i).double())
            r = int(self.pgp_prompt_rank[i])
            self.pgp_prompt_basis[i, :, r:r + new.shape[1]] = new.to(self.pgp_prompt_basis)
            self.pgp_prompt_rank[i] = r + new.shape[1]
        self.pgp_log = {"key_rank": int(self.pgp_key_rank), "prompt_ranks": self.pgp_prompt_rank.tolist()}

    def subspace_report(self) -> dict:
        return dict(self.pgp_log)


class L2PPGPParams(L2PParams):
    prompt_threshold: float = Field(0.50, gt=0, le=1, description="GPM energy threshold of the prompt-side "
                                                                  "bases (official 0.50)")
    key_threshold: float = Field(0.97, gt=0, le=1, description="GPM energy threshold of the query (key) "
                                                               "basis (official 0.97)")


@METHODS.register("l2p+pgp")
class L2PPGP(PGPMixin, L2P):
    name = "l2p+pgp"
    Params = L2PPGPParams

    def __init__(self, params: L2PPGPParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        d = backbone.hidden_size
        self._init_pgp(1, d, d)

    def statistics(self, batch: Batch) -> dict[str, torch.Tensor]:
        x = batch.pixel_values[batch.valid.bool()]
        q = self.backbone.cls_features(x).double()
        tokens = self.backbone.embed(x).double().reshape(-1, self.backbone.hidden_size)
        return {"key": q.t() @ q, "prompt_0": tokens.t() @ tokens}

    def project_update(self, name: str, delta: torch.Tensor) -> torch.Tensor | None:
        if name == "prompt_key" and int(self.pgp_key_rank):
            return project_out(delta, self.key_basis().to(delta))
        if name == "prompt" and int(self.pgp_prompt_rank[0]):
            return project_out(delta, self.prompt_basis(0).to(delta))
        return None


class DualPromptPGPParams(DualPromptParams):
    prompt_threshold: float = Field(0.50, gt=0, le=1, description="GPM energy threshold of the prompt-side "
                                                                  "bases (official 0.50)")
    key_threshold: float = Field(0.97, gt=0, le=1, description="GPM energy threshold of the query (key) "
                                                               "basis (official 0.97)")
    project_e_key: bool = Field(False, description="also confine E-prompt key updates (not in the official code)")


@METHODS.register("dualprompt+pgp")
class DualPromptPGP(PGPMixin, DualPrompt):
    name = "dualprompt+pgp"
    Params = DualPromptPGPParams

    def __init__(self, params: DualPromptPGPParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        g_layers = params.g_layers if params.g_prompt_length else []
        self.prompted = [*g_layers, *params.e_layers]  # basis i belongs to block prompted[i]
        self._init_pgp(len(self.prompted), backbone.head_dim, backbone.hidden_size)

    def statistics(self, batch: Batch) -> dict[str, torch.Tensor]:
        x = batch.pixel_values[batch.valid.bool()]
        q = self.backbone.cls_features(x).double()
        out = {"key": q.t() @ q}
        idx = task_prompt_ids(self.current_task, self.params.top_k, x.shape[0], x.device)
        prompts = self.layer_prompts(gather_prefix(self.e_prompt, idx), x.shape[0])
        for i, layer in enumerate(self.prompted):
            def capture(query: torch.Tensor, probs: torch.Tensor, i: int = i) -> None:
                rows = query.double().reshape(-1, query.shape[-1])
                out[f"prompt_{i}"] = rows.t() @ rows
            lp = prompts[layer]
            prompts[layer] = LayerPrompt(key=lp.key, value=lp.value, score_fn=lp.score_fn, capture=capture)
        self.backbone.encode(self.backbone.embed(x), prompts)
        return out

    def project_update(self, name: str, delta: torch.Tensor) -> torch.Tensor | None:
        if name == "e_key" and self.params.project_e_key and int(self.pgp_key_rank):
            return project_out(delta, self.key_basis().to(delta))
        if name not in ("e_prompt", "g_prompt"):
            return None
        layers = self.params.e_layers if name == "e_prompt" else self.params.g_layers
        out = delta.clone()
        for j, layer in enumerate(layers):
            i = self.prompted.index(layer)
            if int(self.pgp_prompt_rank[i]):
                out[j, 0] = project_out(delta[j, 0], self.prompt_basis(i).to(delta))  # key half only
        return out
