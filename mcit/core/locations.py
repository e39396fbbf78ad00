"""Where a split's files are: a local directory, a URL, or a ``pipe:`` command.

A split location names a directory; its files (``manifest.json``, the shards) are found by name under it:

* a local path (or ``file://``): ``Path(location) / name``; read with the mmap tar reader in ``shards``.
* a URL that webdataset's ``gopen`` opens (``http(s)://``, ``gs://``, ``ais://``, ``hf://``, ``sftp://`` ...):
  ``location + "/" + name``.
* ``pipe:CMD``: a command whose standard output is the file, with ``{}`` where the file's path under the
  location goes: ``pipe:aws s3 cp s3://bucket/digits/t0/train/{} -`` or ``pipe:cat /data/t0/train/{}``. A
  task name under a ``pipe:`` ``data.root`` is put before the ``{}`` (``pipe:cat /data/{}`` → task ``t0`` reads
  ``pipe:cat /data/t0/train/manifest.json``).

A remote file is read whole through webdataset's ``gopen`` (curl for http(s), the command for ``pipe:``) into
an anonymous temporary file, its size and sha256 are checked against the manifest *before* any of its samples
is used, and it is then parsed by the same reader as a local shard; the temporary file is gone once the shard
is read. So a truncated or altered remote shard stops the run naming it and never half-trains a task.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path
from typing import IO

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]+):")
PLACEHOLDER = "{}"


class LocationError(ValueError):
    """A location string that cannot name a split; ``str()`` is one line."""


def scheme(location: str) -> str:
    """``""`` for a local path (``file://`` included), else the URL scheme (``http``, ``pipe``, ...)."""
    m = _SCHEME.match(location)
    if m is None or m.group(1).lower() == "file":
        return ""
    return m.group(1).lower()


def is_remote(location: str) -> bool:
    return scheme(location) != ""


def local_path(location: str) -> Path:
    """The local path of a local location (``file://`` stripped)."""
    if location.lower().startswith("file://"):
        from urllib.parse import urlparse
        from urllib.request import url2pathname

        return Path(url2pathname(urlparse(location).path))
    return Path(location)


def check(location: str) -> None:
    """Raise LocationError (one line) for a location no reader can open: an unknown scheme, or a ``pipe:``
    without ``{}``. Pre-flight calls it for every split before anything is read."""
    s = scheme(location)
    if s == "":
        return
    from webdataset.gopen import gopen_schemes

    known = sorted(k for k in gopen_schemes if not k.startswith("_"))
    if s not in known:
        raise LocationError(f"{location}: unknown location scheme {s!r} (known: file, {', '.join(known)}; "
                            f"or a local path)")
    if s == "pipe" and PLACEHOLDER not in location:
        raise LocationError(f"{location}: a pipe: location needs {PLACEHOLDER} where the file's name goes "
                            f"(e.g. pipe:cat /data/t0/train/{PLACEHOLDER})")


def join(location: str, *parts: str) -> str:
    """The location of ``parts`` (a relative path, '/'-separated) under ``location``."""
    rel = "/".join(p.strip("/") for p in parts if p)
    if not rel:
        return location
    s = scheme(location)
    if s == "":
        return str(local_path(location) / rel)
    if s == "pipe":
        return location.replace(PLACEHOLDER, rel + "/" + PLACEHOLDER, 1)
    return location.rstrip("/") + "/" + rel


def file_location(location: str, name: str) -> str:
    """The location of the file ``name`` in the directory ``location`` (for ``pipe:``, the ``{}`` is filled)."""
    if scheme(location) == "pipe":
        return location.replace(PLACEHOLDER, name, 1)
    return join(location, name)


def absolute(location: str, base: Path) -> str:
    """A local relative location made absolute against ``base``; anything else as given."""
    if is_remote(location) or local_path(location).is_absolute():
        return location
    return str((base / location).resolve())


def fetch(location: str, sink: IO[bytes], chunk: int = 1 << 20) -> tuple[int, str]:
    """Copy the remote file at ``location`` into ``sink``; returns (bytes, sha256 hex). Raises OSError
    (naming the location) when it cannot be opened or its reader fails (curl's or the command's exit status)."""
    from webdataset.gopen import gopen

    h, n = hashlib.sha256(), 0
    try:
        stream = gopen(location, "rb")
        try:
            while block := stream.read(chunk):
                h.update(block)
                sink.write(block)
                n += len(block)
        finally:
            stream.close()  # a Pipe raises here when curl / the command exited with an error
    except Exception as e:  # noqa: BLE001 - gopen raises OSError, ValueError or a subprocess error
        raise OSError(f"cannot read {location}: {_why(location, e)}") from None
    return n, h.hexdigest()


_CURL = {6: "cannot resolve the host", 7: "cannot connect to the server", 22: "the server answered with an HTTP error "
         "(no such file?)", 28: "timed out", 35: "TLS handshake failed", 60: "the server's certificate is not trusted"}


def _why(location: str, error: Exception) -> str:
    """One line for a failed read: webdataset's Pipe reports ``(args, kwargs): exit N (read)``; say what N
    means for curl (http(s)), or that the command failed (its own message is on stderr above)."""
    m = re.search(r"exit (\d+)", str(error))
    if m is None:
        return (str(error).splitlines() or [type(error).__name__])[0]
    code = int(m.group(1))
    if scheme(location) == "pipe":
        return f"the command exited with status {code}"
    return f"curl exit {code}" + (f": {_CURL[code]}" if code in _CURL else "")


def read_bytes(location: str) -> bytes:
    """A small remote file (a manifest) as bytes."""
    import io

    buf = io.BytesIO()
    fetch(location, buf)
    return buf.getvalue()


def spooled(location: str, *, size: int | None, sha256: str | None) -> IO[bytes]:
    """The remote file at ``location`` in an anonymous temporary file (rewound), checked against ``size`` and
    ``sha256`` where given; ValueError naming the file when they disagree. The caller closes it."""
    tmp = tempfile.TemporaryFile(prefix="mcit-shard-")
    try:
        n, digest = fetch(location, tmp)
        if size is not None and n != size:
            raise ValueError(f"shard {location} has {n} bytes, manifest says {size} (truncated or modified)")
        if sha256 is not None and digest != sha256:
            raise ValueError(f"shard {location}: sha256 does not match the manifest (corrupted)")
        tmp.seek(0)
        return tmp
    except BaseException:
        tmp.close()
        raise
