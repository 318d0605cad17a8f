"""Plain PyTorch checkpoints in (:func:`import_plain_checkpoint`), plain model weights out
(:func:`load_plain_state_dict`, :func:`export_weights`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ddp_strategy._compat import namespace as _namespace
from ddp_strategy.checkpoint.io import DamagedCheckpointError, atomic_save, load_file
from ddp_strategy.checkpoint.keys import (
    match_state_dict,
    strip_compile_prefixes,
    strip_ddp_prefix,
    unwrapped_name,
    unwrapped_state_dict,
)

log = logging.getLogger(__name__)

#: Entries under which checkpoints keep the model's state dict, in the order they are looked for.
MODEL_STATE_KEYS = ("state_dict", "model_state_dict", "model")
#: Entries under which plain checkpoints keep the optimizer's state dict, in the order they are looked for.
OPTIMIZER_STATE_KEYS = ("optimizer_state_dict", "optimizer")


def find_model_state_dict(checkpoint: Any, where: str | os.PathLike) -> Mapping[str, Any]:
    """The model state dict inside a checkpoint loaded from ``where`` (named in errors): a :data:`MODEL_STATE_KEYS`
    entry, or the dict itself if it holds tensors only; else, or for a key that is not a string,
    ``DamagedCheckpointError``."""
    where = os.fspath(where)
    if not isinstance(checkpoint, Mapping):
        raise DamagedCheckpointError(
            f"No model state dict in {where}: expected a dict, found a {type(checkpoint).__name__}."
        )
    bare = checkpoint if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()) else None
    state_dict = next((checkpoint[k] for k in MODEL_STATE_KEYS if isinstance(checkpoint.get(k), Mapping)), bare)
    if state_dict is None:
        raise DamagedCheckpointError(
            f"No model state dict in {where}: expected one of the entries {list(MODEL_STATE_KEYS)} or a dict of"
            f" tensors, found {[repr(k)[:40] for k in list(checkpoint)[:10]]}."
        )
    if (odd := next((k for k in state_dict if not isinstance(k, str)), None)) is not None:
        raise DamagedCheckpointError(
            f"The model state dict in {where} has a key that is not a string:"
            f" {odd!r} ({type(odd).__name__}); state-dict keys are parameter names."
            " Is this file a checkpoint?"
        )
    return state_dict


def plain_state_dict(checkpoint: Any, path: str | os.PathLike, submodule: str = "model") -> dict[str, torch.Tensor]:
    """:func:`load_plain_state_dict` for a checkpoint already loaded from ``path`` (named in errors)."""
    return _submodule_weights(
        strip_ddp_prefix(strip_compile_prefixes(find_model_state_dict(checkpoint, path))), submodule, os.fspath(path)
    )


def _submodule_weights(state_dict: Mapping[str, Any], submodule: str, where: str) -> dict[str, Any]:
    """The entries under ``<submodule>.``, that prefix removed (all of them for ``""``); else ``KeyError``."""
    prefix = submodule + "." if submodule else ""
    picked = {key[len(prefix) :]: value for key, value in state_dict.items() if key.startswith(prefix)}
    if not picked:
        raise KeyError(
            f"No key in {where} starts with {prefix!r}; found e.g. {list(state_dict)[:5]}."
            " Pass submodule='' for the whole state dict, or the attribute name of your model."
        )
    return picked


def load_plain_state_dict(
    path: str | os.PathLike, submodule: str = "model", weights_only: bool = True
) -> dict[str, torch.Tensor]:
    """Load the weights of one sub-module from a checkpoint (Lightning's, a plain PyTorch file or a bare state dict,
    with or without ``module.``/``_orig_mod.``), ready for the plain ``nn.Module``.

    Args:
        path: checkpoint file.
        submodule: attribute of the plain model in the LightningModule (``"model"`` for
            :class:`~ddp_strategy.reference.model.DigitsClassifier`); ``""`` returns the whole state dict.
        weights_only: load with ``torch.load(weights_only=True)`` (default); False only for files you trust.

    Returns:
        Parameter and buffer name -> tensor, keys without ``module.``, ``_orig_mod.`` or ``<submodule>.``.

    Raises:
        FileNotFoundError, PermissionError, DamagedCheckpointError, UnsafeCheckpointError: see
            :func:`~ddp_strategy.checkpoint.io.load_file`; KeyError: no key starts with ``<submodule>.``.
    """
    return plain_state_dict(
        load_file(path, weights_only=weights_only, opt_out="load_plain_state_dict(..., weights_only=False)"),
        path,
        submodule,
    )


def _int_entry(checkpoint: Mapping[str, Any], keys: tuple[str, ...], source: str) -> int:
    """The first of ``keys`` in ``checkpoint`` as an int >= 0 (0 if none is); else ``DamagedCheckpointError``."""
    key = next((k for k in keys if k in checkpoint), None)
    value = checkpoint[key] if key is not None else 0
    try:
        number = int(value)
        if number < 0 or not (number == value or isinstance(value, str)):  # "3" is 3; -1 and 2.5 are refused
            raise ValueError("not a whole number >= 0")
    except (TypeError, ValueError, OverflowError, RuntimeError) as e:  # RuntimeError: a tensor of many values
        raise DamagedCheckpointError(
            f"The {key!r} entry of {source} is {value!r:.80}; expected a whole number >= 0."
        ) from e
    return number


def _check_optimizer_lines_up(optimizer_state: Mapping[str, Any], params: list[torch.Tensor], source: str) -> None:
    """``DamagedCheckpointError`` unless laid out as ``Optimizer.state_dict()`` writes it, ``ValueError`` unless each
    per-parameter tensor has the shape of the parameter at its position."""
    groups, state = optimizer_state["param_groups"], optimizer_state["state"]
    if not (
        isinstance(groups, (list, tuple))
        and isinstance(state, Mapping)
        and all(
            isinstance(g, Mapping)
            and isinstance(g.get("params"), (list, tuple))
            and all(isinstance(i, int) for i in g["params"])
            for g in groups
        )
        and all(isinstance(v, Mapping) for v in state.values())
    ):
        raise DamagedCheckpointError(
            f"The optimizer state in {source} is not laid out as torch.optim.Optimizer.state_dict() writes it"
            " ('param_groups': a list of dicts with a 'params' list of ints, 'state': a dict of dicts). Is the"
            " file damaged or written by something else? Load the weights only with output_path=None."
        )
    ids = [i for group in groups for i in group["params"]]
    if len(ids) != len(params):
        raise ValueError(
            f"The optimizer state in {source} covers {len(ids)} parameters but the model part it"
            f" belongs to has {len(params)}; the optimizer was built over other parameters."
        )
    for position, index in enumerate(ids):
        for name, value in state.get(index, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[position].shape:
                raise ValueError(
                    f"The optimizer state in {source} does not line up with the model's parameters: slot"
                    f" {name!r} of parameter #{position} has shape {tuple(value.shape)}, the parameter"
                    f" {tuple(params[position].shape)}. Build the optimizer over the parameters in the same"
                    " order as the script that saved it (e.g. model.parameters())."
                )


def _fit_loop_state(epochs_completed: int, global_step: int) -> dict[str, Any]:
    """A fresh Trainer's ``fit_loop.state_dict()`` (Lightning's layout), counters set to the epochs and steps."""
    state = _namespace.get("pytorch:Trainer")(accelerator="cpu", devices=1, logger=False).fit_loop.state_dict()
    steps = state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]
    for scope in ("total", "current"):
        state["epoch_progress"][scope] = dict.fromkeys(state["epoch_progress"][scope], epochs_completed)
        steps[scope] = dict.fromkeys(steps[scope], global_step if scope == "total" else 0)
    state["epoch_loop.state_dict"]["_batches_that_stepped"] = global_step
    return state


def import_plain_checkpoint(
    source: str | os.PathLike | Mapping[str, Any],
    model: nn.Module,
    output_path: str | os.PathLike | None = None,
    *,
    strict: bool = True,
    weights_only: bool = True,
    epochs_completed: int | None = None,
) -> dict[str, Any]:
    """Load a plain PyTorch (hand-written DDP) checkpoint into ``model``; optionally write a Lightning one.

    The file holds ``{"epoch", "model_state_dict" | "state_dict" | "model", "optimizer_state_dict" | "optimizer",
    "global_step"?}`` (as PyTorch's examples save) or is a bare state dict; its keys are matched exactly against
    ``model``'s or a sub-module's (``layers.0.weight`` -> ``model.layers.0.weight``). With ``output_path`` (a
    LightningModule only) a Lightning checkpoint is written atomically (weights, optimizer state checked to line
    up with the matched part's ``parameters()``, hyper-parameters, loop counters), so ``Trainer.fit(model,
    ckpt_path=output_path)`` continues at epoch ``epochs_completed``.

    Args:
        source: the file, or the already loaded dict; model: a LightningModule or ``nn.Module``, loaded in place.
        output_path: where to write the Lightning checkpoint; ``None`` writes nothing.
        strict: every key must match (default); False skips missing and unexpected keys (as torch's ``strict``).
        weights_only: load the file with ``torch.load(weights_only=True)`` (default); False only for trusted files.
        epochs_completed: epochs already trained; default the file's ``"epoch"``, read as PyTorch's ImageNet example
            writes it (``epoch + 1``; pass it if your script saved the last epoch's 0-based index), else 0.

    Returns:
        The Lightning checkpoint dict (also when nothing is written).

    Raises:
        FileNotFoundError, PermissionError, DamagedCheckpointError, UnsafeCheckpointError: loading failed, or the
            content is not a checkpoint (no model state dict, a non-tensor weight, an ``epoch`` that is not a whole
            number, an optimizer entry not laid out as PyTorch writes it).
        StateDictMismatchError: ``strict`` and the keys or shapes do not match (lists them); RuntimeError: not
            ``strict`` and a tensor has another shape (torch's ``size mismatch for <key>``).
        ValueError: the optimizer state does not line up with the parameters, or is missing with ``output_path``.
        TypeError: ``output_path`` is given but ``model`` is not a LightningModule.
    """
    if output_path is not None and not isinstance(model, _namespace.LightningModule):
        raise TypeError(
            f"A Lightning checkpoint needs a LightningModule; got {type(model).__name__}. Pass the"
            " LightningModule, or output_path=None to load the weights only."
        )
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "the given checkpoint"
    checkpoint = (
        load_file(source, weights_only=weights_only, opt_out="import_plain_checkpoint(..., weights_only=False)")
        if isinstance(source, (str, os.PathLike))
        else source
    )
    named = [(unwrapped_name(model, sub + ".x")[:-1] if sub else "", m) for sub, m in model.named_modules()]
    # "<clean path>." -> sub-module (a wrapper rather than the module it wraps: the first named), shortest path first
    parts = dict(sorted(dict(reversed(named)).items(), key=lambda item: (item[0].count("."), item[0])))
    loadable = match_state_dict(
        find_model_state_dict(checkpoint, name), model, strict=strict, source=name, prefixes=list(parts)
    )
    own = model.state_dict()
    odd = next((k for k, v in loadable.items() if isinstance(own[k], torch.Tensor) and not torch.is_tensor(v)), None)
    if odd is not None:
        raise DamagedCheckpointError(
            f"{name}: the weight for {odd!r} is a {type(loadable[odd]).__name__}, not a tensor. Is this file a"
            " checkpoint?"
        )
    model.load_state_dict(loadable, strict=strict)

    epochs_completed = _int_entry(checkpoint, ("epoch",), name) if epochs_completed is None else epochs_completed
    global_step = _int_entry(checkpoint, ("global_step", "step"), name)
    result: dict[str, Any] = {
        "epoch": max(epochs_completed - 1, 0),
        "global_step": global_step,
        "pytorch-lightning_version": _namespace.version,
        "state_dict": unwrapped_state_dict(model),
        "loops": {"fit_loop": _fit_loop_state(epochs_completed, global_step)},
        "lr_schedulers": [],
        "callbacks": {},
    }
    for entry in map(checkpoint.get, OPTIMIZER_STATE_KEYS):  # the first in the layout Optimizer.state_dict() has
        if isinstance(entry, Mapping) and "state" in entry and "param_groups" in entry:
            clean = [unwrapped_name(model, k) for k in loadable]  # the deepest part holding every loaded key
            part = [model, *(m for path, m in parts.items() if clean and all(k.startswith(path) for k in clean))][-1]
            _check_optimizer_lines_up(entry, list(part.parameters()), name)
            result["optimizer_states"] = [dict(entry)]
            break
    if isinstance(model, _namespace.LightningModule) and model.hparams:
        result[model.CHECKPOINT_HYPER_PARAMS_KEY] = dict(model.hparams)
    if output_path is not None:
        if "optimizer_states" not in result:
            raise ValueError(
                f"{name} has no optimizer state (looked for {list(OPTIMIZER_STATE_KEYS)}), so"
                " training cannot resume from it; load the weights with output_path=None instead."
            )
        atomic_save(result, output_path)
        log.info(
            "wrote Lightning checkpoint %s (resumes at epoch %d, step %d)", output_path, epochs_completed, global_step
        )
    return result


def export_weights(
    source: str | os.PathLike | nn.Module,
    path: str | os.PathLike,
    submodule: str = "model",
    weights_only: bool = True,
) -> dict[str, torch.Tensor]:
    """Write just the plain model weights (a ``state_dict``) for inference without Lightning, atomically: keys
    without ``module.``, ``_orig_mod.`` or ``<submodule>.``, tensors detached, contiguous, on the CPU.

    Args:
        source: a checkpoint file (Lightning or plain) or a module.
        path: the output file: safetensors if it ends in ``.safetensors`` (``pip install ddp_strategy[safetensors]``;
            ``torch.load`` reads any such path as safetensors), else ``torch.save``'s format. Safetensors holds no
            shared memory: tied weights are written once, as ``safetensors.torch.save_model`` writes them, so load
            with ``safetensors.torch.load_model(model, path)``, which ties them again.
        submodule: attribute of the plain model in the LightningModule (default ``"model"``); ``""``: everything.
        weights_only: as for :func:`load_plain_state_dict`.

    Returns:
        The exported state dict (every name, tied ones included).

    Raises:
        FileNotFoundError, PermissionError, DamagedCheckpointError, UnsafeCheckpointError, KeyError: as for
            :func:`load_plain_state_dict`. ImportError: a ``.safetensors`` path without safetensors installed.
        TypeError: ``source`` is a module whose state dict holds a non-tensor (extra state) under ``submodule``.
    """
    if isinstance(source, nn.Module):
        weights = _submodule_weights(unwrapped_state_dict(source), submodule, type(source).__name__)
    else:
        weights = plain_state_dict(
            load_file(source, weights_only=weights_only, opt_out="export_weights(..., weights_only=False)"),
            source,
            submodule,
        )
    # a module's extra state (TypeError), or a file that is no checkpoint
    if (odd := next((k for k, v in weights.items() if not isinstance(v, torch.Tensor)), None)) is not None:
        where = type(source).__name__ if isinstance(source, nn.Module) else os.fspath(source)
        raise (TypeError if isinstance(source, nn.Module) else DamagedCheckpointError)(
            f"The model state dict in {where} holds a"
            f" {type(weights[odd]).__name__} under {odd!r}, not a tensor; only tensors can be exported."
        )
    exported = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    if os.fspath(path).endswith(".safetensors"):
        try:
            from safetensors.torch import save as to_safetensors_bytes
        except ImportError as e:
            raise ImportError(
                "Writing safetensors needs the safetensors package: pip install 'ddp_strategy[safetensors]',"
                " or export a PyTorch file instead (a path not ending in .safetensors, such as weights.pt:"
                " torch.load reads any *.safetensors path as safetensors)."
            ) from e
        # Tied weights (one tensor under several names; read before .cpu(), which copies each name's) are written
        # once, under their first name, as safetensors.torch.save_model does (the format refuses shared memory): the
        # metadata maps each other name to it, and safetensors.torch.load_model(model, path) restores the tie. An
        # empty tensor (address 0) is tied to nothing, as there.
        tensors = {k: (v.device, v.data_ptr() or id(v), v.shape, v.stride()) for k, v in weights.items()}
        first = {tensor: name for name, tensor in reversed(tensors.items())}
        tied = {name: first[tensor] for name, tensor in tensors.items() if first[tensor] != name}
        atomic_save(
            {k: v for k, v in exported.items() if k not in tied},
            path,
            save_fn=lambda obj, f: f.write(to_safetensors_bytes(obj, metadata=tied)),
        )
    else:
        atomic_save(exported, path)
    return exported
