"""Evaluation cells: the answers of one method state on one task's test split, computed once and kept.

A cell is keyed by everything that determines its answers (``cell_key``): the digest of the method state, the
backbone records (their sha256), the test split's manifest, the chat format and generation cap, the image
pipeline, the method's parameters, the class mask, the library versions. Every evaluating path (the pipeline's
eval stage, ``mcit-evaluate``, a sweep's runs sharing ``eval.cells``) looks a cell up by that key before it
generates: a complete cell is reused, a changed key is a different cell (computed, never a stale one reused).
The scorer is not part of the key: answers are scored when a cell is used (``score_rows``), so a swapped or
fixed scorer needs no model (``mcit.run.rescore``).

While a cell is computed, each rank commits its answers in chunks of ``eval.chunk_size`` samples
(``chunks/<writer>.<seq>.jsonl``, each written by rename, the sample keys in them): a killed or preempted pass
loses at most one chunk per rank, and the next pass generates only the samples no chunk holds. Rank 0 then
writes ``answers.jsonl`` (sorted by key) and, last, ``cell.json`` (the commit point), and removes the chunks.
A complete cell is never rewritten. Writers never share a file name (rank, world size and a random tag in each
chunk's name), so two runs computing the same cell at once (a sweep's zero-shot rows) leave valid files;
duplicate keys across their chunks hold the same answer and are merged.

Layout: ``<cells>/<digest[:2]>/<digest>/{cell.json, answers.jsonl, chunks/}``; ``<cells>`` is ``eval.cells``,
by default the run's ``eval/cells``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from mcit.core.checkpoint import WriteError, atomic_write_text, write_json

CELL_FORMAT = 1


# -- keys --------------------------------------------------------------------------------------------------------
def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a method state's tensors (name, dtype, shape, bytes), in name order: equal states, equal
    digests, on any rank and after a save / load."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def split_digest(split: Any) -> str:
    """What a test split is, whatever its location: its manifest (shard files, their sizes and sha256, the
    sample count) and, for a derived split (a validation carve, a replay buffer), the side, fraction and keys
    and its sources' digests."""
    parts: dict[str, Any] = {"manifest": split.manifest}
    for attr in ("side", "fraction"):
        if hasattr(split, attr):
            parts[attr] = getattr(split, attr)
    if getattr(split, "keys", None) is not None:
        parts["keys"] = sorted(split.keys)
    if getattr(split, "sources", None):
        parts["sources"] = [[split_digest(src), i] for src, i in split.sources]
    return _sha(parts)


def versions() -> dict[str, str]:
    import transformers

    import mcit

    return {"torch": torch.__version__, "transformers": transformers.__version__, "mcit": mcit.__version__}


def cell_key(plan: Any, task: int, trained: int, state_sha: str, allowed: list[int] | None = None) -> dict[str, Any]:
    """Everything that determines the answers of the method state ``state_sha`` (after ``trained`` tasks; 0: the
    zero-shot state) on task ``task``'s test split. Left out on purpose: the scorer (scored at use), the eval
    batch size and the world size (inference is per sample), where the files lie."""
    cfg = plan.cfg
    generation = plan.scorers is not None
    key: dict[str, Any] = {
        "format": CELL_FORMAT, "kind": "generation" if generation else "classification",
        "state": state_sha, "trained": trained, "task": task, "task_name": plan.names[task],
        "method": {"name": cfg.method.name, **cfg.method.params().model_dump(mode="json")},
        "backbone": plan.backbone_records(),
        "backbone_config": cfg.backbone.model_dump(mode="json", include={"kind", "chat_format", "max_length",
                                                                         "quantization", "tokenizer"}),
        "split": split_digest(plan.test[task]),
        "images": cfg.data.model_dump(mode="json", include={"train_transform", "eval_transform", "normalization"}),
        "precision": cfg.train.precision, "versions": versions(),
    }
    if generation:
        key["max_new_tokens"] = cfg.task_max_new_tokens(task)
    else:
        key["labels"] = list(plan.sequence.labels)
        key["allowed_classes"] = allowed
    return key


def key_digest(key: dict[str, Any]) -> str:
    return _sha(key)


# -- scoring -----------------------------------------------------------------------------------------------------
def scorer_version(name: str) -> str:
    """The version a row records with its scorer: a digest of the scorer's source (and of the metric library's
    version for corpus metrics), so a changed scorer shows in every row it scored."""
    from mcit.core import caption_metrics as C
    from mcit.core import judge as J
    from mcit.core import scorers as S

    if name in C.CORPUS:
        from importlib.metadata import PackageNotFoundError, version

        try:
            lib = version("pycocoevalcap")
        except PackageNotFoundError:
            lib = "absent"
        src = inspect.getsource(C.CORPUS[name][0]) + inspect.getsource(C.coco_scores) + lib
    elif name in J.JUDGED:
        spec = J.JUDGED[name]
        src = "".join(inspect.getsource(f) for f in (spec.prefetch, spec.prompt, spec.hit, J.score_rows))
    else:
        src = inspect.getsource(S.get(name))
    return hashlib.sha256(src.encode()).hexdigest()[:12]


class Judge:
    """The local judge model of ``eval.judge``, loaded the first time a judged scorer asks it (rank 0)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg, self.model = cfg, None

    def __call__(self, prompts: list[str]) -> list[str]:
        from mcit.core import judge as J

        if self.model is None:
            self.model = J.LocalJudge(self.cfg.path, self.cfg.max_new_tokens, self.cfg.batch_size)
        return self.model(prompts)


def row_reference(row: dict[str, Any]) -> dict[str, Any]:
    """What a per-sample scorer reads, rebuilt from a stored answer row (``mcit.run.evaluation.answer_row``)."""
    return {**row["reference"], "question": row["question"], "answers": row["answers"]}


def score_rows(name: str, rows: list[dict[str, Any]], judge: Callable[[list[str]], list[str]] | None = None
               ) -> tuple[float, dict[str, Any] | None, list[dict[str, Any]]]:
    """Score stored answer rows with scorer ``name``: (summed score, a corpus metric's table or None, the rows with
    their new scores). Per-sample scorers score each row from its reference; a corpus metric (CIDEr ...) scores
    all of them once (rows get ``score: null``, the sum is the value x count); a judged scorer asks ``judge``
    (a callable answering prompts) for the rows no rule reads."""
    from mcit.core import caption_metrics as C
    from mcit.core import judge as J
    from mcit.core import scorers as S

    if name in C.CORPUS:
        value, table = C.score_rows(name, rows)
        return value * len(rows), table, [{**r, "score": None} for r in rows]
    if name in J.JUDGED:
        if judge is None:
            raise ValueError(f"scorer {name} needs a judge model (eval.judge.path)")
        scored = J.score_rows(name, rows, judge)
        out = [{**r, **s} for r, s in zip(rows, scored)]
        return float(sum(r["score"] for r in out)), None, out
    fn = S.get(name)
    out = [{**r, "score": fn(r["prediction"], row_reference(r))} for r in rows]
    return float(sum(r["score"] for r in out)), None, out


# -- the store ---------------------------------------------------------------------------------------------------
class CellError(RuntimeError):
    """A cell that cannot be completed or read (samples missing after a pass, a damaged file); one line."""


class Cell:
    """One cell's directory. Nothing is created until a chunk or the cell is written."""

    def __init__(self, root: Path, key: dict[str, Any]) -> None:
        self.key = key
        self.digest = key_digest(key)
        self.dir = root / self.digest[:2] / self.digest

    def __repr__(self) -> str:
        return f"Cell({self.digest[:12]}, task {self.key['task']}, after {self.key['trained']} task(s))"

    @property
    def record(self) -> Path:
        return self.dir / "cell.json"

    @property
    def answers(self) -> Path:
        return self.dir / "answers.jsonl"

    @property
    def chunks(self) -> Path:
        return self.dir / "chunks"

    def complete(self) -> bool:
        return self.record.is_file() and self.answers.is_file()

    def rows(self) -> list[dict[str, Any]]:
        """The answers of a complete cell, sorted by key."""
        try:
            return [json.loads(line) for line in self.answers.read_text().splitlines() if line]
        except (OSError, json.JSONDecodeError) as e:
            raise CellError(f"{self.answers}: unreadable ({e}); delete {self.dir} to compute the cell again") from None

    def info(self) -> dict[str, Any]:
        return json.loads(self.record.read_text())

    def chunk_rows(self) -> dict[str, dict[str, Any]]:
        """Every committed chunk's rows by sample key (a chunk being renamed into place is whole or absent)."""
        out: dict[str, dict[str, Any]] = {}
        if not self.chunks.is_dir():
            return out
        for f in sorted(self.chunks.glob("*.jsonl")):
            for line in f.read_text().splitlines():
                if line:
                    row = json.loads(line)
                    out.setdefault(row["key"], row)
        return out

    def writer(self, rank: int, world: int) -> "ChunkWriter":
        return ChunkWriter(self.chunks, f"r{rank}of{world}-{uuid.uuid4().hex[:8]}")

    def finish(self, rows: list[dict[str, Any]], scored: dict[str, Any]) -> None:
        """Commit the cell (rank 0): answers sorted by key, then ``cell.json``; the chunks go. A complete cell is
        left as it is (another writer finished it first)."""
        if not self.complete():
            rows = sorted(rows, key=lambda r: r["key"])
            atomic_write_text(self.answers, "".join(json.dumps(r) + "\n" for r in rows))
            write_json(self.record, {"key": self.key, "digest": self.digest, "samples": len(rows), **scored})
        self.drop_chunks()

    def drop_chunks(self) -> None:
        """Remove the committed chunks one by one (not the directory under a writer that may still be adding
        one: another run answering the same cell), then the directory if that left it empty."""
        for f in self.chunks.glob("*.jsonl") if self.chunks.is_dir() else []:
            f.unlink(missing_ok=True)
        try:
            self.chunks.rmdir()
        except OSError:
            pass


# Test-only seam: ``fn(cell, writer_name, seq)`` runs after each chunk is committed (tests kill a pass there).
_chunk_hooks: list[Callable[[Cell | None, str, int], None]] = []


def on_chunk(fn: Callable[[Any, str, int], None]) -> Callable[[Any, str, int], None]:
    _chunk_hooks.append(fn)
    return fn


class ChunkWriter:
    """One rank's chunks of one cell: rows buffered, committed every ``size`` rows and at ``flush``."""

    def __init__(self, where: Path, name: str) -> None:
        self.where, self.name = where, name
        self.pending: list[dict[str, Any]] = []
        self.seq = 0
        self.cell: Cell | None = None

    def add(self, rows: list[dict[str, Any]], size: int) -> None:
        self.pending += rows
        while len(self.pending) >= size:
            self._commit(self.pending[:size])
            self.pending = self.pending[size:]

    def flush(self) -> None:
        if self.pending:
            self._commit(self.pending)
            self.pending = []

    def _commit(self, rows: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps(r) + "\n" for r in rows)
        for attempt in range(3):  # another run finishing the same cell may remove the empty directory meanwhile
            os.makedirs(self.where, exist_ok=True)
            try:
                atomic_write_text(self.where / f"{self.name}.{self.seq:06d}.jsonl", text)
                break
            except WriteError as e:
                if not isinstance(e.__cause__, FileNotFoundError) or attempt == 2:
                    raise
        for hook in _chunk_hooks:
            hook(self.cell, self.name, self.seq)
        self.seq += 1


def store_root(cfg: Any, run_root: Path) -> Path:
    """Where a run's cells live: ``eval.cells`` (relative to the run directory), else ``<run_dir>/eval/cells``."""
    if cfg.eval.cells:
        p = Path(cfg.eval.cells)
        return p if p.is_absolute() else run_root / p
    return run_root / "eval" / "cells"


def publish_answers(cell: Cell, rows: list[dict[str, Any]], path: Path) -> None:
    """A row's answer file for a task: a hard link to the cell's answers when ``rows`` are those answers (no second
    copy of a large split), else the rows written; by rename either way."""
    if cell.complete():
        same = cell.answers.read_text() == "".join(json.dumps(r) + "\n" for r in rows)
        if same:
            tmp = path.with_name(f".{path.name}.link{os.getpid()}")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.unlink(missing_ok=True)
                os.link(cell.answers, tmp)
                os.replace(tmp, path)
                return
            except OSError:  # another file system, or links not allowed: write a copy
                tmp.unlink(missing_ok=True)
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
