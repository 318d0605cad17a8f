"""DDP option handling and wrapping helpers, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy.process.group import device_ids
from ddp_strategy.sync import wrapping
from ddp_strategy.sync.comm_hooks import CommHookConfig


def test_known_options_pass_through_with_ddps_defaults():
    """DDP options pass through; no default is changed from DDP's (Lightning's ddp passes none either)."""
    assert wrapping.ddp_options({}, {}) == {}
    named = {
        "find_unused_parameters": False,
        "static_graph": False,
        "gradient_as_bucket_view": False,
        "bucket_cap_mb": None,
        "broadcast_buffers": True,
    }
    assert wrapping.ddp_options(named, {}) == {}  # DDP's defaults, from its signature: nothing is passed
    assert wrapping.ddp_options({**named, "broadcast_buffers": False, "bucket_cap_mb": 5}, {}) == {
        "broadcast_buffers": False,
        "bucket_cap_mb": 5,
    }
    opts = wrapping.ddp_options(
        {}, {"find_unused_parameters": True, "bucket_cap_mb": 5, "gradient_as_bucket_view": True}
    )
    assert opts == {"find_unused_parameters": True, "bucket_cap_mb": 5, "gradient_as_bucket_view": True}
    assert wrapping.ddp_options({"static_graph": True}, {"bucket_cap_mb": 5}) == {
        "static_graph": True,
        "bucket_cap_mb": 5,
    }
    assert {"static_graph", "broadcast_buffers", "process_group"} <= set(wrapping.DDP_DEFAULTS)


@pytest.mark.parametrize("name", ["find_unused_parameter", "device_ids", "output_device"])
def test_unknown_or_reserved_options_are_refused(name):
    """A misspelt option, or one the strategy sets itself, raises TypeError naming it and the valid ones."""
    with pytest.raises(TypeError, match=rf"unknown DistributedDataParallel option\(s\) \['{name}'\].*find_unused"):
        wrapping.ddp_options({}, {name: 1})


def test_device_ids_are_for_cuda_only():
    """CUDA devices give [index] (checked without a GPU); CPU gives None as DDP requires."""
    assert device_ids(torch.device("cuda", 3)) == [3]
    assert device_ids(torch.device("cuda")) == [0]
    assert device_ids(torch.device("cpu")) is None


def test_wrap_and_unwrap_in_a_one_rank_group(world_of_one):
    """wrap returns a DDP around the same module with our options and hook; unwrap gives it back."""
    module = nn.Linear(3, 2)
    options = wrapping.ddp_options({}, {"bucket_cap_mb": 1, "gradient_as_bucket_view": True})
    wrapped = wrapping.wrap(module, torch.device("cpu"), options, CommHookConfig("fp16"))
    assert isinstance(wrapped, DistributedDataParallel) and wrapped.module is module
    assert wrapped.gradient_as_bucket_view and wrapped.device_ids is None
    assert wrapped._get_ddp_logging_data()["comm_hook"] == "fp16_compress_hook"
    assert wrapping.unwrap(wrapped) is module and wrapping.unwrap(module) is module
    wrapping.broadcast_states(module)  # world size 1: a no-op that must not fail
    assert wrapping.unwrap(wrapped, failed=True) is module and wrapped.process_group is None


def test_wrap_called_again_wraps_anew_only_where_the_trainable_parameters_changed(world_of_one):
    """The same wrapper while the trainable set holds, inside no_sync, deferred, or with nothing left to train; a new
    one over the same module and process group where a parameter was unfrozen or added."""
    module = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    module[0].requires_grad_(False)
    cpu, hook = torch.device("cpu"), CommHookConfig()
    first = wrapping.wrap(module, cpu, {}, hook)
    assert wrapping.wrap(first, cpu, {}, hook) is first
    module[0].requires_grad_(True)
    with first.no_sync():
        assert wrapping.wrap(first, cpu, {}, hook) is first
    assert wrapping.wrap(first, cpu, {}, hook, defer=True) is first
    second = wrapping.wrap(first, cpu, {}, hook)
    assert second is not first and second.module is module and second.process_group is first.process_group
    module.requires_grad_(False)
    assert wrapping.wrap(second, cpu, {}, hook) is second  # backward then fails, as under Lightning's ddp
    module.requires_grad_(True)
    module.append(nn.Linear(2, 2))
    assert wrapping.wrap(second, cpu, {}, hook) is not second
    own = DistributedDataParallel(module)  # a subclass's _setup_model may build its own: kept as it is
    module[0].requires_grad_(False)
    assert wrapping.wrap(own, cpu, {}, hook) is own
