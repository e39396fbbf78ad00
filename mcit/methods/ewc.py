"""``ewc``: Elastic Weight Consolidation (Kirkpatrick et al., PNAS 2017) on sequential LoRA, as Continual-NExT runs it.

The official code (ECNU-SII/Continual-NExT bf813e4, an ms-swift fork; ``swift/trainers/trainers.py``:
``Seq2SeqTrainer.ewc_after_train`` / ``compute_ewc_loss``, ``swift/llm/train/sft.py``: ``SwiftSft.train``):

* **Fisher.** After each task, on the first ``EWC_limit`` samples of the task's training set (dataset order), in
  batches of ``per_device_train_batch_size`` with the model in training mode (LoRA dropout on): the gradient of
  each batch's loss (the mean cross-entropy over all answer tokens of the batch) with respect to every trainable
  parameter -- the LoRA A and B matrices -- is squared and summed over batches, then divided by the number of
  samples: ``F = sum_batches g^2 / N``.
* **Anchor.** The parameters at the end of the task (``optpar``).
* **Over tasks.** Task t loads only task t-1's Fisher and anchor (``EWC_path``: the previous output directory) and
  each task writes a fresh Fisher: nothing accumulates, the penalty protects the previous task's solution.
* **Penalty.** ``EWC_lambda * sum_params sum(F * (p - anchor)^2)`` (a sum over every entry, no mean) added to every
  step's loss; none in the first task.

Defaults are the official scripts' (``scripts/train/*_ewc.sh``: ``--EWC_lambda 0.5 --EWC_limit 200
--per_device_train_batch_size 4 --lora_rank 64``) and ms-swift's LoRA defaults (alpha 32, dropout 0.05,
all-linear; the projector frozen: ``freeze_aligner``).

Here the Fisher is the pipeline's statistics stage: ``statistics`` streams on every rank (with gradients of the
method's own parameters enabled inside the stage's ``no_grad``), the squared-gradient sums and the sample count are
summed over ranks, ``finalize_statistics`` divides and stores Fisher and anchor as buffers next to each parameter
(``ewc_fisher_<name>`` / ``ewc_anchor_<name>`` on the module that owns it), so they are checkpointed, broadcast and
resumed with the method. The penalty of each module's parameters is computed in a forward hook of that module, while
ZeRO-3 has its parameters gathered (as O-LoRA computes its regulariser). Numbers against the official code:
tests/reference/test_ewc_reference.py.

Known fault of the official code: ``compute_ewc_loss`` computes the penalty from ``p.data``, so it is a constant of
the loss and contributes no gradient: the official EWC trains exactly like plain sequential LoRA (the logged loss
only grows by the penalty's value). Here the penalty is computed from the parameters themselves, so its gradient
``2 * lambda * F * (p - anchor)`` reaches them.

The sample cap ``fisher_limit`` counts the samples a rank streams: the pipeline streams every rank's part of the
split and does not tell a method the world size, so W ranks average the Fisher over up to W x ``fisher_limit``
samples (the official code: rank 0 alone, the first ``EWC_limit``). ``fisher_batch_size`` groups consecutive real
samples within each streamed batch (``eval.batch_size`` a multiple of it reproduces the official batches).
"""

from __future__ import annotations

import zlib
from typing import Any, Iterator, Optional

import torch
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.base import LossTerms
from mcit.methods.lora import Lora, SwiftLoRAParams


class EWCParams(SwiftLoRAParams):
    ewc_lambda: float = Field(0.5, ge=0, description="weight of the penalty (EWC_lambda)")
    fisher_limit: Optional[int] = Field(200, ge=1, description="samples per rank the Fisher averages (EWC_limit); "
                                                               "null: all")
    fisher_batch_size: int = Field(4, ge=1, description="samples per squared gradient (the official Fisher loop's "
                                                        "per_device_train_batch_size); 1: per-sample gradients")


@METHODS.register("ewc")
class EWC(Lora):
    name = "ewc"
    Params = EWCParams
    has_subspace_stage = True

    def __init__(self, params: EWCParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        self.register_buffer("fisher_task", torch.tensor(-1))  # the task whose Fisher is held (-1: none yet)
        self._terms: dict[int, torch.Tensor] = {}
        self._collecting = False  # inside statistics: the hooks stay quiet
        self._seen = 0  # samples this rank streamed in the current statistics stage
        for mod, names in self._owners():
            for n in names:
                p = getattr(mod, n)
                mod.register_buffer(f"ewc_fisher_{n}", torch.zeros(p.shape, dtype=torch.float32, device=p.device))
                mod.register_buffer(f"ewc_anchor_{n}", torch.zeros(p.shape, dtype=torch.float32, device=p.device))
            mod.register_forward_hook(self._penalty_hook(names))

    # -- the parameters and their slots -------------------------------------------------------------------------
    def _owners(self) -> Iterator[tuple[nn.Module, list[str]]]:
        """Each module that directly owns trainable parameters, with their local names (adapters' A and B, and the
        projector's layers where it trains)."""
        trainable = {id(p) for p in self.trainable_parameters()}
        for mod in self.modules():
            names = [n for n, p in mod.named_parameters(recurse=False) if id(p) in trainable]
            if names:
                yield mod, names

    def _slots(self) -> Iterator[tuple[str, nn.Module, str]]:
        """(full parameter name, owning module, local name) of every trainable parameter."""
        trainable = {id(p) for p in self.trainable_parameters()}
        for prefix, mod in self.named_modules():
            for n, p in mod.named_parameters(recurse=False):
                if id(p) in trainable:
                    yield (f"{prefix}.{n}" if prefix else n), mod, n

    @staticmethod
    def _module_penalty(mod: nn.Module, names: list[str]) -> torch.Tensor:
        """sum(F * (p - anchor)^2) over the module's trainable parameters, from the parameters themselves (the
        official ``p.data`` made the penalty a constant; see the module docstring)."""
        total = None
        for n in names:
            p = getattr(mod, n)
            f, a = getattr(mod, f"ewc_fisher_{n}"), getattr(mod, f"ewc_anchor_{n}")
            term = (f * (p - a).pow(2)).sum()
            total = term if total is None else total + term
        return total

    def _penalty_hook(self, names: list[str]):
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if torch.is_grad_enabled() and not self._collecting:
                self._terms[id(mod)] = self._module_penalty(mod, names)
        return hook

    # -- training ---------------------------------------------------------------------------------------------------
    def set_task(self, task: int) -> None:
        super().set_task(task)
        self._seen = 0
        self._terms = {}

    def penalty(self) -> torch.Tensor | None:
        """``sum F (p - anchor)^2`` over every trainable parameter, from the terms the modules' hooks computed in this
        forward (a module the forward did not call is computed here, which ZeRO-3 would not allow: there every trainable
        module runs in each forward); None without gradients (the training-interference loss is the task loss
        alone). Zero until a Fisher exists (the first task)."""
        terms, self._terms = self._terms, {}
        if not torch.is_grad_enabled():
            return None
        total = None
        for mod, names in self._owners():
            t = terms.get(id(mod))
            t = self._module_penalty(mod, names) if t is None else t
            total = t if total is None else total + t
        return total

    def loss(self, batch: Batch, outputs: dict[str, Any]) -> LossTerms:
        terms = super().loss(batch, outputs)
        pen = self.penalty()
        if pen is not None:
            terms["regularizer"] = self.params.ewc_lambda * pen
            terms.logs["ewc_penalty"] = float(pen.detach())
        return terms

    # -- the Fisher (the statistics stage) ------------------------------------------------------------------------
    def statistics(self, batch: Batch) -> dict[str, torch.Tensor] | None:
        """Squared gradients of the mean answer-token loss of each group of ``fisher_batch_size`` real samples,
        summed, and the number of samples; the stage runs under ``no_grad``, so gradients are enabled here for the
        method's own parameters (the backbone is frozen). In training mode, as the official loop (dropout on), with
        each group's dropout seeded by its sample keys."""
        p = self.params
        left = None if p.fisher_limit is None else p.fisher_limit - self._seen
        rows = torch.nonzero(batch.valid.detach().cpu() > 0).flatten()
        if left is not None:
            rows = rows[: max(left, 0)]
        if rows.numel() == 0:
            return None
        self._seen += rows.numel()
        slots = list(self._slots())
        params = [getattr(mod, n) for _, mod, n in slots]
        sums = [torch.zeros(q.shape, dtype=torch.float32, device=q.device) for q in params]
        was_training, self._collecting = self.training, True
        self.train()
        cuda = sorted({q.device.index or 0 for q in params if q.device.type == "cuda"})
        try:
            with torch.enable_grad(), torch.random.fork_rng(devices=cuda):
                for group in rows.split(p.fisher_batch_size):
                    sub = batch.select(group)
                    # the group's dropout draws depend on its samples alone (a resumed or re-split stage draws them
                    # again), and the caller's generators are left as they were
                    seed = zlib.crc32("|".join(sub.keys).encode())
                    torch.random.default_generator.manual_seed(seed)
                    for d in cuda:
                        torch.cuda.default_generators[d].manual_seed(seed)
                    e, m, lab, pos, _ = self._inputs(sub)
                    per_sample = self.backbone.lm_loss(e, m, lab, pos)
                    tokens = (lab[:, 1:] != -100).sum(1).to(per_sample.dtype)
                    loss = (per_sample * tokens).sum() / tokens.sum().clamp_min(1)  # the group's token mean
                    grads = torch.autograd.grad(loss, params, allow_unused=True)
                    for s, g in zip(sums, grads):
                        if g is not None:
                            s += g.detach().float().pow(2)
        finally:
            self.train(was_training)
            self._collecting = False
        out = {f"fisher:{name}": s for (name, _, _), s in zip(slots, sums)}
        out["samples"] = torch.tensor(float(rows.numel()))
        return out

    @torch.no_grad()
    def finalize_statistics(self, reduced: dict[str, torch.Tensor], task: int) -> None:
        """Fisher = the summed squared gradients / the samples; anchor = the parameters now (the end of ``task``).
        Both replace the previous task's, as the official code loads only the last task's files."""
        if task < 0:
            return
        n = float(reduced["samples"])
        for name, mod, local in self._slots():
            getattr(mod, f"ewc_fisher_{local}").copy_(reduced[f"fisher:{name}"] / n)
            getattr(mod, f"ewc_anchor_{local}").copy_(getattr(mod, local).detach())
        self.fisher_task.fill_(task)

    @torch.no_grad()
    def fisher(self) -> dict[str, torch.Tensor]:
        """The Fisher diagonal by full parameter name (for logs and tests)."""
        return {name: getattr(mod, f"ewc_fisher_{local}") for name, mod, local in self._slots()}

    @torch.no_grad()
    def anchor(self) -> dict[str, torch.Tensor]:
        """The anchor (the parameters at the end of ``fisher_task``) by full parameter name."""
        return {name: getattr(mod, f"ewc_anchor_{local}") for name, mod, local in self._slots()}

    def subspace_report(self) -> dict[str, Any]:
        values = list(self.fisher().values())
        return {"fisher_task": int(self.fisher_task), "fisher_max": float(max(v.max() for v in values)),
                "fisher_mean": float(sum(v.sum() for v in values) / max(sum(v.numel() for v in values), 1))}
