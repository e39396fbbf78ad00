"""What the experiment trackers hold after a run, read back from their local stores (W&B offline files, an MLflow
file store, TensorBoard's event files): {series: [(global step, value), ...]} in the order logged, and the runs."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def _wandb_records(data: bytes):
    """The records of a W&B ``.wandb`` file: a LevelDB-style log (7-byte header, 32 KiB blocks, each record a
    crc/length/type header and a piece of one protobuf ``Record``)."""
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        piece, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        buf = piece if kind in (1, 2) else buf + piece
        if kind in (1, 4):
            yield buf


def wandb_series(logs: Path) -> tuple[dict[str, list[tuple[int, float]]], set[str]]:
    """Every history row of every offline W&B run under ``logs`` (each launch of a resumed run writes its own
    directory), keyed by series against ``global_step``; and the run ids found."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, list[tuple[int, float]]] = {}
    ids = set()
    for f in sorted(logs.glob("wandb/offline-run-*/run-*.wandb")):
        ids.add(f.stem.removeprefix("run-"))
        for raw in _wandb_records(f.read_bytes()):
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") != "history":
                continue
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            for k, v in row.items():
                if not k.startswith("_") and k != "global_step":
                    out.setdefault(k, []).append((int(row["global_step"]), float(v)))
    return out, ids


def mlflow_series(uri: str, experiment: str) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    out: dict[str, list[tuple[int, float]]] = {}
    for run in runs:
        for key in run.data.metrics:
            hist = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.timestamp, m.step))
            out.setdefault(key, []).extend((m.step, m.value) for m in hist)
    return out, [r.info.run_id for r in runs]


def tensorboard_series(tb: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # the directory as TensorBoard reads it: every events file in order, a resumed writer's purge applied
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
