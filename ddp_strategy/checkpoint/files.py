"""Checkpoint IO: wrapper-free model keys, crash-safe writes and safe, clearly failing loads.

Keys. ``DistributedDataParallel`` names every key ``module.<name>`` and ``torch.compile``'s
``OptimizedModule`` inserts an ``_orig_mod.`` segment wherever it wraps a module (a compiled sub-module
inside the LightningModule, a compiled whole model, also stacked with DDP in either order). Checkpoints
are written without those segments (:func:`unwrapped_state_dict`, exact: it walks the module tree, so a
real sub-module called ``module`` keeps its name), and loading renames a file's keys to the model's own
(:func:`match_state_dict`, exact against the model's keys), with one error listing missing and unexpected
keys (:class:`StateDictMismatchError`).

Writes. :func:`atomic_save` writes to a hidden temporary file in the target's own folder (the system temp
folder may be another file system, where ``os.replace`` is not atomic), flushes and fsyncs it, renames it
over the target with :func:`os.replace` (atomic on POSIX and Windows) and fsyncs the folder, so a crash
leaves either the old or the new complete file. Temporary files of writers that died are removed by
:func:`remove_stale_temp_files` before the next write to that folder and when a fit starts.

Loads. :func:`load_file` uses ``torch.load(weights_only=True)`` by default (an untrusted file cannot run
code; https://pytorch.org/docs/stable/generated/torch.load.html), checks the CRC-32 of every zip member
(``torch.load`` does not), and turns any file that is not a valid checkpoint into one of four errors
naming the path: :class:`DamagedCheckpointError`, :class:`UnsafeCheckpointError`, ``FileNotFoundError``
or ``PermissionError`` (the guarantee is fuzzed: tests/test_checkpoint_fuzz.py, benchmarks/fuzz_inputs.py).

All functions are rank-agnostic; the strategy makes only global rank 0 write.
"""

from __future__ import annotations

import logging
import os
import pickle
import pickletools
import re
import socket
import tempfile
import warnings
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy._compat import lightning_private as _pl
from ddp_strategy._compat import namespace as _namespace
from ddp_strategy._compat.namespace import get_filesystem

if TYPE_CHECKING:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
else:  # built for the user's Lightning namespace on construction (see ddp_strategy._compat.namespace)
    TorchCheckpointIO = _namespace.lightning_base("fabric.plugins.io.torch_io:TorchCheckpointIO")

log = logging.getLogger(__name__)

#: The key prefix ``DistributedDataParallel`` adds to its module's state dict.
DDP_PREFIX = "module."
#: The attribute under which ``torch.compile``'s ``OptimizedModule`` keeps the original module.
COMPILE_SEGMENT = "_orig_mod"
#: At most this many keys of each kind are listed in a :class:`StateDictMismatchError` message.
MAX_LISTED_KEYS = 10
_TMP_SUFFIX = ".tmp"


# ----------------------------------------------------------------------------------------------- keys
def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile`` wrapper (``OptimizedModule``), without importing dynamo."""
    return type(module).__name__ == "OptimizedModule" and COMPILE_SEGMENT in module._modules


def _wrapped_child(module: nn.Module) -> str | None:
    """The attribute name of the module a DDP or ``torch.compile`` wrapper holds, or None for other modules."""
    if isinstance(module, DistributedDataParallel):
        return "module"
    if _is_compiled(module):
        return COMPILE_SEGMENT
    return None


def unwrapped_name(module: nn.Module, key: str) -> str:
    """``key`` of ``module.state_dict()`` without the segments DDP and ``torch.compile`` wrappers add.

    Exact: the key is followed through the module tree and a segment is dropped only where the parent
    really is a ``DistributedDataParallel`` (``module``) or an ``OptimizedModule`` (``_orig_mod``).

    Example:
        For ``DDP(torch.compile(net))``: ``"module._orig_mod.fc.weight"`` -> ``"fc.weight"``; for a model
        with a real child called ``module``: ``"module.weight"`` stays ``"module.weight"``.
    """
    parts = key.split(".")
    kept: list[str] = []
    current: nn.Module | None = module
    for i, part in enumerate(parts[:-1]):
        if current is None:
            kept.extend(parts[i:-1])
            break
        if part != _wrapped_child(current):
            kept.append(part)
        current = current._modules.get(part)
    kept.append(parts[-1])
    return ".".join(kept)


def unwrapped_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with every DDP ``module.`` and ``torch.compile`` ``_orig_mod.`` segment removed.

    A compiled sub-module inside a LightningModule, a compiled whole model and DDP/compile stacks in either
    order all give the keys of the plain, uncompiled module. See :func:`unwrapped_name`.

    Args:
        module: any module, wrapped or not.

    Returns:
        Clean name -> tensor (the same tensors as ``module.state_dict()``, in the same order).

    Raises:
        RuntimeError: two keys map to the same clean name (a sub-module literally called ``_orig_mod``).
    """
    clean: dict[str, Any] = {}
    for key, value in module.state_dict().items():
        name = unwrapped_name(module, key)
        if name in clean:
            raise RuntimeError(f"Two state_dict keys of {type(module).__name__} map to {name!r} once wrapper"
                               f" segments are removed (one is {key!r}); rename the sub-module.")
        clean[name] = value
    return clean


def strip_compile_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Remove every ``_orig_mod.`` segment (``torch.compile``'s) from every key; for files, where no model is known.

    Example:
        >>> strip_compile_prefixes({"model._orig_mod.fc.weight": 1, "_orig_mod.module.b": 2})
        {'model.fc.weight': 1, 'module.b': 2}
    """
    return {_strip_segments(key): value for key, value in state_dict.items()}


def _strip_segments(key: str) -> str:
    parts = key.split(".")
    return ".".join([part for part in parts[:-1] if part != COMPILE_SEGMENT] + parts[-1:])


def strip_ddp_prefix(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Remove a leading ``module.`` from every key when all keys carry it, as a DDP wrapper's do.

    A heuristic for when the model is not at hand: a model whose only child is really called ``module``
    would lose it. When the model is known, use :func:`match_state_dict` (exact) instead.

    Example:
        >>> strip_ddp_prefix({"module.fc.weight": 1, "module.fc.bias": 2})
        {'fc.weight': 1, 'fc.bias': 2}
    """
    if state_dict and all(key.startswith(DDP_PREFIX) for key in state_dict):
        return {key[len(DDP_PREFIX):]: value for key, value in state_dict.items()}
    return dict(state_dict)


#: Added to a :class:`StateDictMismatchError` raised by ``trainer.fit(ckpt_path=...)``.
FIT_MISMATCH_HINT = (
    "In trainer.fit, ckpt_path also resumes the optimizer state, which needs exactly the checkpoint's"
    " parameters, so strict_loading=False is not enough there: to start a fit from the matching weights, load"
    " them first with ddp_strategy.import_plain_checkpoint(ckpt_path, model, strict=False) and call"
    " trainer.fit(model) without ckpt_path (strict_loading=False does work for validate, test and predict)."
)


class StateDictMismatchError(RuntimeError):
    """A checkpoint's keys do not match the model's, after wrapper prefixes were normalised.

    Attributes:
        missing: keys the model has and the checkpoint lacks (clean names).
        unexpected: keys the checkpoint has and the model lacks (as normalised).
        mismatched_shapes: ``key -> (shape in checkpoint, shape in model)``.
    """

    def __init__(self, message: str, missing: list[str], unexpected: list[str],
                 mismatched_shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched_shapes = mismatched_shapes


def _listing(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:MAX_LISTED_KEYS])
    return shown + (f", ... and {len(keys) - MAX_LISTED_KEYS} more" if len(keys) > MAX_LISTED_KEYS else "")


def _source_variants(keys: Iterable[str], prefix: str) -> list[dict[str, str]]:
    """Candidate renamings of a file's keys: compile segments removed, then with and without DDP's prefix."""
    stripped = {key: _strip_segments(key) for key in keys}
    variants = [{key: prefix + name for key, name in stripped.items()}]
    if stripped and all(name.startswith(DDP_PREFIX) for name in stripped.values()):
        variants.append({key: prefix + name[len(DDP_PREFIX):] for key, name in stripped.items()})
    return variants


def best_key_mapping(keys: Iterable[str], model: nn.Module, prefixes: Iterable[str] = ("",)) -> dict[str, str]:
    """Map a file's keys to ``model``'s clean key names: the renaming that matches most of the model's keys.

    Candidates: every ``_orig_mod.`` segment removed, then a leading ``module.`` kept or (if every key has
    it) removed, then each of ``prefixes`` put in front. Ties go to the earlier candidate (no stripping,
    the first prefix), so a real child called ``module`` keeps its name.

    Returns:
        File key -> clean model key (possibly one the model does not have).
    """
    keys = list(keys)
    expected = {unwrapped_name(model, k) for k in model.state_dict()}
    best: dict[str, str] = {key: key for key in keys}
    best_score = -1
    for prefix in prefixes:
        for variant in _source_variants(keys, prefix):
            score = sum(name in expected for name in variant.values())
            if score > best_score:
                best, best_score = variant, score
    return best


def match_state_dict(
    state_dict: Mapping[str, Any],
    model: nn.Module,
    strict: bool = True,
    source: str | os.PathLike | None = None,
    prefixes: Iterable[str] = ("",),
) -> dict[str, Any]:
    """Rename a checkpoint's model keys to ``model``'s own, ready for ``model.load_state_dict``.

    Accepts keys with or without DDP's ``module.`` and ``torch.compile``'s ``_orig_mod.`` segments, for a
    ``model`` that is itself compiled or not (see :func:`best_key_mapping`).

    Args:
        state_dict: name -> tensor, as found in a checkpoint.
        model: the module to load into (e.g. the LightningModule).
        strict: raise when keys are missing, unexpected or of another shape (default). With False the
            matching keys are returned and the rest is skipped (Lightning: ``model.strict_loading = False``).
        source: the file, named in the error.
        prefixes: attribute paths to try in front of the file's keys (e.g. ``("", "model.")``).

    Returns:
        ``model``'s own key (with any ``_orig_mod.``) -> tensor; with ``strict=False`` only matching keys.

    Raises:
        StateDictMismatchError: ``strict`` and the keys or shapes do not match; the message lists them.
    """
    own = {unwrapped_name(model, k): (k, v) for k, v in model.state_dict().items()}
    mapping = best_key_mapping(state_dict, model, prefixes)
    matched: dict[str, Any] = {}
    unexpected: list[str] = []
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for key, value in state_dict.items():
        name = mapping[key]
        if name not in own:
            unexpected.append(name)
            continue
        target_key, target = own[name]
        if isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor) and value.shape != target.shape:
            shapes[name] = (tuple(value.shape), tuple(target.shape))
            continue
        matched[target_key] = value
    found = {mapping[k] for k in state_dict}
    missing = [name for name in own if name not in found]
    if strict and (missing or unexpected or shapes):
        where = f"Checkpoint {os.fspath(source)}" if source is not None else "The checkpoint's state_dict"
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s) (in the model, not in the file): {_listing(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s) (in the file, not in the model):"
                         f" {_listing(unexpected)}")
        if shapes:
            parts.append("shape mismatch(es) (file vs model): "
                         + ", ".join(f"{k!r}: {a} vs {b}" for k, (a, b) in list(shapes.items())[:MAX_LISTED_KEYS]))
        raise StateDictMismatchError(
            f"{where} does not fit {type(model).__name__}: " + "; ".join(parts) + ". Keys were compared after"
            " removing DDP's 'module.' and torch.compile's '_orig_mod.' prefixes. Check that the file was"
            " written for this model (same architecture and hyper-parameters); to load only the matching keys"
            " set `model.strict_loading = False` (Lightning) or pass strict=False.",
            missing, unexpected, shapes,
        )
    return matched


def normalize_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Return ``checkpoint`` with ``_orig_mod.`` segments removed from its ``"state_dict"`` keys (if any).

    Used on save where only the dict, not the model, is at hand. DDP's ``module.`` is not touched here: the
    strategy already saves the unwrapped LightningModule (see :func:`unwrapped_state_dict`), and guessing
    would rename a real child called ``module``.
    """
    if isinstance(checkpoint.get("state_dict"), Mapping):
        return {**checkpoint, "state_dict": strip_compile_prefixes(checkpoint["state_dict"])}
    return checkpoint


# ---------------------------------------------------------------------------------------------- files
class DamagedCheckpointError(ValueError):
    """A checkpoint file is truncated, corrupt or not a PyTorch checkpoint at all."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """``weights_only=True`` refused an object in the file (it could run code when unpickled)."""


#: Zip local-file-header magic: how ``torch.load`` tells its zip format from the legacy one.
_ZIP_MAGIC = b"PK\x03\x04"
#: Bytes read at a time when checking a zip member's CRC-32 (16 MiB).
_CRC_CHUNK = 1 << 24


def load_file(
    path: str | os.PathLike,
    map_location: Any = "cpu",
    weights_only: bool = True,
    verify_checksums: bool = True,
    opt_out: str = "load_file(..., weights_only=False)",
) -> Any:
    """``torch.load`` a checkpoint file, with errors that name the file, whatever bytes it holds.

    The guarantee: a file that is not a valid checkpoint raises one of the four errors below, never
    another exception type (``torch.load`` itself lets ``IndexError``, ``KeyError``, ``UnicodeDecodeError``
    ... escape on corrupt input), and the warnings ``torch.load`` emits while failing (e.g. the weights-only
    unpickler's "Detected pickle protocol") are dropped: the error says what happened. Warnings of a load
    that succeeds are passed on unchanged.

    ``torch.load`` does not check the CRC-32 its zip format stores for every member, so a flipped bit in
    tensor data loads silently as a different number. With ``verify_checksums`` each member is read once
    and checked first (about one extra read of the file; members saved with
    ``torch.serialization.set_crc32_options(False)`` store 0 and are skipped). Legacy (non-zip) files
    carry no checksum.

    Args:
        path: the file.
        map_location: as for :func:`torch.load`; default ``"cpu"``.
        weights_only: refuse to unpickle arbitrary objects (default True: an untrusted file cannot run
            code). Pass False only for files you trust.
        verify_checksums: check every zip member's CRC-32 before loading (default True).
        opt_out: how the caller's caller turns ``weights_only`` off, quoted in the
            :class:`UnsafeCheckpointError` message (each public loader passes its own call).

    Returns:
        What the file holds (any object; callers check its type).

    Raises:
        FileNotFoundError: ``path`` does not exist or is a directory (the message lists checkpoint files in it).
        PermissionError: ``path`` cannot be read by this user.
        DamagedCheckpointError: the file is truncated, corrupt or not a PyTorch checkpoint.
        UnsafeCheckpointError: ``weights_only`` and the file holds an object outside PyTorch's allow-list.
        RuntimeError: ``map_location`` names a device this machine lacks (PyTorch's own message).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if verify_checksums and f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC:
                _verify_zip_checksums(f, path, size)
    except OSError as e:
        raise _open_error(path, e) from e
    if callable(map_location):
        map_location = _TaggedMapLocation(map_location)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loaded = torch.load(path, map_location=map_location, weights_only=weights_only)
        except OSError as e:  # the file changed (removed, chmod) since it was opened above
            raise _open_error(path, e) from e
        except Exception as e:  # whatever the unpickler raised, the file is not a checkpoint we can load
            user_error = _map_location_error(e)
            if user_error is not None:
                raise user_error  # noqa: B904 (the caller's map_location failed, not the file: its own error)
            if isinstance(e, RuntimeError) and "Attempting to deserialize object on" in str(e):
                raise  # a valid file for a device this machine lacks: PyTorch's message says what to do
            raise _load_error(path, size, weights_only, e, opt_out) from e
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return loaded


class _MapLocationFailed(Exception):
    """Raised in place of an exception from the caller's ``map_location`` callable; the original is the cause."""


class _TaggedMapLocation:
    """Wraps a ``map_location`` callable so that its own failures are told apart from a damaged file's."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, storage: Any, location: str) -> Any:
        try:
            return self.fn(storage, location)
        except Exception as e:
            raise _MapLocationFailed() from e


def _map_location_error(error: BaseException) -> BaseException | None:
    """The caller's own ``map_location`` exception if ``error`` came from it (anywhere in the chain), else None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, _MapLocationFailed):
            return current.__cause__
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _open_error(path: str, error: OSError) -> OSError:
    """The error for a checkpoint path that cannot be opened: PermissionError or FileNotFoundError."""
    if isinstance(error, PermissionError):
        return PermissionError(f"Checkpoint file {path} cannot be read: permission denied for this user"
                               f" (uid {os.getuid() if hasattr(os, 'getuid') else '?'}). Make it readable"
                               " (chmod u+r) or run as its owner.")
    if os.path.isdir(path):
        try:
            found = sorted(name for name in os.listdir(path) if name.endswith((".ckpt", ".pt", ".pth")))[:5]
        except OSError:
            found = []
        return FileNotFoundError(f"Checkpoint path {path} is a directory, not a checkpoint file. Pass a file"
                                 f" inside it{f' (found {found})' if found else ''}.")
    reason = error.strerror or type(error).__name__
    return FileNotFoundError(f"Checkpoint file not found: {path} ({reason}).")


def _load_error(path: str, size: int, weights_only: bool, error: Exception, opt_out: str) -> Exception:
    """The documented error for a file ``torch.load`` failed on: unsafe content, else damaged."""
    message = str(error)
    if weights_only is not False and "Unsupported global" in message:  # None: torch.load's default, True
        first = next(line for line in message.splitlines() if "Unsupported global" in line)
        first = first.split("Unsupported global:")[-1].split(" was not")[0].strip()
        name = first.removeprefix("GLOBAL").strip()
        return UnsafeCheckpointError(
            f"Checkpoint {path} holds an object that weights_only=True loading refuses ({first}). If you"
            f" trust this file, load it with {opt_out}, or allow the type before loading (on every rank) with"
            f" torch.serialization.add_safe_globals([{name}])."
        )
    if weights_only is not False and isinstance(error, pickle.UnpicklingError) and _well_formed_zip_pickle(path):
        # A complete, well-formed pickle the weights-only unpickler cannot read (e.g. torch.save(...,
        # pickle_protocol=4), or another library's pickle inside a torch zip): not damaged, but refused.
        reason = next((line.strip() for line in message.splitlines() if "Unsupported" in line), message[:120])
        return UnsafeCheckpointError(
            f"Checkpoint {path} is a well-formed PyTorch file, but weights_only=True loading cannot read its"
            f" pickle ({reason}); torch.save(..., pickle_protocol=N) with N > 2 does this. If you trust this file,"
            f" load it with {opt_out}, or save it again with the default protocol."
        )
    if "WeightsUnpickler error:" in message:  # skip torch's long preamble about weights_only defaults
        message = message.split("WeightsUnpickler error:", 1)[1]
    detail = next((line.strip() for line in message.splitlines() if line.strip()), "")[:200]
    return DamagedCheckpointError(
        f"Checkpoint file {path} is damaged (truncated or corrupt, {size} bytes) or is not a PyTorch"
        f" checkpoint: {type(error).__name__}: {detail}. Use an earlier checkpoint or save this one again."
    )


def _well_formed_zip_pickle(path: str) -> bool:
    """Whether ``path`` is a zip whose ``data.pkl`` is one complete pickle stream (parsed, never executed)."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            data = archive.read(name)
        ops = list(pickletools.genops(data))
        return bool(ops) and ops[-1][0].name == "STOP" and ops[-1][2] + 1 == len(data)
    except Exception:  # not a zip, no data.pkl, or a malformed stream: damaged
        return False


def _verify_zip_checksums(f: Any, path: str, size: int) -> None:
    """Read every member of the zip ``f`` once and compare its CRC-32 with the stored one.

    Raises:
        DamagedCheckpointError: the zip cannot be read or a member's CRC-32 differs.
    """
    member = None
    try:
        with zipfile.ZipFile(f) as archive:
            for info in archive.infolist():
                member = info.filename
                if info.CRC == 0 and info.file_size > 0:  # written with torch's CRC-32 switched off
                    continue
                with archive.open(info) as data:
                    while data.read(_CRC_CHUNK):
                        pass
    except Exception as e:  # zipfile raises BadZipFile, EOFError, ValueError, struct.error, ... on bad bytes
        where = f" (member {member})" if member else ""
        raise DamagedCheckpointError(
            f"Checkpoint file {path} is damaged (truncated or corrupt, {size} bytes): its zip structure or a"
            f" checksum does not check out{where}: {type(e).__name__}: {str(e)[:200]}. Use an earlier"
            " checkpoint or save this one again."
        ) from e


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


def load_plain_state_dict(path: str | os.PathLike, submodule: str = "model",
                          weights_only: bool = True) -> dict[str, torch.Tensor]:
    """Load the weights of one sub-module from a checkpoint, ready for the plain ``nn.Module``.

    Works for Lightning checkpoints (weights under ``"state_dict"``), plain PyTorch files holding a
    ``"model_state_dict"`` or ``"model"`` entry, and bare state dicts, with or without DDP's ``module.``
    and ``torch.compile``'s ``_orig_mod.`` segments. Loads with ``torch.load(weights_only=True)``; needs no
    Lightning at the call site beyond this package. With the model at hand,
    :func:`ddp_strategy.checkpoint.convert.import_plain_checkpoint` matches keys exactly and strictly.

    Args:
        path: checkpoint file.
        submodule: attribute name of the plain model inside the LightningModule (``"model"`` for
            :class:`~ddp_strategy.reference.model.DigitsClassifier`); ``""`` returns the whole state dict.
        weights_only: load with ``torch.load(weights_only=True)`` (default); False only for files you trust
            (e.g. a checkpoint whose hyper-parameters hold an ``nn.Module``).

    Returns:
        Parameter and buffer name -> tensor, keys without ``module.``, ``_orig_mod.`` or ``<submodule>.``.

    Raises:
        FileNotFoundError, PermissionError, DamagedCheckpointError, UnsafeCheckpointError: see
            :func:`load_file` and :func:`find_model_state_dict`.
        KeyError: a valid state dict, but no key starts with ``<submodule>.``; the message lists a few keys.
    """
    checkpoint = load_file(path, weights_only=weights_only, opt_out="load_plain_state_dict(..., weights_only=False)")
    return plain_state_dict(checkpoint, path, submodule)


def plain_state_dict(checkpoint: Any, path: str | os.PathLike, submodule: str = "model") -> dict[str, torch.Tensor]:
    """The part of :func:`load_plain_state_dict` after loading: find, clean and pick ``submodule``'s weights.

    Args:
        checkpoint: a loaded checkpoint (see :func:`find_model_state_dict`).
        path: the file it came from (for error messages).
        submodule: see :func:`load_plain_state_dict`.

    Raises:
        ValueError, KeyError: see :func:`find_model_state_dict` and :func:`load_plain_state_dict`.
    """
    state_dict = find_model_state_dict(checkpoint, path)
    state_dict = strip_ddp_prefix(strip_compile_prefixes(state_dict))
    if not submodule:
        return dict(state_dict)
    prefix = submodule + "."
    picked = {key[len(prefix):]: value for key, value in state_dict.items() if key.startswith(prefix)}
    if not picked:
        raise KeyError(
            f"No key in {os.fspath(path)} starts with {prefix!r}; found e.g. {list(state_dict)[:5]}."
            " Pass submodule='' for the whole state dict, or the attribute name of your model."
        )
    return picked


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


#: Entries under which checkpoints keep the model's state dict, in the order they are looked for.
MODEL_STATE_KEYS = ("state_dict", "model_state_dict", "model")


def find_model_state_dict(checkpoint: Any, path: str | os.PathLike | None = None) -> Mapping[str, Any]:
    """The model state dict inside a loaded checkpoint: a :data:`MODEL_STATE_KEYS` entry, or the dict itself.

    Raises:
        DamagedCheckpointError: (a ``ValueError``) no such entry and the dict is not a state dict (its values
            are not all tensors), or the checkpoint is not a dict at all, or a state-dict key is not a string.
    """
    where = os.fspath(path) if path else "the checkpoint"
    state_dict: Mapping[str, Any] | None = None
    if isinstance(checkpoint, Mapping):
        for key in MODEL_STATE_KEYS:
            if isinstance(checkpoint.get(key), Mapping):
                state_dict = checkpoint[key]
                break
        else:
            if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
                state_dict = checkpoint
    if state_dict is None:
        found = [repr(k)[:40] for k in list(checkpoint)[:10]] if isinstance(checkpoint, Mapping) else (
            f"a {type(checkpoint).__name__}")
        raise DamagedCheckpointError(f"No model state dict in {where}: expected one of the entries"
                                     f" {list(MODEL_STATE_KEYS)} or a dict of tensors, found {found}.")
    odd = next((k for k in state_dict if not isinstance(k, str)), None)
    if odd is not None:
        raise DamagedCheckpointError(f"The model state dict in {where} has a key that is not a string:"
                                     f" {odd!r} ({type(odd).__name__}); state-dict keys are parameter names."
                                     " Is this file a checkpoint?")
    return state_dict


class DDPCheckpointIO(TorchCheckpointIO):
    """Lightning's :class:`~lightning.fabric.plugins.io.torch_io.TorchCheckpointIO`, crash-safe and safe to load.

    ``save_checkpoint`` writes local files with :func:`atomic_save` and model keys without ``_orig_mod.``;
    ``load_checkpoint`` loads with ``weights_only=True`` unless told otherwise and reports damaged files
    clearly (:func:`load_file`). Remote paths (fsspec URLs) are Lightning's. Rank-agnostic: the strategy
    calls ``save_checkpoint`` on global rank 0 only.

    Args:
        weights_only: what ``load_checkpoint(weights_only=None)`` uses (default True). An explicit
            ``Trainer.fit(ckpt_path=..., weights_only=False)`` still opts out for one load.
        verify_checksums: check the CRC-32 of every zip member before loading (default True; see
            :func:`load_file`): costs about one extra read of the file, catches flipped bits in tensor data.

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
        """Save ``checkpoint`` to ``path`` atomically (see :func:`atomic_save`).

        Raises:
            TypeError: ``storage_options`` is given (not supported by this plugin, as in Lightning's).
        """
        checkpoint = normalize_checkpoint(checkpoint)
        if not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not support storage_options; got {storage_options!r}.")
        atomic_save(checkpoint, path)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Callable | Any = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint; ``weights_only=None`` means this plugin's default (True).

        Local files: whatever the file holds, the result is a checkpoint dict or one of the errors below.

        Raises:
            FileNotFoundError, PermissionError, DamagedCheckpointError, UnsafeCheckpointError: see
                :func:`load_file`; ``DamagedCheckpointError`` also when the file holds something other than a
                dict (a list, a tensor, ...), which no Lightning checkpoint is.
        """
        weights_only = self.weights_only if weights_only is None else weights_only
        if not _is_local(path):
            return _pl.load_checkpoint_with_weights_only(super().load_checkpoint, path, map_location, weights_only)
        checkpoint = load_file(path, map_location=map_location, weights_only=weights_only,
                               verify_checksums=self.verify_checksums, opt_out=LOAD_OPT_OUT)
        if not isinstance(checkpoint, dict):
            raise DamagedCheckpointError(f"Checkpoint file {os.fspath(path)} holds a {type(checkpoint).__name__},"
                                         " not a checkpoint dict; it was not written by Trainer.save_checkpoint."
                                         " Pass the .ckpt file Lightning saved.")
        return checkpoint


#: How a user of the Trainer opts out of ``weights_only=True`` for one file, or for every load.
LOAD_OPT_OUT = ("weights_only=False in the Trainer call that loads it (trainer.fit(model, ckpt_path=...,"
                " weights_only=False); also validate, test and predict), or for every load"
                " MyDDPStrategy(checkpoint_io=DDPCheckpointIO(weights_only=False))")


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


def _is_local(path: Any) -> bool:
    if isinstance(path, (str, os.PathLike)) and "://" not in os.fspath(path):
        return True
    return type(get_filesystem(path)).__name__ == "LocalFileSystem"
