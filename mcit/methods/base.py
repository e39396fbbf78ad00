"""The method interface: the one seam between the pipeline and a continual-learning method.

A method owns its own parameters (prompts, keys, heads, ...) as an ``nn.Module``; the frozen backbone
is held by reference and is *not* a registered submodule, so DeepSpeed (which wraps the method) sees
and partitions only the trainable state, and ``state_dict()`` is the method's state alone. A method
never touches DeepSpeed, files or ranks. Everything a method needs later must live in its state_dict
(parameters or buffers), because a resumed run rebuilds the method and loads the last committed state.
How to add one: docs/architecture.md, "Adding a method".
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Iterator, Mapping, get_args, get_origin

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict
from torch import nn

from mcit.data.types import Batch, TaskSequence

_LAYERS = "mcit:block-indices"


def _block_indices(v: list[int]) -> list[int]:
    if any(x < 0 for x in v):
        raise ValueError(f"block indices must be >= 0, got {v}")
    if len(set(v)) != len(v):
        raise ValueError(f"block indices repeat: {v}")
    return v


# Backbone block indices (prompted / masked layers). Checked once here (>= 0, no repeats) and against the
# backbone's depth by ``MethodParams.check_against`` -- in pre-flight from the checkpoint's config.json, and
# again when the method is built.
LayerList = Annotated[list[int], AfterValidator(_block_indices), _LAYERS]


def _is_layer_list(annotation: Any) -> bool:
    if get_origin(annotation) is Annotated and _LAYERS in annotation.__metadata__:
        return True
    return any(_is_layer_list(a) for a in get_args(annotation))


class MethodParams(BaseModel):
    """Base of every method's hyper-parameters (the ``method:`` config section minus ``name``).

    Checks of one parameter against another are model validators (they run when the config is loaded);
    checks against the backbone's depth or the number of tasks are ``check_against``, which pre-flight
    calls before any process group or model exists."""

    model_config = ConfigDict(extra="forbid")

    def check_against(self, num_layers: int | None, num_tasks: int) -> None:
        """Raise a one-line ValueError naming the key when a block index is past the backbone's
        ``num_layers`` (None: unknown, not checked) or the parameters do not fit ``num_tasks``."""
        if num_layers is not None:
            for name, field in type(self).model_fields.items():
                value = getattr(self, name)
                if value is None or not (_LAYERS in field.metadata or _is_layer_list(field.annotation)):
                    continue
                out = [x for x in value if x >= num_layers]
                if out:
                    raise ValueError(f"method.{name}: block {out[0]} is outside the backbone's {num_layers} blocks "
                                     f"(0..{num_layers - 1})")


class LossTerms(dict):
    """What a training forward returns.

    ``per_sample``: (B,) losses; the engine weights them by ``valid`` and normalises by the global
    number of real samples. ``tokens``: the answer-token cross-entropy of a language model as (B,) sums over
    each sample's answer tokens and (B,) token counts; with ``train.lm_loss_mean: token`` (the official LLaVA
    objective) the engine divides the sums by the answer tokens of the whole accumulation window on every rank,
    with ``sample`` each sample's mean joins the per-sample terms. ``regularizer``: a scalar that does not depend
    on the batch size (orthogonality, L_LN, ...), added once per step. ``logs``: floats for the progress bar /
    JSONL.

    A dict (not a dataclass) on purpose: ZeRO-3 installs its re-gather-before-backward hooks only on
    tensors it finds inside tuples, lists and dicts of the module's output.
    """

    def __init__(self, per_sample: torch.Tensor | None = None, regularizer: torch.Tensor | None = None,
                 logs: dict[str, float] | None = None, task: torch.Tensor | None = None,
                 tokens: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        if per_sample is None and tokens is None:
            raise ValueError("LossTerms needs per_sample or tokens")
        super().__init__(sample_terms=per_sample, regularizer=regularizer, logs=dict(logs or {}), task=task,
                         tokens=tokens)

    @property
    def task(self) -> torch.Tensor | None:
        """The per-sample task loss alone (cross-entropy / LM loss), where ``per_sample`` adds a method's
        own per-sample terms (key pull, TII head): what the training-interference curve measures. The token
        loss's per-sample means where the method gives one and names no other."""
        if self["task"] is None and self["tokens"] is not None:
            return self.token_means()
        return self["task"]

    @property
    def sample_terms(self) -> torch.Tensor | None:
        """The per-sample terms as the method gave them (without the token loss)."""
        return self["sample_terms"]

    @property
    def tokens(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self["tokens"]

    def token_means(self) -> torch.Tensor:
        """Each sample's mean answer-token cross-entropy (B,)."""
        sums, counts = self["tokens"]
        return sums / counts.clamp_min(1).to(sums.dtype)

    @property
    def per_sample(self) -> torch.Tensor:
        """Every per-sample term with the token loss as each sample's mean (the per-sample-mean objective)."""
        if self["tokens"] is None:
            return self["sample_terms"]
        means = self.token_means()
        return means if self["sample_terms"] is None else self["sample_terms"] + means

    @property
    def regularizer(self) -> torch.Tensor | None:
        return self["regularizer"]

    @property
    def logs(self) -> dict[str, float]:
        return self["logs"]


@dataclass(frozen=True)
class AuxiliaryBackbone:
    """A second frozen model a method needs besides the run's backbone (STAR-Prompt's CLIP). It is
    resolved through the backbone zoo like ``backbone:`` (tag, sha256 recorded in backbone.json) and
    loaded once per process; the method receives it as ``auxiliary[name]``."""

    kind: str  # a registered backbone kind
    path: str  # an HF directory, or an original checkpoint file for a zoo tag
    tag: str = "local"
    tokenizer: str | None = None  # CLIP from an OpenAI file: a directory with its tokenizer files
    key: str = ""  # the config key of ``path``, for messages (e.g. method.clip_path)


@dataclass(frozen=True)
class ImagePipeline:
    """The images one train or subspace stage of a phase sees (``Method.image_pipeline``).

    ``augment``: the run's ``data.train_transform`` (True) or ``data.eval_transform`` (False); None: the stage's
    own default (train: augmented; subspace: not). ``auxiliary``: the name of an auxiliary backbone whose own
    pipeline (its resize, crop, input size and mean / std; no augmentation) replaces the run's, so that a
    phase that trains or measures that model sees the pixels its official code feeds it (STAR-Prompt's CLIP
    stage: mammoth swaps both loaders to CLIP's preprocess)."""

    augment: bool | None = None
    auxiliary: str | None = None


class Method(nn.Module):
    """Base class; subclasses register with ``@METHODS.register(name)`` and set ``Params``.

    The life cycle. ``mcit.run.lifecycle.MethodHost`` is the only caller of these hooks (the pipeline's
    stages and ``pipelines/evaluate.py`` both go through it), in this order::

        build      torch.manual_seed(seed); m = Method(params, backbone, sequence[, auxiliary=...])
                   m.load_state_dict(state)                      when resuming or evaluating a checkpoint
        reference  only if reference_required(params): set_task(0); statistics(batch) over data.reference,
                   finalize_statistics(sums, -1) on rank 0, state broadcast to every rank
        zero-shot  with m.zero_shot(): predict(batch) / generate(batch, n)
        for each task t, for each phase p of ``phases``:
          train    set_task(t); set_phase(p); before_task(t)
                   each step: m(batch) -> LossTerms; backward; optimizer step; project_update(name, delta)
                   (only if ``projects_updates``)
                   the trained state goes into a freshly built method: load_state_dict(state); set_task(t);
                   set_phase(p); after_task(t)   [no trainable parameters: no steps, no rebuild]
          subspace set_task(t); set_phase(p); only if ``has_subspace_stage``: statistics(batch) on every
                   rank's part of task t's train split, summed over ranks, finalize_statistics(sums, t) on
                   rank 0, state broadcast; subspace_report() is logged
                   (each stage's images: ``image_pipeline(params, p, "train" | "subspace")``)
        eval       set_task(t); set_phase(phases[-1]); predict(batch) or generate(batch, n) per sample over
                   every task's test split; task_loss(batch) over task 0's test split
        commit     state_dict() saved (checkpoints/task_t/method.safetensors)

    ``set_task`` (and, for train, subspace and eval, ``set_phase``) start every stage, so a run resumed at
    any stage sees the same calls as one that never stopped.
    """

    name: ClassVar[str] = "base"
    Params: ClassVar[type[MethodParams]] = MethodParams
    # Training phases per task, each a train stage and a subspace stage of its own, in this order
    # ("" = the one ordinary phase). STAR-Prompt has two: its CLIP stage, then its ViT stage.
    phases: ClassVar[tuple[str, ...]] = ("",)
    # Declared, not detected: the subspace stage streams ``statistics`` only for methods that set this.
    has_subspace_stage: ClassVar[bool] = False
    # Declared: the engine snapshots the weights around each optimizer step only for methods that set this.
    projects_updates: ClassVar[bool] = False
    # Declared: the loss has an answer-token term (``LossTerms.tokens``), whose window total ``answer_tokens`` gives
    # the engine before the window's first backward (``train.lm_loss_mean: token``).
    token_loss: ClassVar[bool] = False

    def __init__(self, params: MethodParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__()
        self.params = params
        self.sequence = sequence
        object.__setattr__(self, "backbone", backbone)  # by reference: not a submodule, not in state_dict
        self.current_task = 0
        self.phase = self.phases[0]
        params.check_against(getattr(backbone, "num_layers", None), len(sequence))

    # -- build / hooks -------------------------------------------------------------------------------
    @classmethod
    def check_inputs(cls, params: MethodParams) -> None:
        """Pre-flight check of files the method reads itself (before any model is loaded); raise a
        one-line ValueError naming the key and the path."""

    @classmethod
    def auxiliary_backbones(cls, params: MethodParams) -> dict[str, AuxiliaryBackbone]:
        """Frozen models besides the run's backbone, by name; a method that declares any is built with
        ``auxiliary={name: loaded backbone}`` as a keyword argument."""
        return {}

    @classmethod
    def reference_required(cls, params: MethodParams) -> bool:
        """True when the method needs the statistics of ``data.reference`` (a sample of the backbone's
        pre-training data) before the first task, e.g. Fwd-Prompt's pre-trained subspace."""
        return False

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters the train stage hands to DeepSpeed (those with requires_grad)."""
        return [p for p in self.parameters() if p.requires_grad]

    def param_groups(self) -> list[dict]:
        """Optimizer parameter groups over ``trainable_parameters()``: dicts with ``params`` and an
        optional ``lr_scale`` (times ``train.lr``) or ``lr`` (absolute), for methods whose papers train parts at
        other rates."""
        return [{"params": self.trainable_parameters()}]

    def set_task(self, task: int) -> None:
        """The task the next stage is about; called at the start of every stage (also after a resume)."""
        self.current_task = task

    def set_phase(self, phase: str) -> None:
        """The phase (see ``phases``) of the next train / subspace stage: a multi-phase method switches
        what is trainable and what its forward and statistics compute."""
        self.phase = phase

    def phase_train(self, phase: str) -> dict:
        """Overrides of the ``train:`` config section for ``phase`` (epochs, lr, optimizer, ...)."""
        return {}

    @classmethod
    def image_pipeline(cls, params: MethodParams, phase: str, stage: str) -> ImagePipeline:
        """The images the ``stage`` ("train" or "subspace") of ``phase`` streams: the run's own by default."""
        return ImagePipeline()

    def before_task(self, task: int) -> None:
        """Just before task ``task``'s training steps (hand-over of prompts, freezing, ...)."""
        self.current_task = task

    def after_task(self, task: int) -> None:
        """After task ``task``'s training steps, on the trained state (momentum, bookkeeping, ...)."""

    # -- training ----------------------------------------------------------------------------------
    def forward(self, batch: Batch) -> LossTerms:
        """The training forward (what DeepSpeed's engine calls): ``loss(batch, train_outputs(batch))``."""
        return self.loss(batch, self.train_outputs(batch))

    @abstractmethod
    def train_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Everything ``loss`` needs (logits, selection similarities, ...), computed with gradients."""

    @abstractmethod
    def loss(self, batch: Batch, outputs: dict[str, torch.Tensor]) -> LossTerms:
        """Task loss plus the method's own terms, per sample where they are per sample."""

    def answer_tokens(self, batch: Batch) -> int:
        """The answer tokens of ``batch``'s real samples, for a method that declares ``token_loss`` (the engine's
        token-mean normaliser)."""
        raise TypeError(f"method {self.name} declares no token loss (token_loss is False): nothing to count")

    def task_loss(self, batch: Batch) -> torch.Tensor:
        """Per-sample training loss of ``batch`` as data of task ``batch.task``, without an update: the
        pipeline measures it on the first task's data after every task (training interference)."""
        terms = self.loss(batch, self.train_outputs(batch))
        return terms.task if terms.task is not None else terms.per_sample

    def project_update(self, name: str, delta: torch.Tensor) -> torch.Tensor | None:
        """Confine the optimizer's update of parameter ``name`` to a subspace (``projects_updates``).

        ``delta`` is the full fp32 update the optimizer just applied (new - old). Return the update to
        keep instead, or None to keep it as it is. Projecting the update rather than the gradient keeps
        it in the subspace under Adam (docs/architecture.md, "Known faults of the official code").
        """
        return None

    # -- subspace stage ----------------------------------------------------------------------------
    def statistics(self, batch: Batch) -> dict[str, torch.Tensor] | None:
        """Statistics of one batch (``has_subspace_stage``), or None to skip the batch. Tensors are summed
        over batches and ranks, except keys starting with ``cat:``, whose rows are concatenated over
        batches and ranks (rank order) -- raw features for fits that are not additive (mixtures)."""
        return None

    def finalize_statistics(self, reduced: dict[str, torch.Tensor], task: int) -> None:
        """Turn the rank-summed statistics of task ``task`` (-1: the reference set) into method state.
        Runs on rank 0 only; the resulting state_dict is broadcast to every rank."""

    def subspace_report(self) -> dict[str, Any]:
        """Numbers about the last subspace stage (ranks, replay losses) for the training log."""
        return {}

    # -- inference ---------------------------------------------------------------------------------
    @contextmanager
    def zero_shot(self) -> Iterator[None]:
        """The state the zero-shot row is evaluated in (the forward-transfer baseline). Default: the
        untrained method as built; MCIT methods override it to mean the pre-trained model alone."""
        yield

    @staticmethod
    def restrict(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Mask the logits of classes the evaluation protocol does not allow (see Batch)."""
        if batch.allowed_classes is None:
            return logits
        return logits.masked_fill(~batch.allowed_classes.to(logits.device), float("-inf"))

    @abstractmethod
    def predict(self, batch: Batch) -> torch.Tensor:
        """Predicted global class index per sample (classification); each row depends only on its sample."""

    def generate(self, batch: Batch, max_new_tokens: int) -> list[str]:
        """Generated answer per sample (instruction tasks); each answer depends only on its sample."""
        raise TypeError(f"method {self.name} predicts classes; it does not generate answers")


def auxiliary_of(auxiliary: Mapping[str, nn.Module] | None, name: str, method: str) -> nn.Module:
    """``auxiliary[name]``, or a one-line error saying the method was built without it."""
    if not auxiliary or name not in auxiliary:
        raise ValueError(f"method {method} needs its auxiliary backbone {name!r} (declared by auxiliary_backbones; "
                         f"the pipeline loads it, tests pass auxiliary={{{name!r}: ...}})")
    return auxiliary[name]
