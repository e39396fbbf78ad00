"""``lora``: sequential LoRA of the frozen MLLM's language model (peft), an MCIT baseline.

peft's ``inject_adapter_in_model`` adds LoRA layers to the LLM's target projections in place; the
method registers the adapter matrices as its own submodules, so DeepSpeed trains, shards and
checkpoints exactly those (the backbone stays frozen and outside the engine). The LoRA layers are
injected once per backbone object; every build of the method puts *new* A/B modules into them
(initialised as peft does), so a rebuilt method (after each stage, or on resume) starts from the same
values, loads its saved state, and shares no parameter object, hook or ZeRO bookkeeping with the
DeepSpeed engine of an earlier task (re-using them made a later task read stale optimizer state).
``LoRAFamily`` is the base of every method built that way (LoRA, O-LoRA, MoELoRA): it injects the layers
(``lora_layers``) and installs the method's own A/B modules (``adapter_pair``) as its ``adapters``.
"""

from __future__ import annotations

import abc
import copy
import math
from typing import Optional, Union

import torch
from pydantic import Field
from torch import nn

from mcit.core.registry import METHODS
from mcit.data.types import TaskSequence
from mcit.methods.base import MethodParams
from mcit.methods.instruction import InstructionMethod

# A list of module names (peft's rule: a module matches when its name is the target or ends in ".target"),
# or "all-linear": every nn.Linear of the LLM but the output head (CoIN's find_all_linear_names).
Targets = Union[list[str], str]
_INJECTED = "_mcit_lora_targets"
_PRETRAINED_PROJECTOR = "_mcit_pretrained_projector"


def all_linear_names(lm: nn.Module) -> list[str]:
    """The last name component of every nn.Linear in ``lm`` except ``lm_head`` (as CoIN's
    ``find_all_linear_names``, which LoRA and MoELoRA there target)."""
    names = {n.split(".")[-1] for n, m in lm.named_modules() if isinstance(m, nn.Linear) and n}
    names.discard("lm_head")
    return sorted(names)


def lora_layers(lm: nn.Module, targets: Targets, r: int, alpha: float, method: str) -> dict[str, nn.Module]:
    """peft ``LoraLayer``s on ``lm``'s target modules, by module name, for a method to fill.

    Injected once per backbone object (a second request with other targets is an error: one backbone
    carries one method's adapters). Each call sets this build's scaling ``alpha / r``; the caller installs
    its own ``lora_A["default"]`` / ``lora_B["default"]`` modules, which peft's forward computes as
    ``result + lora_B(lora_A(dropout(x))) * scaling``. peft's dropout slot is the identity: a method's
    dropout lives in its own A module, so it follows the method's train / eval mode (the frozen backbone,
    which holds peft's slot, is never put in training mode)."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    spec = targets if isinstance(targets, str) else sorted(targets)
    done = getattr(lm, _INJECTED, None)
    if done is None and any(isinstance(m, LoraLayer) for m in lm.modules()):
        done = "(unknown)"
    if done is None:
        names = all_linear_names(lm) if targets == "all-linear" else spec
        if not names:
            raise ValueError(f"method.target_modules: the language model has no nn.Linear for {method} to adapt")
        cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=names, bias="none")
        try:
            inject_adapter_in_model(cfg, lm)
        except ValueError as e:
            raise ValueError(f"method.target_modules {targets} matched no module of the language model") from e
        object.__setattr__(lm, _INJECTED, spec)
    elif done != spec:
        raise ValueError(f"method {method}: this backbone already carries LoRA layers for target_modules {done}, "
                         f"not {spec}; build the method on a freshly loaded backbone")
    layers = {n: m for n, m in lm.named_modules() if isinstance(m, LoraLayer) and "default" in m.lora_A}
    if not layers:
        raise ValueError(f"method.target_modules {targets} matched no module of the language model")
    for m in layers.values():
        m.scaling["default"] = alpha / r
        m.lora_dropout["default"] = nn.Identity()
    return layers


def install(layers: dict[str, nn.Module], build) -> nn.ModuleDict:
    """Put ``build(layer, kw) -> (A, B)`` into each peft layer's ``lora_A`` / ``lora_B`` slot (``kw``: the
    layer's device, float32) and return them as the method's ``{name: {"A", "B"}}`` submodules, which
    DeepSpeed trains, shards and checkpoints."""
    adapters = nn.ModuleDict()
    for name, m in layers.items():
        a, b = build(m, {"device": m.get_base_layer().weight.device, "dtype": torch.float32})
        m.lora_A["default"], m.lora_B["default"] = a, b
        adapters[name.replace(".", "__")] = nn.ModuleDict({"A": a, "B": b})
    return adapters


class DropoutLinear(nn.Linear):
    """A bias-free LoRA A matrix that applies the method's dropout to its input first (state: ``weight``)."""

    def __init__(self, in_features: int, out_features: int, dropout: float, **kw) -> None:
        super().__init__(in_features, out_features, bias=False, **kw)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.dropout(x))


class TrainableProjector(nn.Module):
    """A method's float32 copy of the backbone's vision-to-LLM projector, put in its place: the optimizer steps
    float32 weights, and the features keep the backbone's dtype on both sides."""

    def __init__(self, pretrained: nn.Module) -> None:
        super().__init__()
        self.inner = copy.deepcopy(pretrained).float().requires_grad_(True)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # in its own weights' dtype: DeepSpeed's bf16 casts the method's weights to bf16
        return self.inner(x.to(next(self.inner.parameters()).dtype), *args, **kwargs).to(x.dtype)


def install_projector(backbone: nn.Module, train: bool, method: str) -> TrainableProjector | None:
    """Put a fresh trainable copy of the backbone's *pre-trained* projector in its place (each build: the method's
    saved state then loads over it), or, without ``train``, the pre-trained one back. The pre-trained module is
    kept on the backbone object (not as a submodule), so every method built on it starts from the same one."""
    if not hasattr(backbone, "projector"):
        if train:
            raise ValueError(f"method.train_projector: backbone {type(backbone).__name__} has no vision projector "
                             f"for {method}; set method.train_projector: false")
        return None
    pretrained = getattr(backbone, _PRETRAINED_PROJECTOR, None)
    if pretrained is None:
        pretrained = backbone.projector()
        object.__setattr__(backbone, _PRETRAINED_PROJECTOR, pretrained)
    proj = TrainableProjector(pretrained) if train else None
    backbone.set_projector(proj if proj is not None else pretrained)
    return proj


class LoRAFamilyParams(MethodParams):
    """What every LoRA-family method takes (LoRA's defaults; a method re-declares those it changes).

    ``train_projector`` / ``projector_lr``: the MCIT code bases train LLaVA's projector along with the adapters
    (LLaVA's ``initialize_vision_modules`` re-enables its gradients after peft froze it: "In case it is frozen by
    LoRA"); their scripts pass ``--mm_projector_lr 2e-5`` with ``--learning_rate 2e-4`` (CoIN's
    scripts/LLaVA/Train*/, MCITlib's LoRA-FT / OLoRA / MoELoRA scripts). MCITlib's trainer gives the projector
    that rate (its own parameter group); CoIN's ``create_optimizer`` (ETrain/Train/LLaVA/llava_trainer.py,
    zackschen/CoIN 4122465) ignores the flag and trains it at ``learning_rate``: ``projector_lr: null`` is that."""

    r: int = Field(8, ge=1, description="LoRA rank (peft's r)")
    alpha: float = Field(16.0, gt=0, description="the adapters' update is scaled by alpha / r (peft's lora_alpha)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (peft's lora_dropout)")
    target_modules: Targets = Field(default_factory=lambda: ["q_proj", "v_proj"],
                                    description="the LLM's modules to adapt: module names (peft's target_modules) "
                                                "or all-linear (every nn.Linear but lm_head)")
    train_projector: bool = Field(True, description="train a copy of the backbone's vision projector with the "
                                                    "adapters (at projector_lr); false: the pre-trained one, frozen")
    projector_lr: Optional[float] = Field(2e-5, gt=0, description="the projector's learning rate (null: train.lr)")


class LoRAFamily(InstructionMethod, abc.ABC):
    """The base of the LoRA-family methods: peft layers on the language model's target projections (scaling
    ``alpha / r``), each filled with the method's own A/B modules, which are the method's ``adapters``
    (``{layer name: {"A", "B"}}``: DeepSpeed trains, shards and checkpoints them; the backbone stays frozen)."""

    adapters: nn.ModuleDict

    def __init__(self, params: LoRAFamilyParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__(params, backbone, sequence)
        self._check_backbone()
        layers = lora_layers(backbone.language_model, params.target_modules, params.r, params.alpha, self.name)
        self.adapters = install(layers, self.adapter_pair)
        self.projector = install_projector(backbone, params.train_projector, self.name)

    @abc.abstractmethod
    def adapter_pair(self, layer: nn.Module, kw: dict) -> tuple[nn.Module, nn.Module]:
        """This method's (A, B) modules for one peft layer (``layer.in_features`` / ``out_features``; ``kw``:
        the layer's device and float32), initialised as the method's official code does."""

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.adapters.parameters()) + self.projector_parameters()

    def projector_parameters(self) -> list[nn.Parameter]:
        return list(self.projector.parameters()) if self.projector is not None else []

    def param_groups(self) -> list[dict]:
        """The adapters at ``train.lr``; the projector (where trained) at ``projector_lr``."""
        proj = set(map(id, self.projector_parameters()))
        groups = [{"params": [p for p in self.trainable_parameters() if id(p) not in proj]}]
        if proj:
            groups.append({"params": self.projector_parameters(), "lr": self.params.projector_lr})
        return groups


class SwiftLoRAParams(LoRAFamilyParams):
    """ms-swift's LoRA defaults, with which ECNU-SII/Continual-NExT's scripts run EWC and LwF on MLLMs: rank 64,
    alpha 32, dropout 0.05, every linear layer of the LLM, the aligner (projector) frozen."""

    r: int = Field(64, ge=1, description="LoRA rank (the scripts' --lora_rank 64)")
    alpha: float = Field(32.0, gt=0, description="scaling alpha / r (ms-swift's default: 32)")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the adapters' input (ms-swift's default: 0.05)")
    target_modules: Targets = Field("all-linear", description="the LLM's modules to adapt: all-linear (ms-swift's "
                                                              "default) or module names")
    train_projector: bool = Field(False, description="train the vision projector (aligner) too; false: frozen, as "
                                                     "ms-swift's freeze_aligner")


class LoraParams(LoRAFamilyParams):
    """LoRA's own: the family's defaults."""


@METHODS.register("lora")
class Lora(LoRAFamily):
    name = "lora"
    Params = LoraParams

    def adapter_pair(self, m: nn.Module, kw: dict) -> tuple[nn.Module, nn.Module]:
        p = self.params
        a = DropoutLinear(m.in_features, p.r, p.dropout, **kw)
        b = nn.Linear(p.r, m.out_features, bias=False, **kw)
        nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))  # peft's own initialisation
        nn.init.zeros_(b.weight)
        return a, b

    @torch.no_grad()
    def merged_delta_norm(self) -> float:
        """Frobenius norm of all B @ A (for logs and tests)."""
        return float(sum((m["B"].weight @ m["A"].weight).norm() ** 2 for m in self.adapters.values()) ** 0.5)
