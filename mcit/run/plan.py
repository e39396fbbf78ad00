"""What pre-flight hands to the run: the opened splits, the task sequence, the resolved frozen models.

Every later stage reads the run through a ``Plan``; nothing in it is loaded (no model, no process group):
``mcit/run/preflight.py`` builds and checks it, ``MethodHost`` loads what it names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcit.core.config import RunConfig
from mcit.core.rundir import RunDir
from mcit.data.loader import LoaderOptions
from mcit.data.shards import Split
from mcit.data.types import TaskSequence


@dataclass
class ResolvedBackbone:
    """A frozen model as the run will load it."""

    kind: str
    directory: str  # what ``from_path`` loads: a converted zoo checkpoint, the HF directory, or a hub id
    record: dict[str, Any]  # tag, format, source, sha256, loaded_from (mcit.models.zoo.resolve)
    options: dict[str, Any] = field(default_factory=dict)  # the backbone class's load_options


@dataclass
class Plan:
    """Everything checked before any process group or model exists."""

    cfg: RunConfig
    run: RunDir
    names: list[str]
    train: list[Split]
    test: list[Split]
    sequence: TaskSequence
    backbone: ResolvedBackbone
    auxiliary: dict[str, ResolvedBackbone] = field(default_factory=dict)  # the method's, by name
    scorers: list[str] | None = None  # instruction tasks: the scorer of each task
    reference: Split | None = None  # data.reference, when the method needs it
    stage_names: list[str] = field(default_factory=list)  # the training tasks: ``names``, or ["joint"]
    # image encoders: the backbone's own pipeline (mcit.data.transforms.BackbonePreprocessing) and the run's
    # (mean, std), which the presets decide; None for backbones that preprocess by themselves
    preprocessing: Any = None
    normalization: Any = None
    auxiliary_preprocessing: dict[str, Any] = field(default_factory=dict)  # the auxiliary encoders' own, by name
    loader: LoaderOptions = field(default_factory=LoaderOptions)  # data.num_workers & co., read once
    replay: dict[str, list[str]] = field(default_factory=dict)  # data.replay: each earlier task's buffer keys

    def __post_init__(self) -> None:
        self.stage_names = self.stage_names or list(self.names)

    @property
    def num_stages(self) -> int:
        """Training tasks (accuracy-matrix rows): one per task, or one for ``data.schedule: joint``."""
        return len(self.train) if self.train else len(self.stage_names)

    @property
    def run_dir(self) -> Path:
        return self.run.root

    def backbone_records(self) -> dict[str, Any]:
        """What backbone.json holds: the backbone's record, plus ``auxiliary`` records by name."""
        out = dict(self.backbone.record)
        if self.auxiliary:
            out["auxiliary"] = {name: aux.record for name, aux in self.auxiliary.items()}
        return out
