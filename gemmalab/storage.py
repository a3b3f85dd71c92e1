"""Local and ``gs://`` paths behind one interface (etils.epath), with early credential checks."""

from __future__ import annotations

import contextlib
import functools
import glob as globbing
import io
import os
from pathlib import Path

from gemmalab.errors import ConfigError

GCS_FIX = ("run `gcloud auth application-default login`, set GOOGLE_APPLICATION_CREDENTIALS, "
           "or use Workload Identity on GKE (or mount the bucket with GCS FUSE and use its path)")


def is_gcs(path: str | os.PathLike) -> bool:
    return str(path).startswith("gs://")


def gcs_credentials_found() -> bool:
    """Whether Google credentials are set up (gs:// paths may be readable)."""
    return _gcs_credentials_found()


@functools.cache
def _gcs_credentials_found() -> bool:
    import google.auth
    from google.auth import exceptions

    try:
        google.auth.default()
    except exceptions.DefaultCredentialsError:
        return False
    return True


def require_gcs_credentials(parameter: str, path: str, *, fix: str = GCS_FIX) -> None:
    """Fail fast, naming ``parameter``, when a gs:// path cannot possibly be read."""
    if not _gcs_credentials_found():
        raise ConfigError(parameter, f"{path} is on Google Cloud Storage but no credentials "
                          "were found", fix)


def require_reachable(parameter: str, path: str, *, fix: str = GCS_FIX) -> None:
    """Fail fast, naming ``parameter``, when a gs:// path cannot be read from here: no
    credentials, or Google's storage API unreachable (no network, a proxy refusing it). Local
    paths pass (a missing file is the reader's to report)."""
    if not is_gcs(path):
        return
    require_gcs_credentials(parameter, path, fix=fix)
    try:
        _gcs_path(path).exists()
    except Exception as error:  # TensorFlow's, google-auth's or the network's: all mean "no"
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(parameter, f"cannot reach {path} ({type(error).__name__}: "
                          f"{first_line[:200]})", fix) from None


def _gcs_path(path: str | os.PathLike):
    """The one way to a gs:// object (etils.epath); tests put a local folder behind it."""
    from etils import epath

    return epath.Path(path)


def require_writable_directory(parameter: str, path: str | os.PathLike) -> Path:
    """``path`` (local) exists or can be created, and this process can write in it; else a
    one-line error naming ``parameter`` (a file in the way, no permission, a read-only disk)."""
    import tempfile

    directory = Path(path).expanduser().absolute()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".gemmalab-write-check"):
            pass
    except OSError as error:
        raise ConfigError(parameter, f"cannot write to {path} "
                          f"({type(error).__name__}: {error.strerror or error})",
                          "choose a directory this process can create and write") from None
    return directory


def open_binary(path: str | os.PathLike) -> io.BufferedIOBase:
    """Open a local or gs:// file for streaming, seekable reads (a standard binary stream:
    what pyarrow reads Parquet through)."""
    if is_gcs(path):
        return io.BufferedReader(_ObjectReader(_gcs_path(path).open("rb")))
    return open(path, "rb")  # noqa: SIM115 - caller closes


class _ObjectReader(io.RawIOBase):
    """A gs:// object as a standard raw stream. epath's tf.io.gfile backend opens it as a
    context manager around a GFile, which has no ``closed`` and whose ``seek`` returns None."""

    def __init__(self, opened):
        self._exit = contextlib.ExitStack()
        self._handle = self._exit.enter_context(opened)  # a file's __enter__ is the file

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._handle.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def readall(self) -> bytes:  # one read of the rest, not one per 8 KB
        return self._handle.read()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._handle.seek(offset, whence)
        return self._handle.tell()

    def tell(self) -> int:
        return self._handle.tell()

    def close(self) -> None:
        if not self.closed:
            self._exit.close()
        super().close()


def read_bytes(path: str | os.PathLike) -> bytes:
    with open_binary(path) as f:
        return f.read()


def file_size(path: str | os.PathLike) -> int:
    if is_gcs(path):
        return _gcs_path(path).stat().length
    return os.path.getsize(path)


def exists(path: str | os.PathLike) -> bool:
    if is_gcs(path):
        return _gcs_path(path).exists()
    return os.path.exists(path)


def has_wildcards(pattern: str) -> bool:
    """Whether ``pattern`` is a glob (what ``glob`` expands, and orbax expands under a path)."""
    return any(c in pattern for c in "*?[")


def glob(pattern: str) -> list[str]:
    """What a local or gs:// pattern (``*``, ``?``, ``[...]``; locally ``**`` spans folders)
    matches, sorted by name: local files (not folders); gs:// objects (one listing, no call per
    match)."""
    if not is_gcs(pattern):
        return sorted(p for p in globbing.glob(pattern, recursive=True) if os.path.isfile(p))
    parts = pattern.split("/")
    fixed = next(i for i, part in enumerate(parts) if has_wildcards(part))
    base, rest = "/".join(parts[:fixed]), "/".join(parts[fixed:])
    root = _gcs_path(base)
    return sorted(f"{base}/{match.relative_to(root)}" for match in root.glob(rest))


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a whole file: locally through a temporary file and a rename, so a reader (another
    process sharing the cache) never sees half of it; on gs:// as one object."""
    if is_gcs(path):
        _gcs_path(path).write_bytes(data)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.tmp{os.getpid()}")
    partial.write_bytes(data)
    os.replace(partial, path)
