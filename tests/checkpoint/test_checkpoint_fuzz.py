"""Any file that is not a valid checkpoint gives one of the four documented errors, in every loader (seeded fuzz).

Hypothesis runs derandomized (a fixed seed) with a bounded number of examples, so the suite is deterministic;
benchmarks/fuzz_inputs.py runs these tests with many more examples (``DDP_FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from checkpoint_fuzzing import (
    LOADERS,
    flip_bit,
    loads_unchanged,
    outcomes,
    reference_checkpoint,
    rewrite_zip,
    saved,
    unreadable_outcomes,
    write,
    wrong_objects,
    zip_member_names,
    zip_members,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddp_strategy import DamagedCheckpointError, DDPCheckpointIO, UnsafeCheckpointError

GOOD = reference_checkpoint()
FUZZ = settings(
    max_examples=int(os.environ.get("DDP_FUZZ_EXAMPLES", "25")),
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _only_documented(result: dict[str, str], allow_loaded: bool = False) -> None:
    for loader, outcome in result.items():
        assert outcome.startswith("documented") or (allow_loaded and outcome == "loaded"), (loader, outcome)


@pytest.fixture(scope="module")
def scratch():
    """One folder for the module (Hypothesis calls a test many times per pytest test; tmp_path is per test)."""
    with tempfile.TemporaryDirectory(prefix="ddp_fuzz_") as folder:
        yield Path(folder)


def test_the_reference_checkpoint_loads_in_every_loader(scratch):
    """The unchanged file loads everywhere: the fuzz below starts from a valid checkpoint."""
    assert outcomes(write(scratch, GOOD), scratch) == dict.fromkeys(LOADERS, "loaded")


@FUZZ
@given(data=st.binary(max_size=4096))
def test_random_bytes(scratch, data):
    """Random bytes (the old os.urandom test, now seeded) are damaged or unsafe, never IndexError/KeyError."""
    _only_documented(outcomes(write(scratch, data), scratch))


@FUZZ
@given(length=st.integers(0, len(GOOD) - 1))
def test_truncation_at_any_length(scratch, length):
    """A checkpoint cut anywhere is reported as damaged by every loader."""
    _only_documented(outcomes(write(scratch, GOOD[:length]), scratch))


@FUZZ
@given(position=st.integers(0, len(GOOD) - 1), bit=st.integers(0, 7))
def test_single_bit_flips(scratch, position, bit):
    """One flipped bit anywhere: a documented error, or (padding bytes) a load of exactly the original content."""
    path = write(scratch, flip_bit(GOOD, position, bit))
    result = outcomes(path, scratch)
    if any(outcome == "loaded" for outcome in result.values()):
        assert loads_unchanged(path, GOOD), (position, bit, result)
    _only_documented(result, allow_loaded=True)


@FUZZ
@given(member=st.integers(0, zip_members(GOOD) - 1), replacement=st.none() | st.binary(max_size=64))
def test_zip_with_a_missing_or_rewritten_member(scratch, member, replacement):
    """A member removed, or its content replaced (with a matching CRC-32), gives a documented error.

    Exceptions that are still valid checkpoints: torch treats some members as optional (``.format_version``,
    ``byteorder``, ...), so removing one may load the original content; and new bytes of the right length for
    a tensor's storage (or ``byteorder``) are a valid checkpoint with other numbers.
    """
    path = write(scratch, rewrite_zip(GOOD, member, replacement))
    result = outcomes(path, scratch)
    if any(outcome == "loaded" for outcome in result.values()):
        name = zip_member_names(GOOD)[member]
        assert loads_unchanged(path, GOOD) or (
            replacement is not None and ("/data/" in name or name.endswith("byteorder"))
        ), (name, result)
    _only_documented(result, allow_loaded=True)


@FUZZ
@given(obj=wrong_objects)
def test_valid_pickles_of_the_wrong_type(scratch, obj):
    """torch.save of nested lists/dicts/scalars/tensors shaped like checkpoints but wrong: documented errors only."""
    result = outcomes(write(scratch, saved(obj)), scratch)
    # A dict can be a real (if odd) checkpoint; DDPCheckpointIO then returns it, which is Lightning's behaviour.
    _only_documented(result, allow_loaded=isinstance(obj, dict))


def test_missing_file_directory_and_unreadable_file(scratch):
    """A missing path and a directory raise FileNotFoundError, an unreadable file PermissionError, in every loader."""
    assert outcomes(scratch / "nope.ckpt", scratch) == dict.fromkeys(LOADERS, "documented: FileNotFoundError")
    folder = scratch / "a_folder.ckpt"
    folder.mkdir()
    assert outcomes(folder, scratch) == dict.fromkeys(LOADERS, "documented: FileNotFoundError")
    assert unreadable_outcomes(GOOD) == dict.fromkeys(LOADERS, "documented: PermissionError")


def test_errors_that_are_not_about_the_file_pass_through(scratch):
    """A failing map_location callable raises its own error, not DamagedCheckpointError; so does a missing device."""
    from ddp_strategy.checkpoint.io import load_file

    path = write(scratch, GOOD)

    def refuse(storage, location):
        raise ZeroDivisionError("my map_location failed")

    with pytest.raises(ZeroDivisionError, match="my map_location failed"):
        load_file(path, map_location=refuse)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device"):
            load_file(path, map_location="cuda")


def test_a_map_location_callable_gets_torchs_own_errors_and_a_device_the_documented_ones(scratch):
    """Bytes that are no checkpoint: with a map_location callable DDPCheckpointIO raises torch.load's own error,
    as Lightning's TorchCheckpointIO does (docs/differences.md, "corrupt checkpoint files"); with a device, the
    default "cpu" as the alternative, the documented DamagedCheckpointError naming the file."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    path = write(scratch, b"not a checkpoint at all")
    for io in (TorchCheckpointIO(), DDPCheckpointIO()):
        with pytest.raises(pickle.UnpicklingError) as raised:
            io.load_checkpoint(path, map_location=lambda storage, location: storage)
        assert not isinstance(raised.value, UnsafeCheckpointError), type(io).__name__
    for device in ("cpu", torch.device("cpu")):
        with pytest.raises(DamagedCheckpointError, match=rf"{path} is damaged"):
            DDPCheckpointIO().load_checkpoint(path, map_location=device)
    with pytest.raises(DamagedCheckpointError, match=rf"{path} is damaged"):
        DDPCheckpointIO().load_checkpoint(path)


def test_a_pickle_weights_only_cannot_read_is_unsafe_not_damaged(scratch):
    """torch.save(pickle_protocol=4): a sound file weights_only=True cannot read gives UnsafeCheckpointError."""
    path = scratch / "protocol4.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}}, path, pickle_protocol=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "Detected pickle protocol 4" warning must not leak
        with pytest.raises(
            UnsafeCheckpointError,
            match=r"protocol4.ckpt holds a pickle of protocol 4 that weights_only=True .*weights_only=False",
        ):
            DDPCheckpointIO().load_checkpoint(path)
    assert torch.equal(DDPCheckpointIO(weights_only=False).load_checkpoint(path)["state_dict"]["w"], torch.ones(2))


def test_warnings_of_a_successful_load_are_passed_on(scratch, monkeypatch):
    """Only a failed load's warnings are dropped: one torch.load emits while succeeding reaches the caller."""
    path = write(scratch, GOOD)
    real_load = torch.load

    def warning_load(*args, **kwargs):
        warnings.warn("torch says something about this file", UserWarning, stacklevel=2)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", warning_load)
    with pytest.warns(UserWarning, match="torch says something about this file"):
        assert "state_dict" in DDPCheckpointIO().load_checkpoint(path)
