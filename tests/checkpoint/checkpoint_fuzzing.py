"""Damaged-checkpoint inputs and an outcome classifier for tests/checkpoint/test_checkpoint_fuzz.py (a bounded, seeded
Hypothesis run; benchmarks/fuzz_inputs.py runs it with more examples). A module of its own: the unreadable-file
case re-imports it in an unprivileged child process.

Every loader gets the same file; an outcome is "documented" when the loader raised an error its docstring
promises for that input, "loaded" when it returned (only fine when the file still holds a valid checkpoint
with the original content), and anything else (another exception type, or a warning) is a failure.
"""

from __future__ import annotations

import io
import os
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

from ddp_strategy import (
    DamagedCheckpointError,
    DDPCheckpointIO,
    DigitsClassifier,
    StateDictMismatchError,
    UnsafeCheckpointError,
    export_weights,
    import_plain_checkpoint,
    load_plain_state_dict,
)

#: The four errors a file that is not a valid checkpoint may raise (README "Checkpoints").
FILE_ERRORS = (DamagedCheckpointError, UnsafeCheckpointError, FileNotFoundError, PermissionError)


def reference_checkpoint() -> bytes:
    """A small valid Lightning-style checkpoint (zip format), as bytes: DigitsClassifier weights, epoch, optimizer."""
    torch.manual_seed(0)
    model = DigitsClassifier(hidden_size=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(2, 64)).sum().backward()
    optimizer.step()
    buffer = io.BytesIO()
    torch.save(
        {
            "state_dict": model.state_dict(),
            "epoch": 2,
            "global_step": 7,
            "optimizer_states": [optimizer.state_dict()],
            "optimizer_state_dict": optimizer.state_dict(),
        },
        buffer,
    )
    return buffer.getvalue()


def _loaders(out_dir: Path) -> dict[str, Callable[[Path], Any]]:
    return {
        "DDPCheckpointIO.load_checkpoint": lambda p: DDPCheckpointIO().load_checkpoint(p),
        "load_plain_state_dict": lambda p: load_plain_state_dict(p),
        "import_plain_checkpoint": lambda p: import_plain_checkpoint(p, DigitsClassifier(hidden_size=4)),
        "export_weights": lambda p: export_weights(p, out_dir / "exported.pt"),
    }


#: Errors a loader documents for a file that IS a checkpoint but not one for this model or sub-module.
_MISMATCH_ERRORS: dict[str, tuple[type[BaseException], ...]] = {
    "DDPCheckpointIO.load_checkpoint": (),
    "load_plain_state_dict": (KeyError,),
    "import_plain_checkpoint": (StateDictMismatchError,),
    "export_weights": (KeyError,),
}

LOADERS = tuple(_MISMATCH_ERRORS)


def outcomes(path: Path, out_dir: Path) -> dict[str, str]:
    """Run every loader on ``path``; return loader name -> outcome.

    Outcomes: ``"documented: <ErrorType>"``, ``"loaded"``, or ``"OTHER: <ErrorType>: <message>"`` (a failure;
    a warning counts as one too, since warnings are turned into errors here).
    """
    result = {}
    for name, load in _loaders(out_dir).items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                load(path)
            result[name] = "loaded"
        except FILE_ERRORS + _MISMATCH_ERRORS[name] as e:
            named = str(path) in str(e) or isinstance(e, KeyError | StateDictMismatchError)
            result[name] = f"documented: {type(e).__name__}" if named else f"OTHER: path not named: {e}"
        except Exception as e:  # the failure this harness exists to find
            result[name] = f"OTHER: {type(e).__name__}: {str(e)[:200]}"
    return result


def loads_unchanged(path: Path, original: bytes) -> bool:
    """Whether ``path`` loads to exactly what ``original`` holds (e.g. a flipped bit in zip padding)."""

    def tree_equal(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a, b)
            )
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(tree_equal(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(tree_equal(x, y) for x, y in zip(a, b, strict=True))
        return type(a) is type(b) and a == b

    try:
        loaded = torch.load(path, weights_only=True)
    except Exception:
        return False
    return tree_equal(loaded, torch.load(io.BytesIO(original), weights_only=True))


# ------------------------------------------------------------------------------------------ inputs
def flip_bit(data: bytes, position: int, bit: int) -> bytes:
    """``data`` with bit ``bit`` (0-7) of byte ``position`` inverted."""
    changed = bytearray(data)
    changed[position] ^= 1 << bit
    return bytes(changed)


def rewrite_zip(data: bytes, member_index: int, replacement: bytes | None) -> bytes:
    """The zip ``data`` with member ``member_index`` dropped (``None``) or its content replaced (valid CRC)."""
    source = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as target:
        for i, info in enumerate(source.infolist()):
            if i != member_index:
                target.writestr(info, source.read(info))
            elif replacement is not None:
                target.writestr(info, replacement)
    return out.getvalue()


def zip_members(data: bytes) -> int:
    """How many members the zip ``data`` has."""
    return len(zipfile.ZipFile(io.BytesIO(data)).infolist())


def zip_member_names(data: bytes) -> list[str]:
    """The member names of the zip ``data``, in order."""
    return zipfile.ZipFile(io.BytesIO(data)).namelist()


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=12),
)
_tensors = st.builds(
    lambda shape, fill: torch.full(shape, fill), st.lists(st.integers(0, 3), max_size=3).map(tuple), st.floats(-10, 10)
)
_keys = st.one_of(
    st.sampled_from(
        [
            "state_dict",
            "model_state_dict",
            "model",
            "epoch",
            "global_step",
            "step",
            "optimizer_state_dict",
            "model.layers.0.weight",
            "layers.0.weight",
            "module.layers.0.weight",
            "params",
            "state",
            "param_groups",
        ]
    ),
    st.text(max_size=8),
    st.integers(-3, 3),
)
#: Objects ``torch.save`` can write and ``weights_only=True`` loads back: nested dicts and lists of
#: scalars and tensors, shaped like checkpoints (their keys) but with the wrong types in the wrong places.
wrong_objects = st.recursive(
    st.one_of(_scalars, _tensors),
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(_keys, children, max_size=5)),
    max_leaves=12,
)


def saved(obj: Any) -> bytes:
    """``torch.save(obj)`` as bytes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def write(folder: Path, data: bytes, name: str = "input.ckpt") -> Path:
    path = folder / name
    path.write_bytes(data)
    return path


def _drop_file_permission_override() -> None:
    """In a forked child, before exec: drop CAP_DAC_OVERRIDE (1) and CAP_DAC_READ_SEARCH (2) for good."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # 24 = PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def unreadable_outcomes(data: bytes) -> dict[str, str]:
    """Loader outcomes for a file this user cannot read (chmod 000).

    Root ignores permission bits through the capabilities CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so as
    root the loaders run in a child process that drops both from its bounding set before exec (the child is
    still root, and still owns the file, but now mode 000 denies it). The file lies in a fresh folder under
    the system temp folder, removed afterwards.
    """
    import json
    import shutil
    import subprocess
    import sys
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="ddp_unreadable_"))
    try:
        path = write(folder, data, "unreadable.ckpt")
        path.chmod(0)
        if os.geteuid() != 0:
            return outcomes(path, folder)
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        code = (
            "import json, sys; sys.path.insert(0, sys.argv[3]); from pathlib import Path;"
            " from checkpoint_fuzzing import outcomes;"
            " print(json.dumps(outcomes(Path(sys.argv[1]), Path(sys.argv[2]))))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, str(path), str(folder), tests_dir],
            preexec_fn=_drop_file_permission_override,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the unprivileged child failed: {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
