"""Splits read from URLs and pipe: commands: the same samples as the local files, checked against the manifest
before a sample of a shard is used, and one-line errors that name the file."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from conftest import http_served
from PIL import Image

from mcit.core import locations as L
from mcit.core.config import RunConfig
from mcit.data.shards import DataError, iter_samples, open_split, write_split

pytestmark = pytest.mark.unit


def _write(directory: Path, n: int = 37) -> Path:
    samples = []
    for i in range(n):
        buf = io.BytesIO()
        Image.new("RGB", (5, 3), (i, 2 * i % 255, 7)).save(buf, format="PNG")
        samples.append({"__key__": f"s{i:04d}", "png": buf.getvalue(), "cls": i % 3})
    write_split(directory / "t0" / "train", samples, shard_size=8, label_space=[0, 1, 2])
    return directory


def test_locations_join_by_their_kind():
    assert L.join("/data", "t0", "train") == "/data/t0/train"
    assert L.file_location("file:///data/t0/train", "manifest.json") == "/data/t0/train/manifest.json"
    assert L.join("http://h:1/shards/", "t0", "train") == "http://h:1/shards/t0/train"
    root = "pipe:aws s3 cp s3://b/shards/{} -"
    train = L.join(root, "t0", "train")
    assert train == "pipe:aws s3 cp s3://b/shards/t0/train/{} -"
    assert L.file_location(train, "shard-000001.tar") == "pipe:aws s3 cp s3://b/shards/t0/train/shard-000001.tar -"
    assert [L.scheme(x) for x in ("rel/dir", "/abs", "file:///x", "HTTPS://x", "pipe:cat {}")] == \
        ["", "", "", "https", "pipe"]
    assert L.absolute("rel/x", Path("/base")) == "/base/rel/x" and L.absolute(root, Path("/base")) == root


def test_a_remote_root_names_its_tasks_and_is_kept_as_given(tmp_path):
    """Bare task names under a URL root become URL locations; a stored config keeps them (no base prefixed)."""
    body = {"name": "r", "backbone": {"kind": "vit", "path": "bb"},
            "data": {"root": "http://127.0.0.1:9/shards", "tasks": ["t0", {"name": "t1", "train": "pipe:cat /s/{}",
                                                                            "test": "rel/t1/test"}]},
            "method": {"name": "l2p"}}
    cfg = RunConfig.model_validate(body)
    specs = cfg.data.resolved_tasks(tmp_path)
    assert (specs[0].train, specs[0].test) == ("http://127.0.0.1:9/shards/t0/train", "http://127.0.0.1:9/shards/t0/test")
    assert (specs[1].train, specs[1].test) == ("pipe:cat /s/{}", str(tmp_path / "rel" / "t1" / "test"))
    stored = cfg.with_absolute_paths(tmp_path)
    assert stored.data.root == "http://127.0.0.1:9/shards" and stored.data.tasks[1].train == "pipe:cat /s/{}"


def test_http_and_pipe_splits_read_the_same_samples_as_the_local_files(tmp_path):
    root = _write(tmp_path)
    local = open_split(root / "t0" / "train", verify="sha256")
    want = [(s["__key__"], s["png"], s["cls"]) for s in iter_samples(local, 1, 2, shuffle_seed=5, shuffle_buffer=7)]
    assert len(want) == 18
    with http_served(root) as url:
        for where in (f"{url}/t0/train", f"{url}/t0/train/", f"pipe:cat {root}/t0/train/{{}}"):
            split = open_split(where, verify="size")
            assert split.manifest == local.manifest
            got = list(iter_samples(split, 1, 2, shuffle_seed=5, shuffle_buffer=7))
            assert [(s["__key__"], s["png"], s["cls"]) for s in got] == want
            assert got[0]["__url__"].startswith(where.split("{}")[0].rstrip("/") + "/shard-")


def test_redirected_shards_are_followed_for_their_size_and_their_bytes(tmp_path):
    """Object stores and CDNs answer with a redirect; the size check must follow it as webdataset's reader does
    (curl -L), and compare the size of the file, not of the redirect's empty body."""
    root = _write(tmp_path)
    local = open_split(root / "t0" / "train")
    with http_served(root) as url:
        split = open_split(f"{url}/moved/t0/train", verify="size")
        assert split.manifest == local.manifest
        keys = [s["__key__"] for s in iter_samples(split, 0, 1)]
        assert len(keys) == 37 and keys == [s["__key__"] for s in iter_samples(local, 0, 1)]
        shard = root / "t0" / "train" / "shard-000001.tar"
        size = shard.stat().st_size
        shard.write_bytes(shard.read_bytes()[:-1024])
        with pytest.raises(DataError, match=rf"^shard {url}/moved/t0/train/shard-000001.tar has {size - 1024} bytes, "
                                            rf"manifest says {size} \(truncated or modified\)$"):
            open_split(f"{url}/moved/t0/train")


def _first_failure(split) -> tuple[int, str]:
    """How many samples came out before the reader stopped, and its message."""
    got = []
    with pytest.raises(DataError) as e:
        for s in iter_samples(split, 0, 1):
            got.append(s)
    return len(got), str(e.value)


def test_a_changed_remote_shard_stops_before_any_of_its_samples(tmp_path):
    root = _write(tmp_path)
    shard = root / "t0" / "train" / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0x01  # same size, other bytes: only the sha256 can tell
    shard.write_bytes(bytes(data))
    with http_served(root) as url:
        for where in (f"{url}/t0/train", f"pipe:cat {root}/t0/train/{{}}"):
            split = open_split(where)  # sizes agree: nothing to see before the bytes are read
            n, msg = _first_failure(split)
            assert n == 8  # all of shard 0, none of shard 1
            assert msg == f"shard {L.file_location(split.location, 'shard-000001.tar')}: sha256 does not match the " \
                          f"manifest (corrupted)"
        shard.write_bytes(bytes(data[:-1024]))  # truncated: the server's size disagrees before anything is read
        with pytest.raises(DataError, match=rf"^shard {url}/t0/train/shard-000001.tar has {len(data) - 1024} bytes, "
                                            rf"manifest says {len(data)} \(truncated or modified\)$"):
            open_split(f"{url}/t0/train")
        n, msg = _first_failure(open_split(f"pipe:cat {root}/t0/train/{{}}"))
        assert n == 8 and msg.endswith(f"has {len(data) - 1024} bytes, manifest says {len(data)} "
                                       "(truncated or modified)")


def test_missing_remote_files_and_bad_locations_are_one_line(tmp_path):
    root = _write(tmp_path)
    (root / "t0" / "train" / "shard-000002.tar").unlink()
    with http_served(root) as url:
        with pytest.raises(DataError, match=rf"^missing shard: {url}/t0/train/shard-000002.tar \(listed in "
                                            rf"{url}/t0/train/manifest.json\): .*404"):
            open_split(f"{url}/t0/train")
        with pytest.raises(DataError, match=rf"^missing manifest: cannot read {url}/t0/test/manifest.json: "
                                            r"curl exit 22: the server answered "
                                            r"with an HTTP error \(no such file\?\)$"):
            open_split(f"{url}/t0/test")
    pipe = f"pipe:cat {root}/t0/train/{{}}"
    n, msg = _first_failure(open_split(pipe))
    assert n == 16 and msg == f"cannot read pipe:cat {root}/t0/train/shard-000002.tar: the command exited with status 1"
    assert "\n" not in msg
    for bad, why in (("pipe:cat /x/manifest.json", r"needs \{\} where the file's name goes"),
                     ("nosuch://x/t0", "unknown location scheme 'nosuch'")):
        with pytest.raises(DataError, match=why):
            open_split(bad)
    shutil.rmtree(root / "t0")
    with pytest.raises(DataError, match=rf"^missing manifest: cannot read pipe:cat {root}/t0/train/manifest.json"):
        open_split(pipe)
