"""Everything a run reads, checked before any process group, model or run-directory file exists.

``preflight(cfg)`` returns a ``Plan``: the opened splits, the task sequence, the scorers, and every
frozen model the run loads (the backbone and a method's auxiliary backbones), each resolved through
the backbone zoo with its sha256. A problem is one line naming the file or key (ConfigError,
DataError, BackboneError, RunDirError).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mcit.core.config import ConfigError, RunConfig
from mcit.core.locations import absolute
from mcit.core.registry import METHODS
from mcit.core.rundir import RunDir, RunDirError
from mcit.data.loader import LoaderOptions
from mcit.data.shards import Split, carve, open_split, replay_buffer, replay_keys, union
from mcit.data.types import TaskSequence
from mcit.models.base import BackboneError, backbone_class, check_hf_dir
from mcit.run.ds_config import check_deepspeed_config
from mcit.run.plan import Plan, ResolvedBackbone


def resolve_backbone(kind: str, tag: str, path: str, cache_dir: str, tokenizer: str | None = None,
                     options: dict[str, Any] | None = None, hub: bool = False) -> ResolvedBackbone:
    """Resolve a checkpoint through the zoo (convert once, hash) and run the kind's pre-flight check. A path that
    does not exist is a hub id only with ``hub`` (``backbone.hub: true``): otherwise a typo would be taken for one
    and the run would start, make its directory and retry the network for minutes."""
    cls = backbone_class(kind)
    if cls.hub_ids and not Path(path).exists() and not hub:
        where = "" if Path(path).is_absolute() else f" (relative to {Path.cwd()})"
        raise BackboneError(f"backbone path not found: {path}{where}; a local checkpoint directory is expected "
                            f"(a model-hub id downloads only with backbone.hub: true)")
    if cls.hub_ids and not Path(path).exists():  # a hub id (backbone.hub: true): nothing to hash
        record = {"tag": tag, "format": "hub", "source": path, "sha256": None, "loaded_from": path}
        directory = path
    else:
        from mcit.models.zoo import resolve

        resolved, record = resolve(kind, tag, path, cache_dir, tokenizer)
        directory = str(resolved)
    cls.check(directory)
    return ResolvedBackbone(kind, directory, record, dict(options or {}))


def _resolve_auxiliary(cfg: RunConfig, method_cls: Any) -> dict[str, ResolvedBackbone]:
    out = {}
    for name, spec in method_cls.auxiliary_backbones(cfg.method.params()).items():
        try:
            out[name] = resolve_backbone(spec.kind, spec.tag, spec.path, cfg.backbone.cache_dir, spec.tokenizer,
                                         hub=cfg.backbone.hub)
        except BackboneError as e:
            raise ConfigError(f"{spec.key or 'method.' + name}: {e}") from None
    return out


def backbone_depth(backbone: ResolvedBackbone) -> int | None:
    """The number of blocks a prompted image encoder has, from its checkpoint's config.json (no weights
    read); None where that is not known here (hub ids, MLLMs, which have no block-indexed method keys)."""
    from mcit.models.base import PromptableImageEncoder

    path = Path(backbone.directory) / "config.json"
    if not issubclass(backbone_class(backbone.kind), PromptableImageEncoder) or not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    n = (cfg.get("vision_config") or cfg).get("num_hidden_layers")
    return int(n) if isinstance(n, int) else None


def preflight(cfg: RunConfig, base: Path | None = None, *, run_dir: Path | None = None) -> Plan:
    """Validate every input the run will read: DeepSpeed JSON, backbones, every shard, the run directory.

    With ``run_dir`` (evaluation of an existing run) the run directory is taken as given, not checked.
    """
    import inspect

    from mcit.data.transforms import BACKBONE, PRESETS

    base = base or Path.cwd()
    for key in ("train_transform", "eval_transform"):
        name = getattr(cfg.data, key)
        if name not in PRESETS:
            raise ConfigError(f"data.{key}: unknown preset {name!r} (have: {', '.join(PRESETS)})")
        takes = inspect.signature(backbone_class(cfg.backbone.kind).make_collate).parameters
        if name != BACKBONE and "transform" not in takes:
            raise ConfigError(f"data.{key}: backbone kind {cfg.backbone.kind} takes no augmentation preset (it "
                              f"preprocesses "
                              f"images itself): leave it at {BACKBONE}")
    check_deepspeed_config(cfg)
    bb = cfg.backbone
    generative = bb.task_type == "generation"
    options = {k: getattr(bb, k) for k in backbone_class(bb.kind).load_options}
    backbone = resolve_backbone(bb.kind, bb.tag, bb.path, bb.cache_dir, bb.tokenizer, options, hub=bb.hub)
    specs = cfg.data.resolved_tasks(base)
    train = [open_split(s.train, cfg.data.verify) for s in specs]
    test = [open_split(s.test, cfg.data.verify) for s in specs]
    for s, split in [(s, sp) for s, tr, te in zip(specs, train, test) for sp in (tr, te)]:
        is_instr = split.manifest.get("kind") == "instruction"
        if is_instr != generative:
            raise ConfigError(f"data.tasks: task {s.name!r}: {split.location} holds "
                              f"{'instruction' if is_instr else 'classification'} samples, but backbone.kind "
                              f"{bb.kind} needs {'instruction' if generative else 'classification'} data")
    scorers = None
    if generative:
        from mcit.core import caption_metrics as C
        from mcit.core import judge as J
        from mcit.core import scorers as S

        scorers = [s.scorer or te.manifest.get("scorer") or "exact_match" for s, te in zip(specs, test)]
        for s, name in zip(specs, scorers):
            if name not in S.SCORERS and name not in C.CORPUS and name not in J.JUDGED:
                raise ConfigError(f"data.tasks: task {s.name!r}: unknown scorer {name!r}; "
                                  f"known: {', '.join(sorted([*S.SCORERS, *C.CORPUS, *J.JUDGED]))}")
            if name in J.JUDGED:
                judge = cfg.eval.judge.path
                if not judge:
                    raise ConfigError(f"data.tasks: task {s.name!r}: scorer {name} asks a judge model to read the "
                                      f"answers; set eval.judge.path to a local causal-LM directory")
                try:
                    check_hf_dir(absolute(judge, base))
                except Exception as e:  # noqa: BLE001 - any unreadable judge directory is one line
                    raise ConfigError(f"eval.judge.path: {e}") from None
            if name in C.CORPUS and C.check():
                raise ConfigError(f"data.tasks: task {s.name!r}: scorer {name} cannot run here: {C.check()}")
    method_cls = METHODS.get(cfg.method.name)
    try:
        method_cls.check_inputs(cfg.method.params())
        cfg.method.params().check_against(backbone_depth(backbone), 1 if cfg.data.schedule == "joint" else len(specs))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    auxiliary = _resolve_auxiliary(cfg, method_cls)
    reference = None
    if method_cls.reference_required(cfg.method.params()):
        if cfg.data.reference is None:
            raise ConfigError(f"data.reference: method {cfg.method.name} needs a split of the backbone's pre-training "
                              f"data for its pre-trained subspace (set data.reference)")
        reference = open_split(absolute(cfg.data.reference, base), cfg.data.verify)
    for s, tr, te in zip(specs, train, test):
        extra = set(te.label_space) - set(tr.label_space)
        if extra:
            raise ConfigError(f"data.tasks: task {s.name!r}: test labels {sorted(extra)} do not occur in its train "
                              f"split")
    names = stage_names = [s.name for s in specs]
    class_names = {int(k): v for tr in train for k, v in (tr.manifest.get("class_names") or {}).items()}
    if cfg.data.validation:  # model selection: evaluate on a part of the training data, train on the rest
        train, test = map(list, zip(*(carve(tr, cfg.data.validation) for tr in train)))
    if scorers is not None:  # the evaluated split must hold what its scorer reads (m4c's ten answers, sizes, ...)
        from mcit.core import scorers as S

        for s, te, name in zip(specs, test, scorers):
            reason = S.unmet(name, te.manifest, s.name)
            if reason:
                raise ConfigError(f"data.tasks: task {s.name!r}: {te.location}: {reason}")
    replay: dict[str, list[str]] = {}
    if cfg.data.replay:
        train, replay = with_replay(train, names, cfg.data.replay, cfg.seed)
    if cfg.data.schedule == "joint":
        train, stage_names = [union(train, "joint(" + "+".join(names) + ")")], ["joint"]
    sequence = TaskSequence.from_label_spaces(stage_names, [tr.label_space for tr in train], class_names)
    run = RunDir(run_dir if run_dir is not None else cfg.resolved_run_dir())
    if run_dir is None:  # a training run: its directory must be new or hold this exact config
        run.check_belongs_to(cfg)
    plan = Plan(cfg, run, names, train, test, sequence, backbone, auxiliary, scorers, reference, stage_names)
    plan.preprocessing, plan.normalization = image_pipeline(cfg, backbone)
    plan.auxiliary_preprocessing = auxiliary_preprocessing(auxiliary)
    plan.loader = LoaderOptions.from_config(cfg.data)
    plan.replay = replay
    check_same_backbones(plan)
    return plan


def with_replay(train: list[Split], names: list[str], n: int, seed: int) -> tuple[list[Split], dict[str, list[str]]]:
    """Each task's training split with the replay buffers of the tasks before it (``data.replay`` samples of each,
    ``replay_keys``), and the buffers' keys by task. The union keeps the task's own label space: the old samples'
    labels are classes the model already has."""
    from dataclasses import replace

    keys = {name: replay_keys(tr, n, seed) for name, tr in zip(names[:-1], train[:-1])}
    buffers = [replay_buffer(tr, keys[name], f"replay of {name}") for name, tr in zip(names[:-1], train[:-1])]
    out = [train[0]]
    for t in range(1, len(train)):
        u = union([train[t], *buffers[:t]], f"{train[t].location} + replay of {', '.join(names[:t])}")
        out.append(replace(u, manifest={**u.manifest, "label_space": train[t].manifest["label_space"]}))
    return out, keys


def image_pipeline(cfg: RunConfig, backbone: ResolvedBackbone) -> tuple[Any, Any]:
    """(the backbone's own inference pipeline, the mean / std the run normalises with) for an image encoder;
    (None, None) for a backbone that preprocesses by itself. The train and eval presets must agree on the
    normalisation: the frozen backbone sees one input distribution."""
    from mcit.data.transforms import normalization
    from mcit.models.zoo import preprocessing_of

    pre = preprocessing_of(backbone.kind, str(backbone.record.get("tag")), backbone.directory)
    if pre is None:
        return None, None
    if cfg.data.normalization == "backbone":  # the named departure: the presets' geometry, the backbone's mean / std
        return pre, (tuple(pre.mean), tuple(pre.std))
    train = normalization(cfg.data.train_transform, pre)
    evaluate = normalization(cfg.data.eval_transform, pre)
    if train != evaluate:
        raise ConfigError(f"data.eval_transform: preset {cfg.data.eval_transform!r} normalises with mean/std "
                          f"{evaluate}, but data.train_transform {cfg.data.train_transform!r} with {train}: the "
                          f"backbone must see one normalisation")
    return pre, train


def auxiliary_preprocessing(auxiliary: dict[str, ResolvedBackbone]) -> dict[str, Any]:
    """Each auxiliary image encoder's own inference pipeline (a method phase that streams it: ``ImagePipeline``)."""
    from mcit.models.zoo import preprocessing_of

    out = {}
    for name, aux in auxiliary.items():
        pre = preprocessing_of(aux.kind, str(aux.record.get("tag")), aux.directory)
        if pre is not None:
            out[name] = pre
    return out


def check_same_backbones(plan: Plan) -> None:
    """A run directory continues only on the checkpoints it started with (backbone.json's sha256s)."""
    path = plan.run.backbone
    if not path.is_file():
        return
    started = json.loads(path.read_text())
    pairs = [("backbone", plan.cfg.backbone.path, started, plan.backbone.record)]
    specs = METHODS.get(plan.cfg.method.name).auxiliary_backbones(plan.cfg.method.params())
    pairs += [(specs[name].key or f"method.{name}", aux.record.get("source"),
               (started.get("auxiliary") or {}).get(name) or {}, aux.record) for name, aux in plan.auxiliary.items()]
    for key, source, old, new in pairs:
        if old.get("sha256") and new.get("sha256") and old["sha256"] != new["sha256"]:
            raise RunDirError(f"{key} checkpoint {source} is not the one run {plan.run.root} started with (sha256 "
                              f"{old['sha256']} in {path}, now {new['sha256']})")
