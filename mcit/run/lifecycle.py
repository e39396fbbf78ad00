"""The one driver of a method's hooks: the frozen models, the method, and the calls in their order.

The order is written once, in ``mcit.methods.base.Method``'s docstring; ``MethodHost`` is the only
code that calls ``set_task``, ``set_phase``, ``before_task``, ``after_task`` and ``zero_shot``. The
pipeline's stages, ``mcit.run.evaluate_only`` and the benches all go through it, so an evaluation-only pass sees
a method in exactly the state the pipeline's own eval stage did. The work between the hooks is done
elsewhere: training steps by ``mcit.run.engine``, statistics by ``mcit.run.subspace_stage``, predictions by
``mcit.run.evaluation``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from mcit.core import distributed as dist
from mcit.core.registry import METHODS
from mcit.data.shards import Split
from mcit.methods.base import ImagePipeline, Method
from mcit.models.base import Backbone, load_backbone
from mcit.run.plan import Plan, ResolvedBackbone


def _load(resolved: ResolvedBackbone, dtype: torch.dtype) -> Backbone:
    model = load_backbone(resolved.kind, resolved.directory, dtype, **resolved.options)
    if resolved.options.get("quantization", "none") == "none":  # bitsandbytes places quantized weights itself
        model = model.to(dist.device())
    return model


class MethodHost:
    """Holds the run's frozen backbone(s) (loaded once per process) and its method."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.cfg = plan.cfg
        self.method_cls: type[Method] = METHODS.get(self.cfg.method.name)
        self.backbone: Backbone | None = None
        self.auxiliary: dict[str, Backbone] = {}
        self.method: Method | None = None

    # -- building ----------------------------------------------------------------------------------
    def load_models(self) -> None:
        """The backbone (``train.precision``) and the method's auxiliary backbones (float32, as before
        they were loaded through the zoo), on this rank's device."""
        dtype = torch.bfloat16 if self.cfg.train.precision == "bf16" else torch.float32
        self.backbone = _load(self.plan.backbone, dtype)
        if self.plan.normalization is not None:  # the presets' Normalize, not the checkpoint's own
            self.backbone.use_normalization(*self.plan.normalization)
        self.auxiliary = {name: _load(aux, torch.float32) for name, aux in self.plan.auxiliary.items()}
        for name, pre in self.plan.auxiliary_preprocessing.items():  # the mean / std its own pipeline ends with
            self.auxiliary[name].use_normalization(tuple(pre.mean), tuple(pre.std))

    def build(self) -> Method:
        """A freshly built method (the same initial prompts on every rank and every rebuild)."""
        if self.backbone is None:
            self.load_models()
        torch.manual_seed(self.cfg.seed)
        extra: dict[str, Any] = {"auxiliary": self.auxiliary} if self.auxiliary else {}
        self.method = self.method_cls(self.cfg.method.params(), self.backbone, self.plan.sequence, **extra)
        self.method.to(dist.device())
        return self.method

    def load(self, state: dict[str, torch.Tensor]) -> Method:
        """A freshly built method holding ``state`` (after a train stage, on resume, for evaluation)."""
        self.build()
        self.method.load_state_dict(state)
        self.method.to(dist.device())
        return self.method

    def collate(self, task: int, *, train: bool, split: Split | None = None, augment: bool | None = None,
                pipeline: ImagePipeline | None = None) -> Callable:
        """How raw samples of ``split`` (default task ``task``'s train or test split) become batches.

        ``augment`` (default: ``train``) picks ``data.train_transform`` over ``data.eval_transform``; the
        subspace and reference stages stream training data without it (VPT-NSP²'s official code collects its
        statistics with the eval transform, and statistics should not depend on the epoch's crops).
        ``pipeline`` (the method's ``image_pipeline`` for a stage) overrides ``augment`` where it sets it, and
        its ``auxiliary`` names a backbone whose own pipeline and normalisation make the batches instead.
        """
        from mcit.data import transforms

        own_split = split is None
        split = split or (self.plan.train[task] if train else self.plan.test[task])
        if pipeline is not None and pipeline.augment is not None:
            augment = pipeline.augment
        augment = train if augment is None else augment
        labels = self.plan.sequence.label_to_index()
        if own_split and self.cfg.data.schedule != "joint":  # a task's own split holds its classes only
            classes = set(self.plan.sequence.tasks[task].classes)
            labels = {label: i for label, i in labels.items() if i in classes}
        if pipeline is not None and pipeline.auxiliary is not None:
            steps = self.plan.auxiliary_preprocessing[pipeline.auxiliary].steps()
            return self.auxiliary[pipeline.auxiliary].make_collate(split, task, train=train, label_index=labels,
                                                                   transform=steps)
        data = self.cfg.data
        size = getattr(self.backbone, "image_size", 0)
        transform = transforms.build(data.train_transform if augment else data.eval_transform, train=augment, size=size,
                                     backbone=self.plan.preprocessing)
        extra = {"transform": transform} if transform.steps else {}  # a backbone without augmentation needs no argument
        return self.backbone.make_collate(split, task, train=train, label_index=labels,
                                          **extra)

    # -- the hooks -----------------------------------------------------------------------------------
    def enter(self, task: int, phase: str | None = None) -> Method:
        """The start of a stage of ``task`` (and of ``phase``, for train / subspace stages)."""
        self.method.set_task(task)
        if phase is not None:
            self.method.set_phase(phase)
        return self.method

    def enter_eval(self, task: int) -> Method:
        """The start of an evaluation after ``task``: the method in its last phase, as after training."""
        return self.enter(task, self.method_cls.phases[-1])

    def begin_train(self, task: int, phase: str) -> Method:
        """The start of a train stage (``set_task``, ``set_phase``, ``before_task``): the method to train."""
        self.enter(task, phase)
        self.method.before_task(task)
        return self.method

    def train(self, task: int, phase: str, run_steps: Callable[[Method], dict[str, torch.Tensor]]) -> None:
        """One train stage: ``run_steps(method)`` (the engine) returns the trained state, which a fresh
        method loads before ``after_task``. A method with nothing to train gets its hooks only."""
        self.begin_train(task, phase)
        if self.method.trainable_parameters():
            self.load(run_steps(self.method))
            self.enter(task, phase)
        self.method.after_task(task)

    def subspace(self, task: int, phase: str, stream: Callable[[Method], dict[str, Any]]) -> dict[str, Any] | None:
        """One subspace stage: ``stream(method)`` (``mcit.run.subspace_stage.stream_statistics``) only for a method
        that declares one; returns what it reports."""
        self.enter(task, phase)
        return stream(self.method) if self.method.has_subspace_stage else None

    @contextmanager
    def zero_shot(self) -> Iterator[Method]:
        """The method in its zero-shot state (the forward-transfer baseline)."""
        with self.method.zero_shot():
            yield self.method
