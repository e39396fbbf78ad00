"""The data types every room shares: a task sequence and a batch.

They live below ``mcit.methods`` and ``mcit.models`` so that the data loaders and the backbones can
build batches without importing the method layer (docs/architecture.md, "Rooms").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        """Every tensor on ``device``; ``non_blocking`` from pinned memory on CUDA (the copy overlaps compute)."""
        allowed = None if self.allowed_classes is None else self.allowed_classes.to(device, non_blocking=non_blocking)
        return Batch(self.pixel_values.to(device, non_blocking=non_blocking),
                     self.labels.to(device, non_blocking=non_blocking),
                     self.valid.to(device, non_blocking=non_blocking),
                     self.task, self.keys, allowed,
                     {k: v.to(device, non_blocking=non_blocking) for k, v in self.inputs.items()}, self.meta)

    def pin_memory(self) -> "Batch":
        """Page-locked copies of every tensor (torch's DataLoader calls this with ``pin_memory=True``)."""
        allowed = None if self.allowed_classes is None else self.allowed_classes.pin_memory()
        return Batch(self.pixel_values.pin_memory(), self.labels.pin_memory(), self.valid.pin_memory(), self.task,
                     self.keys, allowed, {k: v.pin_memory() for k, v in self.inputs.items()}, self.meta)

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
