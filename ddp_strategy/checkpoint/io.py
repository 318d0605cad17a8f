"""Crash-safe checkpoint writes (:func:`atomic_save`), safe loads that fail clearly (:func:`load_file`: any file
that is not a valid checkpoint gives one of four errors naming the path; fuzzed in
tests/checkpoint/test_checkpoint_fuzz.py), and ``DDPCheckpointIO``, Lightning's plugin for both. Rank-agnostic.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
import secrets
import socket
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- writes
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"  # as it appears in temporary file names
#: ``.<target>.<host>.<pid>.<random>.tmp``: hidden, never ``*.ckpt``, and its writer can be recognised.
_TMP_PATTERN = re.compile(r"^\.(?P<name>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp$")


def remove_stale_temp_files(folder: str | os.PathLike) -> list[Path]:
    """Delete (and return) the :func:`atomic_save` temporary files in ``folder`` whose writer, on this host, died
    (other hosts' are left alone; a missing folder is fine)."""
    folder = Path(folder)
    stale = [
        entry
        for entry in (folder.iterdir() if folder.is_dir() else ())
        if (m := _TMP_PATTERN.match(entry.name))
        and m["host"] == _HOST
        and not _namespace.pid_alive(int(m["pid"]))  # this process's own are alive too
    ]
    for entry in stale:
        entry.unlink(missing_ok=True)
        log.info("removed the temporary file of a checkpoint writer that died: %s", entry)
    return stale


def atomic_save(obj: Any, path: str | os.PathLike, save_fn: Callable[[Any, Any], None] = torch.save) -> None:
    """Write ``obj`` to the local file ``path`` so that a crash at any moment leaves the old or the new complete file.

    ``save_fn(obj, file)`` (default :func:`torch.save`) writes a hidden temporary file in ``path``'s folder (same
    file system, so :func:`os.replace` is atomic; never ``*.ckpt``), fsynced, renamed over ``path``, folder
    fsynced; mode 0o666 less the umask, as ``torch.save(obj, path)``. On error the temporary file is removed.
    Creates the folder; removes dead writers' temporary files there first.
    """
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    remove_stale_temp_files(folder)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{_HOST}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as f:  # O_CREAT | O_EXCL, mode 0o666 less the umask
            save_fn(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # make the rename durable (POSIX; folders cannot be opened on Windows)
        folder_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(folder_fd)
        finally:
            os.close(folder_fd)


def prepare_folders(callbacks: list[Any]) -> None:
    """At fit start (global rank 0), warn now about the first ``dirpath`` of a checkpoint callback that is not
    writable, where Lightning's ddp fails at the first save (a ``tempfile.TemporaryFile`` probe there or in its
    nearest existing parent leaves no trace; remote paths are not probed). What killed writers left there goes at
    the next save (:func:`atomic_save`)."""
    for folder in [os.fspath(cb.dirpath) for cb in callbacks if _is_local(getattr(cb, "dirpath", None))]:
        absolute = Path(folder).absolute()
        existing = next(p for p in (absolute, *absolute.parents) if p.exists())
        try:
            tempfile.TemporaryFile(dir=existing).close()
        except OSError as e:
            _namespace.rank_zero_warn(
                f"Checkpoint folder {folder} is not writable ({type(e).__name__}: {e.strerror or e}). Choose a writable"
                " ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...) before training. The first checkpoint"
                " saved there will fail; fix the folder now."
            )
            return


def _is_local(path: Any) -> bool:
    """Whether ``path`` is a file path, not a URL: ``file://`` ones too go through Lightning's fsspec IO, where
    they mean the path after the scheme (``os`` functions would read them as a relative ``file:/...``)."""
    return isinstance(path, (str, os.PathLike)) and "://" not in os.fspath(path)


def _stamp(path: Any) -> tuple[str, int, int] | None:
    """``(real path, size in bytes, mtime in ns)`` of a local file; None for a remote or missing one."""
    if _is_local(path):
        with contextlib.suppress(OSError):  # missing
            st = os.stat(path)
            return os.path.realpath(path), st.st_size, st.st_mtime_ns
    return None


class WrittenFiles:
    """Local checkpoint files this rank saw written in this process, each with its size (bytes) and mtime (ns): a
    file loaded back unchanged was written by this run's rank 0, so it is trusted (``weights_only=False``)."""

    def __init__(self) -> None:
        self._stamps: set[tuple[str, int, int] | None] = set()

    def add(self, path: Any) -> None:
        """Remember ``path`` as it is now (after its write completed); remote or missing paths are ignored."""
        self._stamps.add(_stamp(path))

    def discard(self, path: Any) -> None:
        """Forget ``path`` as it is now (before it is removed)."""
        self._stamps.discard(_stamp(path))

    def __contains__(self, path: Any) -> bool:
        return _stamp(path) in self._stamps - {None}  # (None: a remote or missing file, never trusted)


# ---------------------------------------------------------------------------------------------- loads
class DamagedCheckpointError(ValueError):
    """A checkpoint file is truncated, corrupt or not a PyTorch checkpoint at all."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """``weights_only=True`` refused an object in the file (it could run code when unpickled)."""


def load_file(
    path: str | os.PathLike,
    map_location: Any = "cpu",
    weights_only: bool = True,
    verify_checksums: bool = True,
    opt_out: str = "load_file(..., weights_only=False)",
) -> Any:
    """``torch.load`` a checkpoint file; whatever bytes it holds, a failure is one of the errors below, naming it.

    Warnings of a failing load are dropped, a successful one's passed on. With ``verify_checksums`` every zip
    member's CRC-32 is checked first (``torch.load`` does not; a file saved with CRC-32 off is not checked).
    ``weights_only=False`` only for files you trust; ``opt_out`` (how the caller turns it off) is quoted in the
    :class:`UnsafeCheckpointError`. ``map_location``: a device (string or ``torch.device``); a callable gets
    ``torch.load``'s own errors once the file is open, whatever they are, as Lightning's ``TorchCheckpointIO``.
    Returns what the file holds (any object).

    Raises:
        FileNotFoundError: ``path`` does not exist or is a directory (the message lists checkpoint files in it).
        PermissionError: ``path`` cannot be read by this user.
        DamagedCheckpointError: the file is truncated, corrupt or not a PyTorch checkpoint.
        UnsafeCheckpointError: ``weights_only`` and the file holds an object outside PyTorch's allow-list.
        RuntimeError: ``map_location`` names a device this machine lacks (PyTorch's).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if verify_checksums and f.read(4) == b"PK\x03\x04":  # the zip magic: torch.load's zip format
                _verify_zip_checksums(f, path, size)
    except OSError as e:
        raise _open_error(path, e) from e
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded = torch.load(path, map_location=map_location, weights_only=weights_only)
        except OSError as e:  # the file changed (removed, chmod) since it was opened above
            raise _open_error(path, e) from e
        except Exception as e:  # whatever the unpickler raised, the file is not a checkpoint we can load
            # torch's own error: with a map_location callable, as Lightning's TorchCheckpointIO gives it (the
            # callable's, or the file's); for a valid file on a device this machine lacks, PyTorch's says what to do
            if callable(map_location) or (
                isinstance(e, RuntimeError) and "Attempting to deserialize object on" in str(e)
            ):
                raise
            warned = " ".join(str(w.message) for w in caught)  # torch's "Detected pickle protocol 4 ..."
            raise _load_error(path, size, weights_only, e, opt_out, warned) from e
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return loaded


def _open_error(path: str, error: OSError) -> OSError:
    """The error for a checkpoint path that cannot be opened: PermissionError or FileNotFoundError."""
    if isinstance(error, PermissionError):
        return PermissionError(
            f"Checkpoint file {path} cannot be read: permission denied for this user"
            f" (uid {os.getuid() if hasattr(os, 'getuid') else '?'}). Make it readable"
            " (chmod u+r) or run as its owner."
        )
    if os.path.isdir(path):  # Path.glob lists nothing in a folder it cannot read
        found = sorted(p.name for p in Path(path).glob("*") if p.suffix in (".ckpt", ".pt", ".pth"))[:5]
        return FileNotFoundError(
            f"Checkpoint path {path} is a directory, not a checkpoint file. Pass a file"
            f" inside it{f' (found {found})' if found else ''}."
        )
    return FileNotFoundError(f"Checkpoint file not found: {path} ({error.strerror or type(error).__name__}).")


def _load_error(path: str, size: int, weights_only: bool, error: Exception, opt_out: str, warned: str) -> Exception:
    """The documented error for a file ``torch.load`` failed on (``warned``: its warnings): unsafe, else damaged."""
    message = str(error)
    if weights_only is not False and "Unsupported global" in message:  # None: torch.load's default, True
        first = next(
            line.split("Unsupported global:")[-1].split(" was not")[0].strip()
            for line in message.splitlines()
            if "Unsupported global" in line
        )
        return UnsafeCheckpointError(
            f"Checkpoint {path} holds an object that weights_only=True loading refuses ({first}). If you"
            f" trust this file, load it with {opt_out}, or allow the type before loading (on every rank) with"
            f" torch.serialization.add_safe_globals([{first.removeprefix('GLOBAL').strip()}])."
        )
    protocol = re.search(r"Detected pickle protocol (\d+)", warned)
    if weights_only is not False and isinstance(error, pickle.UnpicklingError) and protocol:
        # torch.save(..., pickle_protocol=4): torch warns that its weights-only unpickler may not read it
        reason = next((line.strip() for line in message.splitlines() if "Unsupported" in line), message[:120])
        return UnsafeCheckpointError(
            f"Checkpoint {path} holds a pickle of protocol {protocol[1]} that weights_only=True loading cannot"
            f" read ({reason}); torch.save(..., pickle_protocol=N) with N > 2 does this. If you trust this file,"
            f" load it with {opt_out}, or save it again with the default protocol."
        )
    return _damaged(path, size, error)


def _damaged(path: str, size: int, error: BaseException) -> DamagedCheckpointError:
    """The error for a file whose bytes are no checkpoint, quoting the first line of ``error`` (why)."""
    message = str(error).split("WeightsUnpickler error:", 1)[-1]  # skip torch's long preamble about weights_only
    detail = next((line.strip() for line in message.splitlines() if line.strip()), "")[:200]
    return DamagedCheckpointError(
        f"Checkpoint file {path} is damaged (truncated or corrupt, {size} bytes) or is not a PyTorch"
        f" checkpoint: {type(error).__name__}: {detail}. Use an earlier checkpoint or save this one again."
    )


def _verify_zip_checksums(f: Any, path: str, size: int) -> None:
    """Read every member of the zip ``f`` once (``ZipFile.testzip``), so ``zipfile`` compares each CRC-32; a file
    saved with torch's CRC-32 switched off (every CRC 0) is not checked. Else ``DamagedCheckpointError``."""
    try:
        with zipfile.ZipFile(f) as archive:
            if any(info.CRC for info in archive.infolist()) and (bad := archive.testzip()) is not None:
                raise zipfile.BadZipFile(f"the CRC-32 or the header of member {bad} does not check out")
    except Exception as e:  # zipfile raises BadZipFile, EOFError, ValueError, struct.error, ... on bad bytes
        raise _damaged(path, size, e) from e


# ----------------------------------------------------------------------------------- Lightning plugin
class DDPCheckpointIO(_namespace.TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, crash-safe and safe to load: local files written by :func:`atomic_save`
    (the keys as given: ``MyDDPStrategy`` hands it clean ones), loaded by :func:`load_file`; URLs (``file://`` too)
    and ``remove_checkpoint`` Lightning's.

    Args:
        weights_only: what ``load_checkpoint(weights_only=None)`` uses (default True); an explicit
            ``Trainer.fit(ckpt_path=..., weights_only=False)`` still opts out for one load.
        verify_checksums: check every zip member's CRC-32 before loading (default True; about one extra read).

    Raises:
        TypeError: ``weights_only`` or ``verify_checksums`` is not a bool.
    """

    def __init__(self, weights_only: bool = True, verify_checksums: bool = True) -> None:
        super().__init__()
        if weights_only is not None and not isinstance(weights_only, bool):  # None: torch.load's default
            raise TypeError(f"DDPCheckpointIO(weights_only=...) must be True or False, got {weights_only!r}.")
        if not isinstance(verify_checksums, bool):
            raise TypeError(f"DDPCheckpointIO(verify_checksums=...) must be True or False, got {verify_checksums!r}.")
        self.weights_only = weights_only
        self.verify_checksums = verify_checksums

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` atomically; ``TypeError`` for ``storage_options`` (unsupported, as in Lightning's)."""
        if storage_options is not None or not _is_local(path):  # Lightning's: refuses storage_options (TypeError)
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        atomic_save(checkpoint, path)

    def load_checkpoint(
        self, path: Any, map_location: Callable | Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint (``weights_only=None``: this plugin's default) onto ``map_location`` (default the CPU,
        as Lightning's ``lambda storage, loc: storage``); a local file gives a dict, else the errors of
        :func:`load_file`, or ``DamagedCheckpointError`` when it holds something other than a dict."""
        weights_only = self.weights_only if weights_only is None else weights_only
        if not _is_local(path):
            return _pl.load_checkpoint_with_weights_only(path, map_location, weights_only)
        checkpoint = load_file(
            path,
            map_location=map_location,
            weights_only=weights_only,
            verify_checksums=self.verify_checksums,
            opt_out="weights_only=False in the Trainer call that loads it (trainer.fit(model, ckpt_path=...,"
            " weights_only=False); also validate, test and predict), or for every load"
            " MyDDPStrategy(checkpoint_io=DDPCheckpointIO(weights_only=False))",
        )
        if not isinstance(checkpoint, dict):
            raise DamagedCheckpointError(
                f"Checkpoint file {os.fspath(path)} holds a {type(checkpoint).__name__},"
                " not a checkpoint dict; it was not written by Trainer.save_checkpoint."
                " Pass the .ckpt file Lightning saved."
            )
        return checkpoint
