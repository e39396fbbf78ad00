"""``data.replay``: each earlier task's buffer is a fixed, seeded sample of its training keys, the same for any
shard layout and on every rank; a later task trains on its own samples plus the buffers (its label space its own);
the buffers are kept in the run directory and a resumed run whose data would give other buffers stops."""

from __future__ import annotations

import json

import pytest
from conftest import mcit_config

from mcit.core.config import load_config
from mcit.data.shards import DataError, iter_samples, open_split, replay_keys


def _keys(split, rank: int = 0, world: int = 1) -> list[str]:
    return [s["__key__"] for s in iter_samples(split, rank, world, policy="sample")]


def test_a_later_task_trains_on_its_own_samples_and_the_earlier_buffers(mcit_assets, tmp_path):
    from mcit.run.preflight import preflight

    cfg = mcit_config(mcit_assets, tmp_path, "replay", data={"tasks": ["colour", "count", "position"], "replay": 5})
    plan = preflight(load_config(cfg))
    own = [open_split(mcit_assets["shards"] / t / "train") for t in ("colour", "count", "position")]
    assert list(plan.replay) == ["colour", "count"] and all(len(k) == 5 for k in plan.replay.values())
    assert plan.train[0].num_samples == own[0].num_samples and _keys(plan.train[0]) == _keys(own[0])
    for t in (1, 2):
        want = sorted(_keys(own[t]) + [k for name in plan.stage_names[:t] for k in plan.replay[name]])
        assert plan.train[t].num_samples == own[t].num_samples + 5 * t
        assert sorted(_keys(plan.train[t])) == want
        halves = _keys(plan.train[t], 0, 2) + _keys(plan.train[t], 1, 2)  # the ranks' parts cover it once
        assert sorted(halves) == want
        assert plan.train[t].label_space == own[t].label_space
    # the buffer is the seed's, not the first samples of the split, and another seed draws another
    first = _keys(own[0])[:5]
    assert plan.replay["colour"] != sorted(first)
    assert replay_keys(own[0], 5, seed=1) != plan.replay["colour"] == replay_keys(own[0], 5, seed=0)


def test_the_buffer_does_not_depend_on_the_shard_layout(tmp_path):
    from data_prep.tiny_mcit import build

    a = build(tmp_path / "a", seed=0, n_train=40, n_test=8, n_base=16, n_base_test=8, shard_size=16)
    b = build(tmp_path / "b", seed=0, n_train=40, n_test=8, n_base=16, n_base_test=8, shard_size=7)
    assert a and b
    sa, sb = open_split(tmp_path / "a" / "colour" / "train"), open_split(tmp_path / "b" / "colour" / "train")
    assert len(sa.shard_locations) != len(sb.shard_locations)
    assert replay_keys(sa, 6, seed=3) == replay_keys(sb, 6, seed=3)


def test_the_run_keeps_its_buffers_and_a_resume_on_other_data_stops(tmp_path):
    from mcit.run.pipeline import check_replay

    path = tmp_path / "replay.json"
    buffers = {"colour": ["a", "b"], "count": ["c", "d"]}
    check_replay(path, buffers, 0)
    assert json.loads(path.read_text()) == {"seed": 0, "buffers": buffers}
    check_replay(path, buffers, 0)  # the same run resumed
    with pytest.raises(DataError, match=r"replay\.json: the replay buffer of task count differs"):
        check_replay(path, {"colour": ["a", "b"], "count": ["c", "e"]}, 0)


def test_replay_and_the_joint_schedule_do_not_go_together(mcit_assets, tmp_path):
    from mcit.core.config import ConfigError

    cfg = mcit_config(mcit_assets, tmp_path, "bad", data={"replay": 3, "schedule": "joint"})
    with pytest.raises(ConfigError, match="data.replay: the joint schedule"):
        load_config(cfg)
