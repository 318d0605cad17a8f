"""Checkpoint keys without wrapper segments, and exact matching of a file's keys to a model's. Rank-agnostic.

DDP adds ``module.`` to every key, ``torch.compile`` ``_orig_mod.`` wherever it wraps a module: checkpoints are
written without them (:func:`unwrapped_state_dict`), and loading renames a file's keys to the model's own
(:func:`match_state_dict`) or raises one :class:`StateDictMismatchError` listing the rest.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy._compat import torch_private as _torch

#: The key prefix ``DistributedDataParallel`` adds to its module's state dict.
DDP_PREFIX = "module."
#: At most this many keys of each kind are listed in a :class:`StateDictMismatchError` message.
MAX_LISTED_KEYS = 10


def unwrapped_name(module: nn.Module, key: str) -> str:
    """``key`` of ``module.state_dict()`` without the segments DDP and ``torch.compile`` wrappers add, dropped only
    where the parent really is one: for ``DDP(torch.compile(net))`` ``"module._orig_mod.fc.weight"`` ->
    ``"fc.weight"``; a real child called ``module`` stays."""
    *path, leaf = key.split(".")
    kept: list[str] = []
    current: nn.Module | None = module  # None below a segment that names no child module
    for part in path:
        if not (  # the segment a wrapper adds: DDP's module., torch.compile's _orig_mod.
            (part == "module" and isinstance(current, DistributedDataParallel))
            or (part == _torch.COMPILE_SEGMENT and _torch.compiled_original(current) is not None)
        ):
            kept.append(part)
        current = dict(current.named_children()).get(part) if current is not None else None
    return ".".join([*kept, leaf])


def unwrapped_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` (same tensors, same order) with every wrapper segment removed (:func:`unwrapped_name`).

    Names stay distinct: a segment is dropped only below a DDP or ``torch.compile`` wrapper, whose one child it names
    and which holds no state of its own.
    """
    return {unwrapped_name(module, key): value for key, value in module.state_dict().items()}


def _without_compile_segments(key: str) -> str:
    parts = key.split(".")
    return ".".join([part for part in parts[:-1] if part != _torch.COMPILE_SEGMENT] + parts[-1:])


def strip_compile_prefixes(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Remove every ``_orig_mod.`` segment (``torch.compile``'s) from every key, for files (no model known):
    ``{"model._orig_mod.fc.weight": 1, "_orig_mod.module.b": 2}`` -> ``{"model.fc.weight": 1, "module.b": 2}``."""
    return {_without_compile_segments(key): value for key, value in state_dict.items()}


def strip_ddp_prefix(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Remove a leading ``module.`` from every key when all keys carry it, as a DDP wrapper's do: a heuristic for
    when the model is not at hand; with the model, use :func:`match_state_dict` (exact).

    Example:
        >>> strip_ddp_prefix({"module.fc.weight": 1, "module.fc.bias": 2})
        {'fc.weight': 1, 'fc.bias': 2}
    """
    if state_dict and all(key.startswith(DDP_PREFIX) for key in state_dict):
        return {key[len(DDP_PREFIX) :]: value for key, value in state_dict.items()}
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

    def __init__(
        self,
        message: str,
        missing: list[str],
        unexpected: list[str],
        mismatched_shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        super().__init__(message)
        self.missing, self.unexpected, self.mismatched_shapes = missing, unexpected, mismatched_shapes


def _best_key_mapping(keys: list[str], expected: set[str], prefixes: Iterable[str]) -> dict[str, str]:
    """File key -> clean model key: of the renamings (``_orig_mod.`` removed, a leading ``module.`` kept or, if
    every key has it, removed, each of ``prefixes`` in front) the one matching most of ``expected``; ties go to
    the earlier (no stripping, the first prefix), so a real child called ``module`` keeps its name."""
    stripped = {key: _without_compile_segments(key) for key in keys}
    ddp = bool(stripped) and all(name.startswith(DDP_PREFIX) for name in stripped.values())
    variants = (
        {key: prefix + name[cut:] for key, name in stripped.items()}
        for prefix in prefixes
        for cut in ((0, len(DDP_PREFIX)) if ddp else (0,))
    )
    return max(variants, key=lambda v: sum(name in expected for name in v.values()), default={key: key for key in keys})


def match_state_dict(
    state_dict: Mapping[str, Any],
    model: nn.Module,
    strict: bool = True,
    source: str | os.PathLike | None = None,
    prefixes: Iterable[str] = ("",),
) -> dict[str, Any]:
    """Rename a checkpoint's model keys (with or without ``module.``, ``_orig_mod.``) to ``model``'s own (compiled or
    not), ready for ``model.load_state_dict`` (:func:`_best_key_mapping`).

    Args:
        state_dict: name -> tensor, as found in a checkpoint; model: the module to load into.
        strict: raise when keys are missing, unexpected or of another shape (default); False skips missing and
            unexpected keys only (Lightning: ``model.strict_loading = False``), as torch's ``strict=False`` does: a
            tensor of another shape is returned, and ``model.load_state_dict`` raises torch's ``RuntimeError``
            ``size mismatch for <key>`` (under Lightning's ``ddp`` too).
        source: the file, named in the error; prefixes: attribute paths to try in front of the file's keys.

    Returns:
        ``model``'s own key (with any ``_orig_mod.``) -> tensor; with ``strict=False`` only keys the model has.

    Raises:
        StateDictMismatchError: ``strict`` and the keys or shapes do not match; the message lists them, a shape as
            torch does (``size mismatch for <key>``).
    """
    own = {unwrapped_name(model, k): (k, v) for k, v in model.state_dict().items()}  # clean name -> (key, value)
    mapping = _best_key_mapping(list(state_dict), set(own), prefixes)  # file key -> clean name
    found = {mapping[key]: value for key, value in state_dict.items() if mapping[key] in own}  # clean name -> value
    unexpected = [name for name in mapping.values() if name not in own]
    missing = [name for name in own if name not in found]
    shapes = {
        name: (tuple(value.shape), tuple(own[name][1].shape))
        for name, value in found.items()
        if isinstance(value, torch.Tensor)
        and isinstance(own[name][1], torch.Tensor)
        and value.shape != own[name][1].shape
    }
    if strict and (missing or unexpected or shapes):
        where = f"Checkpoint {os.fspath(source)}" if source is not None else "The checkpoint's state_dict"
        listed = {
            "missing key(s) (in the model, not in the file)": [repr(k) for k in missing],
            "unexpected key(s) (in the file, not in the model)": [repr(k) for k in unexpected],
            "key(s) of another shape": [
                f"size mismatch for {k}: {a} in the file, {b} in the model" for k, (a, b) in shapes.items()
            ],
        }
        parts = [
            f"{len(items)} {what}: {', '.join(items[:MAX_LISTED_KEYS])}"
            + (f", ... and {len(items) - MAX_LISTED_KEYS} more" if len(items) > MAX_LISTED_KEYS else "")
            for what, items in listed.items()
            if items
        ]
        raise StateDictMismatchError(
            f"{where} does not fit {type(model).__name__}: " + "; ".join(parts) + ". Keys were compared after"
            " removing DDP's 'module.' and torch.compile's '_orig_mod.' prefixes. Check that the file was"
            " written for this model (same architecture and hyper-parameters); to load only the matching keys"
            " set `model.strict_loading = False` (Lightning) or pass strict=False"
            + (
                " (that skips missing and unexpected keys only: a tensor of another shape raises, as in torch)."
                if shapes
                else "."
            ),
            missing,
            unexpected,
            shapes,
        )
    return {own[name][0]: value for name, value in found.items()}
