"""Crash-safe checkpoint writes, and the checks around them.

:func:`atomic_save` writes to a hidden temporary file in the target's own folder (the system temp
folder may be another file system, where ``os.replace`` is not atomic), flushes and fsyncs it, renames it
over the target with :func:`os.replace` (atomic on POSIX and Windows) and fsyncs the folder, so a crash
leaves either the old or the new complete file. Temporary files of writers that died are removed by
:func:`remove_stale_temp_files` before the next write to that folder and when a fit starts. Rank-agnostic: the
strategy makes only global rank 0 write.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddp_strategy._compat.namespace import get_filesystem

log = logging.getLogger(__name__)

_TMP_SUFFIX = ".tmp"


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


_TMP_PATTERN = re.compile(r"^\.(?P<name>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp$")


def temp_prefix(target: str | os.PathLike) -> str:
    """The name start of :func:`atomic_save`'s temporary files for ``target``: hidden, host and pid tagged."""
    return f".{os.path.basename(os.fspath(target))}.{_host_tag()}.{os.getpid()}."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temp_files(folder: str | os.PathLike) -> list[Path]:
    """Delete :func:`atomic_save` temporary files in ``folder`` left by writers on this host that died.

    A file is stale when its name has the temporary pattern (``.<target>.<host>.<pid>.<random>.tmp``), its
    host is this one and process ``pid`` no longer runs. Files of live writers and of other hosts (shared
    file systems) are left alone. A missing folder is fine.

    Returns:
        The paths removed.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    host = _host_tag()
    for entry in folder.iterdir():
        m = _TMP_PATTERN.match(entry.name)
        if not m or m["host"] != host or int(m["pid"]) == os.getpid() or _pid_alive(int(m["pid"])):
            continue
        try:
            entry.unlink()
            removed.append(entry)
            log.info("removed the temporary file of a checkpoint writer that died: %s", entry)
        except FileNotFoundError:
            pass
    return removed


def _fsync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _new_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 less the process's umask (0o644 for umask 022)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_save(obj: Any, path: str | os.PathLike, save_fn: Callable[[Any, Any], None] = torch.save) -> None:
    """Write ``obj`` to ``path`` so that a crash at any moment leaves the old or the new complete file.

    ``save_fn(obj, file)`` writes into a hidden temporary file in ``path``'s folder (see :func:`temp_prefix`;
    never named ``*.ckpt``), which is flushed and fsynced, renamed over ``path`` with :func:`os.replace`,
    and the folder is fsynced. The file gets the permissions a plain ``torch.save(obj, path)`` gives (0o666 less
    the umask), so other users can read it where they could read Lightning's. On any error the temporary file is
    removed and the error re-raised. Stale
    temporary files of dead writers in the folder are removed first. Creates the folder if needed.

    Args:
        obj: what to save (a checkpoint dict, a state dict).
        path: the local target file.
        save_fn: writes ``obj`` to an open binary file; default :func:`torch.save`.
    """
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    remove_stale_temp_files(folder)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=_TMP_SUFFIX, dir=folder)
    try:
        os.fchmod(fd, _new_file_mode())  # mkstemp makes it 0o600; torch.save(path) would follow the umask
        with os.fdopen(fd, "wb") as f:
            save_fn(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_folder(folder)
    log.debug("saved %s atomically", path)


def unwritable_reason(folders: list[str | os.PathLike]) -> str | None:
    """Check that checkpoints can be written to each folder; say why not for the first that fails.

    Writes and removes a small probe file in each folder. A missing folder (and any missing parent) is
    created for the probe and removed again, so the check leaves no trace: ``ModelCheckpoint`` creates the
    folder itself when it first saves, and a run that saves nothing (``fast_dev_run=True``) leaves
    ``default_root_dir`` as it found it, as under Lightning. Local paths only; remote (``scheme://``) paths
    are skipped.

    Args:
        folders: checkpoint folders.

    Returns:
        ``None`` when all are writable, else a message naming the folder and the error.
    """
    for folder in folders:
        folder = os.fspath(folder)
        if "://" in folder:
            continue
        created: list[str] = []
        try:
            missing, parent = [], os.path.abspath(folder)
            while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
                missing.append(parent)
                parent = os.path.dirname(parent)
            for path in reversed(missing):
                os.mkdir(path)
                created.append(path)
            probe = os.path.join(folder, f".ddp_strategy_write_test_{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"0")
            os.remove(probe)
        except OSError as e:
            return (f"Checkpoint folder {folder} is not writable ({type(e).__name__}: {e.strerror or e}). Choose a"
                    " writable ModelCheckpoint(dirpath=...) or Trainer(default_root_dir=...) before training.")
        finally:
            for path in reversed(created):
                try:
                    os.rmdir(path)
                except OSError:  # something else put a file there meanwhile: leave it
                    break
    return None


def file_stamp(path: Any) -> tuple[str, tuple[int, int]] | None:
    """``(real path, (size in bytes, modification time in ns))`` of a local file, or None (remote or missing).

    Lets a writer recognise, later, a file it wrote itself and that nobody changed since.
    """
    if not isinstance(path, (str, os.PathLike)) or "://" in os.fspath(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return os.path.realpath(path), (st.st_size, st.st_mtime_ns)


def is_local(path: Any) -> bool:
    if isinstance(path, (str, os.PathLike)) and "://" not in os.fspath(path):
        return True
    return type(get_filesystem(path)).__name__ == "LocalFileSystem"
