"""Atomic writes and directory publishing (mcit/core/checkpoint.py): what a killed writer leaves behind."""

from __future__ import annotations

import json

import torch

from mcit.core.checkpoint import load_state, publish_dir, save_state, staging_dir, write_json


def test_state_round_trips_with_its_record_in_the_safetensors_metadata(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "task_0" / "method.safetensors"
    path.parent.mkdir()
    save_state(path, {"prompts": torch.arange(6.0).view(2, 3)}, {"task": 0, "method": "l2p"})
    assert torch.equal(load_state(path)["prompts"], torch.arange(6.0).view(2, 3))
    with safe_open(str(path), "pt") as f:  # users read an exported prompt's task and method from here
        assert json.loads(f.metadata()["mcit"]) == {"task": 0, "method": "l2p"}
    save_state(path, {"prompts": torch.zeros(1)})
    with safe_open(str(path), "pt") as f:
        assert json.loads(f.metadata()["mcit"]) == {}
    assert sorted(p.name for p in path.parent.iterdir()) == ["method.safetensors"]  # no temp file left


def test_write_json_is_indented_for_people():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        write_json(Path(d) / "x.json", {"a": [1]})
        assert (Path(d) / "x.json").read_text() == '{\n "a": [\n  1\n ]\n}'


def test_staging_dir_starts_empty_beside_its_target_even_after_a_killed_build(tmp_path):
    out = tmp_path / "new" / "deeper" / "backbone"  # parents that do not exist yet
    tmp = staging_dir(out)
    assert tmp == out.with_name("backbone.partial") and tmp.is_dir() and not any(tmp.iterdir())
    (tmp / "half_written.bin").write_text("x")  # a build killed here leaves this behind
    assert not any(staging_dir(out).iterdir())


def test_publish_replaces_by_default_keeps_on_request_and_says_which(tmp_path):
    out = tmp_path / "new" / "parents" / "data"  # two levels that do not exist yet
    tmp = staging_dir(tmp_path / "s1")
    (tmp / "a").write_text("1")
    assert publish_dir(tmp, out, files={"record.json": "{}"}) is True
    assert (out / "a").read_text() == "1" and (out / "record.json").read_text() == "{}" and not tmp.exists()
    tmp = staging_dir(tmp_path / "s2")
    (tmp / "a").write_text("2")
    assert publish_dir(tmp, out) is True and (out / "a").read_text() == "2"  # the default replaces
    tmp = staging_dir(tmp_path / "s3")
    (tmp / "a").write_text("3")
    assert publish_dir(tmp, out, replace=False) is False  # kept: another process published first
    assert (out / "a").read_text() == "2" and not tmp.exists()
