"""General ability through lmms-eval: a committed checkpoint of any method answers lmms-eval's task definitions
(MME, MMBench, ... or a task over local files), so a run can say how much of the base model's general ability
survives the sequence (``mcit-evaluate --run R --lmms-eval TASKS [--zero-shot] [--task-checkpoint all]``).

The model lmms-eval talks to (``adapter``) is the run's own method on its own backbone, in the state of one
exported checkpoint (or the zero-shot state), answering as the pipeline's evaluation does: the question as one
user turn of the backbone's chat format, the image first (``<image>\\n`` + the task's text, as lmms-eval's LLaVA
models build it), batched greedy generation (``eval.batch_size``; answers do not depend on it), the task's
``max_new_tokens`` (else ``eval.max_new_tokens``) and its ``until`` stop strings. A task that samples, asks for
likelihoods or holds several images in one question is refused by name: the pipeline's methods generate
greedily from one image. With no checkpoint's task identity to hand (a general-ability question belongs to no task
of the sequence), the batch is labelled with the last trained task (0 for the zero-shot state); the pipeline's
evaluation never tells a method the task at test time either.

Results go to ``eval/general/<row>.json`` (lmms-eval's aggregated numbers per task and metric) and
``eval/general/<row>.samples.jsonl`` (each question's prediction and metrics); report.md gains a general-ability
table, zero-shot against after each task. lmms-eval is an optional extra (``pip install -e ".[lmms]"`` and
``pip install --no-deps lmms-eval==0.7.3``) and runs offline here: the hub is switched off before it is imported.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from mcit.core import distributed as dist
from mcit.core.checkpoint import atomic_write_text, write_json

LMMS_VERSION = "0.7.3"


class LmmsEvalError(RuntimeError):
    """lmms-eval is missing, or a task asks for what the adapter cannot do: one line for the user."""


def import_lmms() -> Any:
    """lmms-eval's modules, offline (the hub and dataset downloads off before ``datasets`` is imported)."""
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_EVALUATE_OFFLINE"):
        os.environ.setdefault(k, "1")
    try:
        import lmms_eval.api.model
        import lmms_eval.evaluator
        import lmms_eval.tasks
    except ImportError as e:
        raise LmmsEvalError(f"lmms-eval is not installed ({e}): pip install -e \".[lmms]\" && pip install --no-deps "
                            f"lmms-eval=={LMMS_VERSION}") from None
    import lmms_eval

    return lmms_eval


def sample_of(key: str, question: str, image: Any | None) -> dict[str, Any]:
    """A raw instruction sample (what a shard holds) for one lmms-eval question: the image as PNG bytes (lossless:
    the backbone sees the pixels lmms-eval gave), the question as a one-turn conversation. The answer turn is
    empty: evaluation reads the prompt up to it."""
    value = question if image is None or "<image>" in question else f"<image>\n{question}"
    rec: dict[str, Any] = {"conversations": [{"from": "human", "value": value}, {"from": "gpt", "value": ""}]}
    out: dict[str, Any] = {"__key__": key, "__url__": "lmms-eval"}
    if image is None:
        rec["text_only"] = True
    else:
        buf = io.BytesIO()
        image.convert("RGB").save(buf, format="PNG")
        out["png"] = buf.getvalue()
    out["json"] = json.dumps(rec).encode()
    return out


def make_adapter(host: Any, task_index: int, batch_size: int, max_new_tokens: int) -> Any:
    """An lmms-eval model (``lmms_eval.api.model.lmms``) answering with ``host``'s method as it stands."""
    import torch
    from lmms_eval.api.model import lmms

    backbone = host.backbone
    collate = backbone.make_collate(None, task_index, train=False, label_index={})

    class McitModel(lmms):
        """The pipeline's method behind lmms-eval's model interface (generation tasks)."""

        def __init__(self) -> None:
            super().__init__()
            self.accelerator = None  # lmms-eval attaches an Accelerator() to a model without one: not here

        def generate_until(self, requests: list[Any]) -> list[str]:
            todo = []
            for n, req in enumerate(requests):
                context, gen_kwargs, doc_to_visual, doc_id, task, split = req.args
                kwargs = dict(gen_kwargs or {})
                if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0) > 0:
                    raise LmmsEvalError(f"lmms-eval task {task!r} samples (do_sample / temperature > 0); the "
                                        f"pipeline's methods answer greedily")
                visuals = [v for v in (doc_to_visual(self.task_dict[task][split][doc_id]) or []) if v is not None]
                if len(visuals) > 1:
                    raise LmmsEvalError(f"lmms-eval task {task!r} doc {doc_id}: {len(visuals)} images in one "
                                        f"question; the pipeline's backbones take one")
                if visuals and not hasattr(visuals[0], "convert"):
                    raise LmmsEvalError(f"lmms-eval task {task!r} doc {doc_id}: a {type(visuals[0]).__name__} "
                                        f"visual (video / audio); the pipeline answers about images")
                until = kwargs.get("until") or []
                todo.append((n, sample_of(f"{task}/{split}/{doc_id}", str(context), visuals[0] if visuals else None),
                             int(kwargs.get("max_new_tokens") or max_new_tokens),
                             [until] if isinstance(until, str) else list(until)))
            out: list[str] = [""] * len(requests)
            # one batch per max_new_tokens value; within it, answers do not depend on the batching
            for tokens in sorted({t for _, _, t, _ in todo}):
                group = [x for x in todo if x[2] == tokens]
                for i in range(0, len(group), batch_size):
                    part = group[i:i + batch_size]
                    with torch.no_grad():
                        batch = collate([s for _, s, _, _ in part]).to(dist.device())
                        preds = host.method.generate(batch, tokens)
                    for (n, _, _, stops), pred in zip(part, preds):
                        for stop in stops:
                            if stop:
                                pred = pred.split(stop)[0]
                        out[n] = pred
            return out

        def loglikelihood(self, requests: list[Any]) -> list[Any]:
            task = requests[0].args[4] if requests else "?"
            raise LmmsEvalError(f"lmms-eval task {task!r} scores likelihoods (loglikelihood / multiple_choice); the "
                                f"adapter answers generation tasks (output_type: generate_until)")

        def generate_until_multi_round(self, requests: list[Any]) -> list[str]:
            task = requests[0].args[5] if requests else "?"
            raise LmmsEvalError(f"lmms-eval task {task!r} is multi-round; the adapter answers single questions")

        def clean(self) -> None:  # lmms-eval's clean() deletes the model's modules: the host still needs them
            return None

    return McitModel()


def task_manager(include: list[Path], tasks: list[str]) -> Any:
    """lmms-eval's task index: the tasks under ``include`` (YAML task files), or its own tasks without one;
    every name in ``tasks`` must be there (checked before any model is loaded)."""
    from lmms_eval.tasks import TaskManager

    for p in include:
        if not p.is_dir():
            raise LmmsEvalError(f"--lmms-include: {p} is not a directory of lmms-eval task files")
    if include:
        manager = TaskManager("WARNING", include_path=[str(p) for p in include], include_defaults=False)
    else:
        manager = TaskManager("WARNING")
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = ", ".join(str(p) for p in include) or "lmms-eval's own tasks"
        raise LmmsEvalError(f"--lmms-eval: unknown task {unknown[0]!r} (not in {where}: {len(manager.all_tasks)} "
                            f"tasks there)")
    return manager


def load_tasks(manager: Any, tasks: list[str]) -> dict[str, Any]:
    """Each task as lmms-eval builds it (its dataset loaded: offline, from the machine's files or the datasets
    cache), one at a time and before any model: a dataset that is not here stops in one line naming the task and
    the dataset, not in ``RetryError[... ConnectionError]`` after the model has loaded. A leaf task maps to its
    ``Task``, a group to its dict of subtasks."""
    from lmms_eval.tasks import get_task_dict

    out: dict[str, Any] = {}
    for name in tasks:
        try:
            built = get_task_dict([name], manager)
        except Exception as e:  # noqa: BLE001 - datasets raises many kinds here; the user needs the one line
            try:
                where = manager._get_config(name).get("dataset_path")
            except Exception:  # noqa: BLE001 - the name is known (task_manager checked it); its path is a nicety
                where = None
            while getattr(e, "last_attempt", None) is not None and e.last_attempt.exception() is not None:
                e = e.last_attempt.exception()  # tenacity's RetryError around the real cause
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise LmmsEvalError(f"lmms-eval task {name!r}: its dataset {where or '?'} could not be loaded on this "
                                f"machine ({type(e).__name__}: {first}); the hub is off here: give the task a local "
                                f"dataset_path / dataset_kwargs.data_files (README: a local lmms-eval task)") from None
        out[name] = built.get(name, built)
    return out


def _leaves(obj: Any) -> dict[str, Any]:
    """The leaf tasks under a loaded task or group, by name."""
    from lmms_eval.api.task import Task

    if isinstance(obj, Task):
        return {obj.task_name if hasattr(obj, "task_name") else obj.config.task: obj}
    if isinstance(obj, tuple):
        return _leaves(obj[1]) if obj[1] is not None else {}
    out: dict[str, Any] = {}
    for key, value in (obj or {}).items():
        if isinstance(value, Task):
            out[str(key)] = value
        else:
            out.update(_leaves(value))
    return out


def _canonical(obj: Any) -> Any:
    """A task config as JSON that names what decides its answers: functions by module, name and source digest."""
    import hashlib
    import inspect

    if isinstance(obj, dict):
        return {str(k): _canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if callable(obj):
        try:
            src = hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            src = None
        return {"function": f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}",
                "source": src}
    return repr(obj)


def _config_of(task: Any) -> dict[str, Any]:
    """A task's config with its functions as the functions (``dump_config`` writes them as ``<function f at
    0x..>``, an address that changes with every process)."""
    import dataclasses

    config = getattr(task, "config", None)
    if dataclasses.is_dataclass(config):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return task.dump_config()


def task_fingerprint(obj: Any) -> dict[str, Any]:
    """What of a loaded task (or group) decides its answers: each leaf's config and its dataset's fingerprint per
    split (datasets' own, a digest of the files and the processing)."""
    out = {}
    for name, task in sorted(_leaves(obj).items()):
        data = getattr(task, "dataset", None)
        splits = {str(k): getattr(v, "_fingerprint", None) for k, v in data.items()} if hasattr(data, "items") else {}
        out[name] = {"config": _canonical(_config_of(task)), "dataset": splits}
    return out


def general_cell_key(plan: Any, task: str, fingerprint: dict[str, Any], state_sha: str, limit: int | None,
                     trained: int) -> dict[str, Any]:
    """An lmms-eval task's cell key: the method state, the backbone, the task as loaded, the sample limit, the
    generation settings and the versions (lmms-eval's among them)."""
    from mcit.run import cells as CS

    cfg = plan.cfg
    return {"kind": "lmms-eval", "task": task, "trained": trained, "state": state_sha,
            "backbone": plan.backbone_records(), "task_fingerprint": fingerprint, "limit": limit,
            "max_new_tokens": cfg.eval.max_new_tokens,
            "method": cfg.method.params().model_dump(mode="json"), "versions": {**CS.versions(),
                                                                                 "lmms_eval": LMMS_VERSION}}


def run_tasks(adapter: Any, tasks: list[Any], manager: Any, limit: int | None) -> dict[str, Any]:
    """lmms-eval's simple_evaluate on ``tasks``: {"results": {task: {metric: value}}, "samples": [...]}."""
    from lmms_eval import evaluator

    res = evaluator.simple_evaluate(model=adapter, tasks=list(tasks), task_manager=manager, batch_size=1,
                                    device="cpu", log_samples=True, bootstrap_iters=0, limit=limit,
                                    distributed_executor_backend="torchrun", verbosity="WARNING")
    if res is None:
        raise LmmsEvalError("lmms-eval returned no results")
    results = {t: {k.split(",")[0]: v for k, v in m.items() if k != "alias" and isinstance(v, (int, float))
                   and not k.endswith("_stderr,none")}
               for t, m in res["results"].items()}
    samples = []
    for t, rows in (res.get("samples") or {}).items():
        for s in rows:
            metrics = {k: s[k] for k in results.get(t, {}) if k in s}
            resp = s.get("filtered_resps") or s.get("resps")
            while isinstance(resp, list) and resp:
                resp = resp[0]
            samples.append({"key": f"{t}/{int(s.get('doc_id') or 0):09d}", "task": t, "doc_id": s.get("doc_id"),
                            "target": s.get("target"), "prediction": resp,
                            **{k: _plain(v) for k, v in metrics.items()}})
    return {"results": results, "samples": samples}


def _plain(v: Any) -> Any:
    try:
        return float(v)
    except (TypeError, ValueError):
        return v


def evaluate_general(plan: Any, ks: list[int], tasks: list[str], *, zero_shot: bool, include: list[Path],
                     limit: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """lmms-eval's ``tasks`` on the checkpoints after tasks ``ks`` (and the zero-shot state), one process, through
    evaluation cells (one per task and state: ``general_cell_key``): a task a complete cell holds is not answered
    again (``eval.reuse``). Each row (``eval/general/<row>.json``, ``<row>.samples.jsonl``) gains this call's tasks
    and keeps the others an earlier call added; on a finished run report.md is written again."""
    from mcit.core import console
    from mcit.core.checkpoint import load_state
    from mcit.core.rundir import row_tag
    from mcit.run import cells as CS
    from mcit.run.lifecycle import MethodHost

    import_lmms()
    manager = task_manager(include, tasks)  # before the process group and the model: a bad name is one line
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise LmmsEvalError(f"--lmms-eval runs in one process (lmms-eval shards by itself); the launcher started "
                            f"{os.environ['WORLD_SIZE']}")
    loaded = load_tasks(manager, tasks)  # every dataset on the machine, else one line: still before the model
    prints = {t: task_fingerprint(loaded[t]) for t in tasks}
    run = plan.run
    console.log_to(run.logs / f"general.rank{os.environ.get('RANK', '0')}.log")
    with console.stdout_to_log("deepspeed"):
        dist.init()
    host = MethodHost(plan)
    host.build()
    cfg = plan.cfg
    store = CS.store_root(cfg, run.root)
    out: list[tuple[str, dict[str, Any]]] = []
    for k in ([None] if zero_shot else []) + ks:
        tag = row_tag(k)
        if k is None:
            if run.zero_shot_state.is_file():  # the state the run's own zero-shot row saw
                host.load(load_state(run.zero_shot_state))
            with host.zero_shot():
                got = _answer_tasks(plan, host, 0, 0, tasks, loaded, prints, manager, limit, store)
        else:
            host.load(load_state(run.task_state(k)))
            host.enter_eval(k)
            got = _answer_tasks(plan, host, k, k + 1, tasks, loaded, prints, manager, limit, store)
        out.append((tag, _merge_row(run.eval_dir() / "general", tag, k, got, limit)))
    done = run.rows_done(plan.num_stages)
    if done == plan.num_stages:  # the report's general-ability table
        from mcit.run.results import write_metrics

        write_metrics(plan, done)
    return out


def _answer_tasks(plan: Any, host: Any, task_index: int, trained: int, tasks: list[str], loaded: dict[str, Any],
                  prints: dict[str, Any], manager: Any, limit: int | None, store: Path) -> dict[str, dict[str, Any]]:
    """Per task: its results, samples and cell (reused, or answered now and committed) for the method as it stands."""
    from mcit.run import cells as CS

    cfg = plan.cfg
    sha = CS.state_digest(host.method.state_dict())
    cells = {t: CS.Cell(store, general_cell_key(plan, t, prints[t], sha, limit, trained)) for t in tasks}
    todo = [t for t in tasks if not (cfg.eval.reuse and cells[t].complete())]
    res: dict[str, Any] = {"results": {}, "samples": []}
    if todo:
        adapter = make_adapter(host, task_index, cfg.eval.batch_size, cfg.eval.max_new_tokens)
        # a leaf task goes as the object already loaded; a group by name (lmms-eval builds its subtasks again)
        from lmms_eval.api.task import Task

        res = run_tasks(adapter, [loaded[t] if isinstance(loaded[t], Task) else t for t in todo], manager, limit)
    got: dict[str, dict[str, Any]] = {}
    for t in tasks:
        cell = cells[t]
        if t in todo:
            names = set(_leaves(loaded[t])) | {t}
            results = {n: r for n, r in res["results"].items() if n in names}
            samples = [x for x in res["samples"] if x["task"] in names]
            cell.finish(samples, {"results": results, "limit": limit, "lmms_eval": LMMS_VERSION})
            reused = False
        else:
            results, samples, reused = cell.info()["results"], cell.rows(), True
        got[t] = {"results": results, "samples": samples,
                  "cell": {"digest": cell.digest, "reused": reused, "samples": len(samples)}}
    return got


def _merge_row(where: Path, tag: str, k: int | None, got: dict[str, dict[str, Any]], limit: int | None
               ) -> dict[str, Any]:
    """The row file with this call's tasks put in (an earlier call's other tasks kept, with their limits and
    samples): two calls on one checkpoint add up instead of the second replacing the first."""
    path = where / f"{tag}.json"
    try:
        old = json.loads(path.read_text()) if path.is_file() else {}
    except json.JSONDecodeError:
        old = {}
    results = dict(old.get("results") or {})
    limits = dict(old.get("limits") or {t: old.get("limit") for t in old.get("tasks") or []})
    cells = dict(old.get("cells") or {})
    for t, g in got.items():
        for name in list(results):  # a task answered again replaces all of its own entries
            if name == t or name in (cells.get(t) or {}).get("names", []):
                results.pop(name)
        results.update(g["results"])
        limits[t] = limit
        cells[t] = {**g["cell"], "names": sorted(g["results"])}
    tasks = [*[t for t in old.get("tasks") or [] if t not in got], *got]
    write_json(path, {"checkpoint": k, "tasks": tasks, "results": results, "limits": limits, "cells": cells,
                      "lmms_eval": LMMS_VERSION})
    samples_path = where / f"{tag}.samples.jsonl"
    kept: list[str] = []
    if samples_path.is_file():
        mine = {n for t in got for n in cells[t]["names"]} | set(got)
        kept = [ln for ln in samples_path.read_text().splitlines() if ln and json.loads(ln).get("task") not in mine]
    new = [json.dumps(x) for g in got.values() for x in g["samples"]]
    atomic_write_text(samples_path, "".join(line + "\n" for line in kept + new))
    return results
