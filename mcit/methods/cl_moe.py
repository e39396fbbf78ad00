"""``cl_moe``: CL-MoE (Huai et al., CVPR 2025), LoRA experts with momentum between tasks.

As the official code (ECNU-ICALK/CL-MoE, ``CLMoE/peft/tuners/clitmoelora.py``, ``statistic.py``, ``params.py``,
``scripts/CLMoE/Train_MOE/Train.sh``; MCITlib's copy, Ghy0501/MCITlib ``CL-MoE/``):

* every linear layer of the LLM gets ``experts`` LoRA experts of rank ``r / experts`` (A_i normal(0, 0.01),
  B_i zero) and an instance-level router (a bias-free linear layer) whose softmax weighs each token's expert
  outputs: ``y = W x + sum_i softmax(R x)_i B_i A_i dropout(x) alpha / r`` (the router reads ``x`` before the
  dropout). Router, experts (and LLaVA's projector, at ``projector_lr``) train on every task, each task starting
  from the previous task's (merged) state;
* the task-level routing: for each token of the task the instance router's top-2 experts are counted (a token
  whose top two weights tie counts for neither), summed over every adapted layer; the task's experts are the
  ``task_experts`` (statistic.py: 8) most counted;
* Dynamic Momentum MoE, after every task but the first (params.py): with the previous task's experts E_{t-1}
  and this task's E_t, each expert's A_i and B_i become ``lam theta_{t-1} + (1 - lam) phi_t`` (theta_{t-1}: the
  state the task started from, phi_t: the trained one), ``lam = 1 - momentum`` for the experts of E_{t-1} not in
  E_t and ``lam = momentum`` (0.7) for every other expert; the router and the projector keep the trained values.

Defaults are MCITlib's UCIT scripts (``scripts/CLMoE/Train_UCIT``: r 96 over 6 experts, alpha 2 r, lr 2e-4,
projector at 2e-5; Train_DCL: r 160 over 5 experts, lr 2e-5; the ECNU scripts: r 32 over 4), dropout 0.05 (the
LLaVA trainer's default), every linear layer of the LLM.

Departures, each a fault of the official code:

* params.py selects the expert tensors with ``name.startswith("loraA.{i}.")``, but the saved keys are full module
  paths (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.loraA.0.weight``): nothing matches and the
  released merge returns the new task's state unchanged (tests/reference/test_cl_moe_reference.py runs it both
  ways). Here the experts are merged as the code means to; ``momentum_merge: false`` is what the released code
  (and MCITlib's scripts, which never run statistic.py / params.py) effectively train.
* The counts are written by the training forward only while the wall clock's second is 30 (the ECNU copy does
  not even import ``datetime``; MCITlib's does), every position of the padded batch included, on each rank
  separately: not reproducible. Here they are counted once the task is trained (the subspace stage: the task's
  train split, real tokens only, summed over ranks), with the trained instance router.
* params.py merges experts 0..7 only (``range(8)``); here every expert (the same for ``experts <= 8``).

The instance router's test-time mix with a task-level router (the paper's beta) is a commented-out line with an
empty weight list in the released code; it is not here.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from pydantic import Field, model_validator
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import Batch, TaskSequence
from mcit.methods.lora import LoRAFamily, LoRAFamilyParams, Targets
from mcit.methods.moelora import RoutedExperts


class ClMoeParams(LoRAFamilyParams):
    r: int = Field(96, ge=1, description="the experts' total rank per layer; each expert has rank r / experts "
                                         "(MCITlib's UCIT scripts: 96)")
    alpha: float = Field(192.0, gt=0, description="scaling alpha / r of the routed experts' sum (the scripts: 2 r)")
    experts: int = Field(6, ge=2, description="LoRA experts per layer (the router's top-2 needs two)")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the experts' input; the router reads the input "
                                                         "before it (the LLaVA trainer's default: 0.05)")
    target_modules: Targets = Field("all-linear", description="the LLM's modules to adapt: all-linear (official "
                                                              "find_all_linear_names) or module names")
    momentum: float = Field(0.7, ge=0, le=1, description="params.py's alpha: the previous experts' share")
    task_experts: int = Field(8, ge=1, description="a task's experts: its most counted (statistic.py: 8)")
    momentum_merge: bool = Field(True, description="false: no momentum (as MCITlib's scripts run it)")

    @model_validator(mode="after")
    def _rank_splits(self) -> "ClMoeParams":
        if self.r % self.experts:
            raise ValueError(f"method: r ({self.r}) must divide evenly over experts ({self.experts})")
        return self


def top2_counts(gate: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """How often each expert is among a token's two largest router weights (``gate``: (..., E)); tokens whose
    two largest weights are equal count for neither (statistic.py drops their index -1), ``mask`` (gate's leading
    shape) keeps real tokens only."""
    vals, idx = gate.topk(2, dim=-1)
    keep = vals[..., 0] != vals[..., 1]
    if mask is not None:
        keep = keep & mask.to(torch.bool)
    return torch.bincount(idx[keep].reshape(-1), minlength=gate.shape[-1]).to(torch.float64)


def most_counted(counts: list[int], k: int) -> list[int]:
    """statistic.py's selection: the ``k`` experts with the largest counts, in that order, among those counted at
    least once (its ties keep the order of first appearance in the counts file; here the lower index first)."""
    order = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
    return [i for i in order if counts[i] > 0][:k]


class CountedExperts(RoutedExperts):
    """MoELoRA's routed experts (peft's ``lora_A`` slot), plus ``prev``, the experts as the task started
    (theta_{t-1}), and ``tally``: while the subspace stage counts, each forward adds its tokens' top-2 experts."""

    def __init__(self, in_features: int, r: int, experts: int, dropout: float, **kw) -> None:
        super().__init__(in_features, r, experts, dropout, **kw)
        self.register_buffer("prev", torch.zeros(r, in_features, **kw))
        self.tally: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None  # (counts, mask) while counting

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        gate = super().gate(x)
        if self.tally is not None:
            counts, mask = self.tally
            counts += top2_counts(gate.detach(), mask).to(counts.device)
        return gate


class _ExpertsB(nn.Linear):
    """peft's ``lora_B`` slot: the experts' B side by side (expert i: columns i*r/E .. (i+1)*r/E), B = 0."""

    def __init__(self, r: int, out_features: int, **kw) -> None:
        super().__init__(r, out_features, bias=False, **kw)
        nn.init.zeros_(self.weight)
        self.register_buffer("prev", torch.zeros(out_features, r, **kw))


@METHODS.register("cl_moe")
class ClMoe(LoRAFamily):
    """The experts' state as each task starts is kept in buffers (``prev``) so that the merge after training,
    in the subspace stage, and a run resumed anywhere in between, see theta_{t-1}; ``expert_counts`` holds every
    finished task's top-2 counts (integers: exact in any precision)."""

    name = "cl_moe"
    Params = ClMoeParams
    has_subspace_stage = True

    def __init__(self, params: ClMoeParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        self.register_buffer("expert_counts", torch.zeros(len(sequence), params.experts, dtype=torch.long))

    def adapter_pair(self, m: nn.Module, kw: dict) -> tuple[nn.Module, nn.Module]:
        p = self.params
        return CountedExperts(m.in_features, p.r, p.experts, p.dropout, **kw), _ExpertsB(p.r, m.out_features, **kw)

    @torch.no_grad()
    def before_task(self, task: int) -> None:
        """Keep the experts the task starts from (theta_{t-1}) for the momentum merge after it."""
        super().before_task(task)
        for m in self.adapters.values():
            m["A"].prev.copy_(m["A"].A)
            m["B"].prev.copy_(m["B"].weight)

    # -- the task-level routing: counting, the task's experts --------------------------------------------
    @contextmanager
    def counting(self, mask: Optional[torch.Tensor] = None) -> Iterator[torch.Tensor]:
        """Within the block every adapted layer adds its tokens' top-2 counts to the yielded (E,) float64 tensor
        (``mask``: which positions of the LLM's (B, L) sequence are real)."""
        mods = [m["A"] for m in self.adapters.values()]
        counts = torch.zeros(self.params.experts, dtype=torch.float64, device=mods[0].A.device)
        for a in mods:
            a.tally = (counts, mask)
        try:
            yield counts
        finally:
            for a in mods:
                a.tally = None

    def count_experts(self, forward: Callable[[], Any], mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The (E,) top-2 counts of one forward pass (``forward``), summed over every adapted layer."""
        with torch.no_grad(), self.counting(mask) as counts:
            forward()
        return counts.clone()

    def statistics(self, batch: Batch) -> dict[str, torch.Tensor] | None:
        """The task's top-2 counts over the batch's real tokens (with the trained router)."""
        if not self.params.momentum_merge:
            return None
        e, m, _, pos, _ = self._inputs(batch)
        return {"expert_counts": self.count_experts(lambda: self.backbone.logits(e, m, pos), m)}

    def task_experts(self, task: int) -> list[int]:
        """The experts of ``task`` (a finished one): its ``task_experts`` most counted."""
        return most_counted(self.expert_counts[task].tolist(), self.params.task_experts)

    # -- Dynamic Momentum MoE ----------------------------------------------------------------------------
    def finalize_statistics(self, reduced: dict[str, torch.Tensor], task: int) -> None:
        """Record the task's counts; after every task but the first, merge the experts by momentum."""
        self.expert_counts[task] = reduced["expert_counts"].round().long().to(self.expert_counts.device)
        if task > 0:
            self.merge_experts(task)

    def momentum_weights(self, task: int) -> torch.Tensor:
        """(E,) share of theta_{t-1} per expert: ``1 - momentum`` for the previous task's experts that ``task`` does
        not use, ``momentum`` for every other."""
        new = set(self.task_experts(task))
        lam = torch.full((self.params.experts,), self.params.momentum, dtype=torch.float64)
        for i in self.task_experts(task - 1):
            if i not in new:
                lam[i] = 1.0 - self.params.momentum
        return lam

    @torch.no_grad()
    def merge_experts(self, task: int) -> None:
        """theta_t = lam theta_{t-1} + (1 - lam) phi_t for every expert's A_i and B_i (the router stays phi_t)."""
        lam = self.momentum_weights(task)
        k = self.params.r // self.params.experts
        for m in self.adapters.values():
            a, b = m["A"], m["B"]
            rows = lam.to(a.A.device, torch.float32).repeat_interleave(k)  # A: expert i in rows i*k..(i+1)*k
            a.A.copy_(rows[:, None] * a.prev + (1 - rows[:, None]) * a.A)
            cols = rows.to(b.weight.device)  # B: the same experts in its columns
            b.weight.copy_(cols[None, :] * b.prev + (1 - cols[None, :]) * b.weight)

    def subspace_report(self) -> dict[str, Any]:
        """The task's counts and experts and, after a merge, each expert's share of theta_{t-1} (from the state
        alone, so every rank reports the same)."""
        t = self.current_task
        report: dict[str, Any] = {"expert_counts": [int(x) for x in self.expert_counts[t]],
                                  "task_experts": self.task_experts(t)}
        if t > 0 and self.params.momentum_merge:
            report.update(previous_experts=self.task_experts(t - 1),
                          previous_share=[round(float(x), 6) for x in self.momentum_weights(t)])
        return report
