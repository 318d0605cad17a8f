"""Safe, clearly failing checkpoint loads.

:func:`load_file` uses ``torch.load(weights_only=True)`` by default (an untrusted file cannot run
code; https://pytorch.org/docs/stable/generated/torch.load.html), checks the CRC-32 of every zip member
(``torch.load`` does not), and turns any file that is not a valid checkpoint into one of four errors
naming the path: :class:`DamagedCheckpointError`, :class:`UnsafeCheckpointError`, ``FileNotFoundError``
or ``PermissionError`` (the guarantee is fuzzed: tests/checkpoint/test_checkpoint_fuzz.py,
benchmarks/fuzz_inputs.py). Rank-agnostic.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import warnings
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddp_strategy.checkpoint.keys import strip_compile_prefixes, strip_ddp_prefix


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


#: How a user of the Trainer opts out of ``weights_only=True`` for one file, or for every load.
LOAD_OPT_OUT = ("weights_only=False in the Trainer call that loads it (trainer.fit(model, ckpt_path=...,"
                " weights_only=False); also validate, test and predict), or for every load"
                " MyDDPStrategy(checkpoint_io=DDPCheckpointIO(weights_only=False))")
