"""The method interface: the one seam between the pipeline and a continual-learning method.

A method owns its own parameters (prompts, keys, heads, ...) as an ``nn.Module``; the frozen backbone
is held by reference and is *not* a registered submodule, so DeepSpeed (which wraps the method) sees
and partitions only the trainable state, and ``state_dict()`` is the method's state alone.

A method never touches DeepSpeed, files or ranks. Its life cycle, driven by the pipeline::

    m = Method(params, backbone, sequence)      # build: allocate everything for the whole sequence
    m.load_state_dict(...)                      # when resuming
    m.before_task(t); train: m(batch) -> LossTerms (wrapped by DeepSpeed); m.after_task(t)
    subspace: m.statistics(batch) summed over ranks -> m.finalize_statistics(reduced)
    eval: m.predict(batch) -> class indices, one independent decision per sample

Everything a method needs later must live in its state_dict (parameters or buffers), because a
resumed run rebuilds the method and loads the last committed state.
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, Iterator

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn


class MethodParams(BaseModel):
    """Base of every method's hyper-parameters (the ``method:`` config section minus ``name``)."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class TaskInfo:
    name: str
    classes: tuple[int, ...]  # global class indices of this task


@dataclass(frozen=True)
class TaskSequence:
    """The ordered tasks and the global class space (original labels -> contiguous indices)."""

    tasks: tuple[TaskInfo, ...]
    labels: tuple[int, ...]  # original label of each global class index
    # Readable name of each global class index (from the shard manifests; the label as text where a
    # manifest names none): the text side of CLIP-based methods.
    class_names: tuple[str, ...] = ()

    @classmethod
    def from_label_spaces(cls, names: list[str], label_spaces: list[list[int]],
                          class_names: dict[int, str] | None = None) -> "TaskSequence":
        labels = sorted({int(c) for ls in label_spaces for c in ls})
        index = {lab: i for i, lab in enumerate(labels)}
        tasks = tuple(TaskInfo(n, tuple(index[int(c)] for c in ls)) for n, ls in zip(names, label_spaces))
        named = class_names or {}
        return cls(tasks, tuple(labels), tuple(str(named.get(lab, lab)) for lab in labels))

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def __len__(self) -> int:
        return len(self.tasks)

    def label_to_index(self) -> dict[int, int]:
        return {lab: i for i, lab in enumerate(self.labels)}


@dataclass
class Batch:
    """One batch. ``valid`` is 1 for real samples and 0 for padding (see mcit.data.loader).

    Classification: ``pixel_values`` + ``labels`` (global class indices). Instruction tasks also fill
    ``inputs`` (token tensors: ``input_ids``, ``attention_mask``, ...; ``labels`` is then the LM target
    with -100 outside the answer) and ``meta`` (per-sample references for the scorers).
    """

    pixel_values: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor
    task: int  # the task being trained; never available to predict()
    keys: list[str] = field(default_factory=list)
    # Evaluation only: the classes a prediction may take (the classes of the tasks trained so far, the
    # usual class-incremental protocol); the same for every sample, so it reveals no task identity.
    allowed_classes: torch.Tensor | None = None
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: list[dict] = field(default_factory=list)

    def to(self, device: torch.device) -> "Batch":
        allowed = None if self.allowed_classes is None else self.allowed_classes.to(device)
        return Batch(self.pixel_values.to(device), self.labels.to(device), self.valid.to(device), self.task,
                     self.keys, allowed, {k: v.to(device) for k, v in self.inputs.items()}, self.meta)

    def select(self, idx: torch.Tensor) -> "Batch":
        """The rows ``idx`` (every per-sample field)."""
        rows = idx.tolist()
        return Batch(self.pixel_values[idx], self.labels[idx], self.valid[idx], self.task,
                     [self.keys[i] for i in rows] if self.keys else [], self.allowed_classes,
                     {k: v[idx] for k, v in self.inputs.items()}, [self.meta[i] for i in rows] if self.meta else [])

    @staticmethod
    def concat(batches: list["Batch"]) -> "Batch":
        """Row-wise concatenation of batches with the same tensor shapes beyond dim 0."""
        b0 = batches[0]
        return Batch(torch.cat([b.pixel_values for b in batches]), torch.cat([b.labels for b in batches]),
                     torch.cat([b.valid for b in batches]), b0.task, [k for b in batches for k in b.keys],
                     b0.allowed_classes, {k: torch.cat([b.inputs[k] for b in batches]) for k in b0.inputs},
                     [m for b in batches for m in b.meta])

    def __len__(self) -> int:
        return int(self.valid.shape[0])


class LossTerms(dict):
    """What a training forward returns.

    ``per_sample``: (B,) losses; the engine weights them by ``valid`` and normalises by the global
    number of real samples. ``regularizer``: a scalar that does not depend on the batch size
    (orthogonality, L_LN, ...), added once per step. ``logs``: floats for the progress bar / JSONL.

    A dict (not a dataclass) on purpose: ZeRO-3 installs its re-gather-before-backward hooks only on
    tensors it finds inside tuples, lists and dicts of the module's output.
    """

    def __init__(self, per_sample: torch.Tensor, regularizer: torch.Tensor | None = None,
                 logs: dict[str, float] | None = None, task: torch.Tensor | None = None) -> None:
        super().__init__(per_sample=per_sample, regularizer=regularizer, logs=dict(logs or {}), task=task)

    @property
    def task(self) -> torch.Tensor | None:
        """The per-sample task loss alone (cross-entropy / LM loss), where ``per_sample`` adds a method's
        own per-sample terms (key pull, TII head): what the training-interference curve measures."""
        return self["task"]

    @property
    def per_sample(self) -> torch.Tensor:
        return self["per_sample"]

    @property
    def regularizer(self) -> torch.Tensor | None:
        return self["regularizer"]

    @property
    def logs(self) -> dict[str, float]:
        return self["logs"]


class Method(nn.Module):
    """Base class; subclasses register with ``@METHODS.register(name)`` and set ``Params``."""

    name: ClassVar[str] = "base"
    Params: ClassVar[type[MethodParams]] = MethodParams
    # Training phases per task, each a train stage and a subspace stage of its own, in this order
    # ("" = the one ordinary phase). STAR-Prompt has two: its CLIP stage, then its ViT stage.
    phases: ClassVar[tuple[str, ...]] = ("",)

    def __init__(self, params: MethodParams, backbone: nn.Module, sequence: TaskSequence) -> None:
        super().__init__()
        self.params = params
        self.sequence = sequence
        object.__setattr__(self, "backbone", backbone)  # by reference: not a submodule, not in state_dict
        self.current_task = 0
        self.phase = self.phases[0]

    # -- build / hooks -------------------------------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def param_groups(self) -> list[dict]:
        """Optimizer parameter groups over ``trainable_parameters()``: dicts with ``params`` and an
        optional ``lr_scale`` (times ``train.lr``), for methods whose papers train parts at other rates."""
        return [{"params": self.trainable_parameters()}]

    def before_task(self, task: int) -> None:
        self.current_task = task

    def after_task(self, task: int) -> None:
        pass

    def set_task(self, task: int) -> None:
        """Called whenever a stage of ``task`` runs (also after a resume)."""
        self.current_task = task

    def set_phase(self, phase: str) -> None:
        """Called before each train / subspace stage of a phase (see ``phases``): a multi-phase
        method switches what is trainable and what its forward and statistics compute."""
        self.phase = phase

    def phase_train(self, phase: str) -> dict:
        """Overrides of the ``train:`` config section for ``phase`` (epochs, lr, optimizer, ...)."""
        return {}

    @classmethod
    def check_inputs(cls, params: MethodParams) -> None:
        """Pre-flight check of files the method reads itself (before any model is loaded); raise a
        one-line ValueError naming the key and the path."""

    # -- training ----------------------------------------------------------------------------------
    def forward(self, batch: Batch) -> LossTerms:  # the training forward
        return self.loss(batch, self.train_outputs(batch))

    @abstractmethod
    def train_outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Everything ``loss`` needs (logits, selection similarities, ...), computed with gradients."""

    @abstractmethod
    def loss(self, batch: Batch, outputs: dict[str, torch.Tensor]) -> LossTerms:
        """Task loss plus the method's own terms, per sample where they are per sample."""

    def task_loss(self, batch: Batch) -> torch.Tensor:
        """Per-sample training loss of ``batch`` as data of task ``batch.task``, without an update: the
        pipeline measures it on the first task's data after every task (training interference)."""
        terms = self.loss(batch, self.train_outputs(batch))
        return terms.task if terms.task is not None else terms.per_sample

    def project_update(self, name: str, delta: torch.Tensor) -> torch.Tensor | None:
        """Confine the optimizer's update of parameter ``name`` to a subspace.

        ``delta`` is the full fp32 update the optimizer just applied (new - old). Return the update to
        keep instead, or None to keep it as it is. Projecting the update rather than the gradient keeps
        it in the subspace under Adam (see DESIGN.md's traps).
        """
        return None

    @property
    def projects_updates(self) -> bool:
        return type(self).project_update is not Method.project_update

    # -- subspace stage ----------------------------------------------------------------------------
    def statistics(self, batch: Batch) -> dict[str, torch.Tensor] | None:
        """Statistics of one batch; None = no subspace stage. Tensors are summed over batches and
        ranks, except keys starting with ``cat:``, whose rows are concatenated over batches and ranks
        (rank order) -- raw features for fits that are not additive, e.g. a mixture of Gaussians."""
        return None

    def finalize_statistics(self, reduced: dict[str, torch.Tensor], task: int) -> None:
        """Turn the rank-summed statistics of task ``task`` (-1: the reference set) into method state.
        Runs on rank 0 only; the pipeline broadcasts the resulting state_dict."""

    @classmethod
    def reference_required(cls, params: MethodParams) -> bool:
        """True when the method needs the statistics of ``data.reference`` (a sample of the backbone's
        pre-training data) before the first task, e.g. Fwd-Prompt's pre-trained subspace."""
        return False

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
        """Predicted global class index per sample; each row depends only on its own sample."""
