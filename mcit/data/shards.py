"""Webdataset tar shards with a manifest per split, and the rank-aware reader.

Layout of a split directory::

    manifest.json          {"format", "num_samples", "label_space", "class_names", "shards": [...]}
    shard-000000.tar       webdataset samples: <key>.png|jpg (image bytes), <key>.cls (integer label), <key>.json

How a split is divided over W ranks (``split`` policy):

* ``shard``: whole shards are assigned greedily, largest first, to the rank with the fewest samples.
  Reading is W times cheaper than ``sample`` but ranks may get unequal sample counts.
* ``sample``: every rank streams every shard and keeps the samples whose global index i has
  ``i % W == rank``; counts differ by at most one.
* ``auto``: ``shard`` when there are at least 4 shards per rank, else ``sample``.

Either way every sample of the split is seen exactly once per epoch across ranks. Unequal counts
are handled by the engine: every rank runs the same number of steps (the largest rank's), a rank
that has run out pads its batch with zero-weight copies, and the loss is normalised by the global
number of real samples in the step, so the gradient equals the single-process gradient.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

from mcit.core import locations as L
from mcit.core.checkpoint import atomic_write_text

MANIFEST = "manifest.json"
FORMAT = "mcit-shards/1"


class DataError(ValueError):
    """A problem with shards or manifests; ``str()`` is one line naming the file."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Writing

def write_split(
    directory: Path,
    samples: list[dict[str, Any]],
    *,
    shard_size: int,
    label_space: list[int],
    class_names: dict[int, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict:
    """Write ``samples`` (dicts with __key__, png bytes, cls int, optional json) as shards + manifest.

    Each shard is written to a temporary name and renamed, and the manifest is written last, so an
    interrupted write never leaves a split that looks complete.
    """
    import webdataset as wds

    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    for idx, start in enumerate(range(0, max(len(samples), 1), shard_size)):
        chunk = samples[start : start + shard_size]
        name = f"shard-{idx:06d}.tar"
        tmp = directory / f".{name}.tmp"
        with wds.TarWriter(str(tmp), mtime=0) as sink:  # fixed int mtime: byte-identical, no pax headers
            for s in chunk:
                sink.write(s)
        os.replace(tmp, directory / name)
        shards.append(
            {"file": name, "num_samples": len(chunk), "bytes": (directory / name).stat().st_size,
             "sha256": sha256_file(directory / name)}
        )
    return write_manifest(directory, shards, label_space, class_names, extra)


def write_manifest(directory: Path, shards: list[dict[str, Any]], label_space: list[int],
                   class_names: dict[int, str] | None = None, extra: dict[str, Any] | None = None) -> dict:
    """Write ``directory/manifest.json`` for finished ``shards`` (file, num_samples, bytes, sha256 each),
    last and atomically, so a split only looks complete once every shard is in place. Returns it."""
    manifest = {
        "format": FORMAT,
        "num_samples": sum(int(s["num_samples"]) for s in shards),
        "label_space": sorted(int(c) for c in label_space),
        "class_names": {str(k): v for k, v in (class_names or {}).items()},
        "shards": shards,
        **(extra or {}),
    }
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


# --------------------------------------------------------------------------------------------------
# Reading

@dataclass(frozen=True)
class Split:
    """A validated split: its location (a local directory, a URL or a ``pipe:`` template; see
    ``mcit.core.locations``) and its manifest."""

    location: str
    manifest: dict

    @property
    def num_samples(self) -> int:
        return int(self.manifest["num_samples"])

    @property
    def label_space(self) -> list[int]:
        return [int(c) for c in self.manifest["label_space"]]

    @property
    def shard_locations(self) -> list[str]:
        return [L.file_location(self.location, s["file"]) for s in self.manifest["shards"]]

    @property
    def shard_counts(self) -> list[int]:
        return [int(s["num_samples"]) for s in self.manifest["shards"]]

    def shard_samples(self, index: int) -> Iterator[dict]:
        """The samples of shard ``index``: a local shard through the mmap reader; a remote one fetched whole,
        checked against the manifest's size and sha256, then read the same way."""
        where, entry = self.shard_locations[index], self.manifest["shards"][index]
        if not L.is_remote(where):
            yield from tar_samples(L.local_path(where))
            return
        try:
            fh = L.spooled(where, size=int(entry["bytes"]), sha256=entry.get("sha256"))
        except (OSError, ValueError) as e:
            raise DataError(str(e)) from None
        with fh:
            yield from tar_samples(fh, url=where)


def open_split(location: str | Path, verify: str = "size") -> Split:
    """Load a split's manifest and check every shard exists and matches (size or sha256).

    A remote split's manifest is fetched and checked the same way; its shards are checked where their bytes
    are read (``Split.shard_samples``: size and sha256 always), and an http(s) shard's existence and size are
    asked of the server here (a HEAD request), so a missing one stops the run before any work.
    Raises DataError naming the manifest or the shard; meant to run before any expensive work.
    """
    location = str(location)
    try:
        L.check(location)
    except L.LocationError as e:
        raise DataError(str(e)) from None
    mpath = L.file_location(location, MANIFEST)
    remote = L.is_remote(location)
    if remote:
        try:
            text = L.read_bytes(mpath)
        except OSError as e:
            raise DataError(f"missing manifest: {e}") from None
    else:
        if not L.local_path(mpath).is_file():
            raise DataError(f"missing manifest: {mpath}")
        text = L.local_path(mpath).read_bytes()
    try:
        manifest = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"unreadable manifest {mpath}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise DataError(f"{mpath}: format is {got!r}, expected {FORMAT!r}")
    for key in ("num_samples", "label_space", "shards"):
        if key not in manifest:
            raise DataError(f"{mpath}: key {key!r} is missing")
    if sum(int(s["num_samples"]) for s in manifest["shards"]) != int(manifest["num_samples"]):
        raise DataError(f"{mpath}: shard sample counts do not add up to num_samples")
    split = Split(location, manifest)
    for s, where in zip(manifest["shards"], split.shard_locations):
        if remote:
            if L.scheme(where) in ("http", "https"):
                size = _http_size(where, mpath)
                if size is not None and size != int(s["bytes"]):
                    raise DataError(f"shard {where} has {size} bytes, manifest says {s['bytes']} "
                                    f"(truncated or modified)")
            continue
        f = L.local_path(where)
        if not f.is_file():
            raise DataError(f"missing shard: {f} (listed in {mpath})")
        size = f.stat().st_size
        if size != int(s["bytes"]):
            raise DataError(f"shard {f} has {size} bytes, manifest says {s['bytes']} (truncated or modified)")
        if verify == "sha256" and sha256_file(f) != s["sha256"]:
            raise DataError(f"shard {f}: sha256 does not match the manifest (corrupted)")
    return split


@dataclass(frozen=True)
class DerivedSplit(Split):
    """A split read through other splits' shards: shard ``i`` is shard ``sources[i][1]`` of ``sources[i][0]``,
    and with ``side`` only the samples of that side of the validation carve (``carve``). Built by ``union``
    and ``carve``; readers see an ordinary split (its manifest counts what it yields)."""

    sources: tuple[tuple[Split, int], ...] = ()
    side: str | None = None  # "fit" | "validation" | None (every sample)
    fraction: float = 0.0
    keys: frozenset[str] | None = None  # only these samples (a replay buffer: ``replay_buffer``)

    @property
    def shard_locations(self) -> list[str]:
        return [split.shard_locations[i] for split, i in self.sources]

    def shard_samples(self, index: int) -> Iterator[dict]:
        split, i = self.sources[index]
        for sample in split.shard_samples(i):
            if self.keys is not None and sample["__key__"] not in self.keys:
                continue
            if self.side is None or (validation_side(sample["__key__"], self.fraction) == (self.side == "validation")):
                yield sample


def validation_side(key: str, fraction: float) -> bool:
    """Whether sample ``key`` falls in the validation part of a carve of ``fraction``: a hash of the key alone,
    so the carve is the same on every rank, for any shard layout and in every run of a sweep."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") < fraction * 2 ** 64


def _sample_label(sample: dict) -> int | None:
    raw = sample.get("cls")
    return int(raw.decode() if isinstance(raw, bytes) else raw) if raw is not None else None


def carve(split: Split, fraction: float) -> tuple[Split, Split]:
    """(fit, validation): ``split`` divided by ``validation_side`` of each sample's key, for model selection on
    data the test split never sees. Reads every shard once (keys and labels only are kept) to count each side;
    a side left empty is an error naming the split. That read happens at pre-flight, so on a large training
    split (millions of samples) the carve costs one pass over its shards before the run starts: meant for
    selection studies on benchmark-sized data."""
    counts = {"fit": [], "validation": []}
    labels: dict[str, set[int]] = {"fit": set(), "validation": set()}
    for i in range(len(split.shard_locations)):
        n = {"fit": 0, "validation": 0}
        for sample in split.shard_samples(i):
            side = "validation" if validation_side(sample["__key__"], fraction) else "fit"
            n[side] += 1
            label = _sample_label(sample)
            if label is not None:
                labels[side].add(label)
        for side in n:
            counts[side].append(n[side])
    out = []
    for side in ("fit", "validation"):
        if sum(counts[side]) == 0:
            raise DataError(f"{split.location}: a validation carve of {fraction:g} leaves its {side} part empty "
                            f"({split.num_samples} samples)")
        keep = [i for i, c in enumerate(counts[side]) if c]
        shards = [{**split.manifest["shards"][i], "num_samples": counts[side][i]} for i in keep]
        manifest = {**split.manifest, "num_samples": sum(counts[side]), "shards": shards,
                    "label_space": sorted(labels[side]) if labels[side] else split.manifest["label_space"]}
        out.append(DerivedSplit(f"{split.location} ({side} part of a {fraction:g} carve)", manifest,
                                tuple((split, i) for i in keep), side, fraction))
    return out[0], out[1]


def replay_rank(key: str, seed: int) -> bytes:
    """Where sample ``key`` stands in a seeded order of a split's samples: a hash of the seed and the key alone,
    so a replay buffer is the same on every rank, for any shard layout, and after a resume."""
    return hashlib.sha256(f"{seed}:{key}".encode()).digest()


def replay_keys(split: Split, n: int, seed: int) -> list[str]:
    """The ``n`` samples of ``split`` first in the seeded order (``replay_rank``), sorted: a replay buffer. Reads
    the split's keys once."""
    keys = [sample["__key__"] for i in range(len(split.shard_locations)) for sample in split.shard_samples(i)]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise DataError(f"{split.location}: sample key {dup!r} occurs twice; a replay buffer is chosen by key")
    return sorted(sorted(keys, key=lambda k: replay_rank(k, seed))[:n])


def replay_buffer(split: Split, keys: list[str], name: str) -> Split:
    """The samples ``keys`` of ``split`` as a split of their own (a task's replay buffer): its shards are those
    that hold one of them, its manifest counts only them."""
    wanted = frozenset(keys)
    counts = [sum(1 for s in split.shard_samples(i) if s["__key__"] in wanted)
              for i in range(len(split.shard_locations))]
    keep = [i for i, c in enumerate(counts) if c]
    manifest = {**split.manifest, "num_samples": sum(counts),
                "shards": [{**split.manifest["shards"][i], "num_samples": counts[i]} for i in keep]}
    return DerivedSplit(name, manifest, tuple((split, i) for i in keep), keys=wanted)


def union(splits: list[Split], name: str) -> Split:
    """Several splits read as one (the multi-task bound trains on every task's data together; the loader's
    shard-order and buffer shuffle mix them)."""
    sources = tuple((sp, i) for sp in splits for i in range(len(sp.shard_locations)))
    kinds = {sp.manifest.get("kind") for sp in splits}
    manifest = {**splits[0].manifest, "kind": kinds.pop() if len(kinds) == 1 else None,
                "num_samples": sum(sp.num_samples for sp in splits),
                "label_space": sorted({int(c) for sp in splits for c in sp.label_space}),
                "class_names": {k: v for sp in splits for k, v in (sp.manifest.get("class_names") or {}).items()},
                "shards": [sp.manifest["shards"][i] for sp, i in sources]}
    return DerivedSplit(name, manifest, sources)


def _http_size(url: str, manifest: str) -> int | None:
    """The size an http(s) server reports for ``url`` (None when it reports none), asked with curl as
    webdataset's reader will fetch it; DataError when the server has no such file."""
    import subprocess

    res = subprocess.run(["curl", "--connect-timeout", "30", "-f", "-s", "-S", "-L", "-I", url],
                         capture_output=True, text=True)
    if res.returncode != 0:
        why = (res.stderr.strip().splitlines() or [f"curl exit {res.returncode}"])[-1]
        raise DataError(f"missing shard: {url} (listed in {manifest}): {why}")
    sizes = re.findall(r"(?im)^content-length:\s*(\d+)", res.stdout)
    return int(sizes[-1]) if sizes else None


def assign(split: Split, rank: int, world: int, policy: str = "auto") -> tuple[str, list[int], list[int]]:
    """Decide which part of ``split`` each rank reads.

    Returns (mode, shard indices of ``rank``, per-rank sample counts for all ranks). ``mode`` is
    "shard" or "sample". Pure function of its arguments, so every rank computes the same plan.
    """
    counts = split.shard_counts
    mode = policy
    if mode == "auto":
        mode = "shard" if len(counts) >= 4 * world else "sample"
    if mode == "shard" and len(counts) < world:
        mode = "sample"  # a rank would get no shard at all
    if mode == "sample":
        n = split.num_samples
        per_rank = [n // world + (1 if r < n % world else 0) for r in range(world)]
        return "sample", list(range(len(counts))), per_rank
    load = [0] * world
    owner: dict[int, int] = {}
    for idx in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
        r = min(range(world), key=lambda k: (load[k], k))
        owner[idx] = r
        load[r] += counts[idx]
    mine = sorted(i for i, r in owner.items() if r == rank)
    return "shard", mine, load


_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's base_plus_ext: key = path up to the first dot


def _tar_members(source: Path | IO[bytes], path: str | Path) -> Iterator[tuple[str, bytes]]:
    """(name, data) of every regular file in a tar, in order.

    Python's tarfile (what webdataset reads through) spends ~100 us of header parsing per member,
    which made the shards slower to read than the raw image files they replace
    (bench/shard_read_speed.py). This reads the file with one mmap and parses the 512-byte
    ustar headers directly (checksum checked; pax ``path`` and GNU long names understood), which the
    same benchmark measures several times faster; tests pin that it yields exactly what webdataset
    yields on the same shards. Anything it does not understand is an error naming the shard (``path``).
    ``source`` is the shard's path or an open file (a fetched remote shard).
    """
    import contextlib
    import mmap

    opened = open(source, "rb") if isinstance(source, (str, Path)) else contextlib.nullcontext(source)
    with opened as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise DataError(f"cannot read shard {path}: empty file")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            mm.madvise(mmap.MADV_SEQUENTIAL)
            pos, long_name = 0, None
            while pos + 512 <= size:
                hdr = mm[pos:pos + 512]
                if hdr.count(0) == 512:
                    return  # end-of-archive block
                try:
                    stored = int(hdr[148:156].split(b"\0", 1)[0].strip() or b"0", 8)
                    n = int(hdr[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
                except ValueError:
                    stored, n = -1, 0
                if stored != sum(hdr[:148]) + 256 + sum(hdr[156:]):
                    raise DataError(f"cannot read shard {path}: bad tar header at byte {pos} (truncated or modified)")
                typ = hdr[156:157]
                start = pos + 512
                pos = start + (n + 511) // 512 * 512
                if start + n > size:
                    raise DataError(f"cannot read shard {path}: member at byte {start - 512} runs past the end "
                                    f"(truncated)")
                if typ == b"x":  # pax extended header: "<len> key=value\n" records
                    for rec in mm[start:start + n].split(b"\n"):
                        k, _, v = rec.partition(b" ")[2].partition(b"=")
                        if k == b"path":
                            long_name = v.decode()
                    continue
                if typ == b"L":
                    long_name = mm[start:start + n].rstrip(b"\0").decode()
                    continue
                if typ not in (b"0", b"\0", b"7"):
                    long_name = None
                    continue  # directories, links, global headers: not samples
                name = long_name
                if name is None:
                    name = hdr[0:100].split(b"\0", 1)[0].decode()
                    prefix = hdr[345:500].split(b"\0", 1)[0].decode() if hdr[257:262] == b"ustar" else ""
                    name = f"{prefix}/{name}" if prefix else name
                long_name = None
                yield name, mm[start:start + n]
            raise DataError(f"cannot read shard {path}: no end-of-archive block (truncated)")


def tar_samples(source: Path | IO[bytes], url: str | None = None) -> Iterator[dict]:
    """Samples of one shard as webdataset groups them: consecutive files with the same key (the path up
    to the first dot of the file name) form a sample ``{"__key__", "__url__", <ext>: bytes}``. ``source`` is
    a path, or an open file whose location is ``url``."""
    path = url if url is not None else str(source)
    current: dict | None = None
    for name, data in _tar_members(source, path):
        m = _KEY.match(name)
        if m is None:
            continue
        key, ext = m.group(1), m.group(2).lower()
        if current is None or current["__key__"] != key:
            if current is not None:
                yield current
            current = {"__key__": key, "__url__": path}
        if ext in current:
            raise DataError(f"cannot read shard {path}: sample {key} has two {ext!r} files")
        current[ext] = data
    if current is not None:
        yield current


def iter_samples(
    split: Split,
    rank: int,
    world: int,
    *,
    policy: str = "auto",
    shuffle_seed: int | None = None,
    shuffle_buffer: int = 1000,
    skip: int = 0,
) -> Iterator[dict]:
    """Raw samples (dicts of bytes) of this rank's part of the split.

    With ``shuffle_seed`` the shard order and a sample buffer are shuffled deterministically, so the
    same (seed, rank, world) gives the same order and a resumed epoch can ``skip`` what was consumed.
    A shard that cannot be read raises DataError naming it.
    """
    mode, mine, _ = assign(split, rank, world, policy)
    shards = list(mine)
    rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
    if rng is not None:
        rng.shuffle(shards)

    def _raw() -> Iterator[dict]:
        index = 0
        for i in shards:
            for sample in split.shard_samples(i):
                if mode == "sample":
                    keep = index % world == rank
                    index += 1
                    if not keep:
                        continue
                yield sample

    stream: Iterator[dict] = _raw()
    if rng is not None:
        stream = _buffer_shuffle(stream, shuffle_buffer, rng)
    for i, sample in enumerate(stream):
        if i < skip:
            continue
        yield sample


def _buffer_shuffle(stream: Iterator[dict], size: int, rng: random.Random) -> Iterator[dict]:
    """Reservoir-style shuffle with a bounded buffer (memory stays O(size))."""
    buf: list[dict] = []
    for item in stream:
        if len(buf) < size:
            buf.append(item)
            continue
        j = rng.randrange(len(buf))
        buf[j], item = item, buf[j]
        yield item
    rng.shuffle(buf)
    yield from buf


def decode_sample(sample: dict) -> tuple[Any, int, str]:
    """(PIL image, label, key) from a raw webdataset sample."""
    from PIL import Image

    key = sample.get("__key__", "?")
    try:
        data = next((sample[e] for e in ("png", "jpg", "jpeg") if e in sample), None)
        if data is None:
            raise KeyError("no png/jpg image")
        image = Image.open(io.BytesIO(data))
        image.load()
        label = int(sample["cls"].decode() if isinstance(sample["cls"], bytes) else sample["cls"])
    except Exception as e:  # noqa: BLE001 - any decoding failure names the sample
        raise DataError(f"sample {key} in {sample.get('__url__', '?')}: cannot decode ({e})") from None
    return image, label, key
