"""Guards every private PyTorch name we use: a torch upgrade that changes one fails here, loudly."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from ddp_testing import free_port
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_strategy._compat import torch_private as _torch_private


@pytest.fixture
def one_rank_group():
    """A world-size-1 gloo process group in this process."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_logging_data_has_the_timings_we_read(one_rank_group):
    """After a few steps DDP reports forward/backward/comm/overlap averages in ns, plus its bucket size."""
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    assert set(_torch_private.DDP_TIMING_KEYS).isdisjoint(_torch_private.ddp_logging_data(ddp))  # nothing timed yet
    for _ in range(3):
        ddp(torch.ones(2, 4)).sum().backward()
    data = _torch_private.ddp_logging_data(ddp)
    for key in _torch_private.DDP_TIMING_KEYS:
        assert isinstance(data[key], int) and data[key] >= 0, key
    assert data["avg_backward_comm_time"] > 0 and data["avg_forward_compute_time"] > 0
    assert data["bucket_cap_bytes"] == 25 * 2**20
    assert "comm_hook" not in data


def test_ddp_logging_data_names_the_registered_comm_hook(one_rank_group):
    """Registering a comm hook makes DDP report its name under "comm_hook" (the fit summary shows it)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = DistributedDataParallel(nn.Linear(4, 2))
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    assert _torch_private.ddp_logging_data(ddp)["comm_hook"] == "fp16_compress_hook"


def test_ddp_logging_data_of_a_plain_module_is_empty():
    """Without the private method (a plain module) the wrapper returns {} instead of failing."""
    assert _torch_private.ddp_logging_data(nn.Linear(2, 2)) == {}


def test_broadcast_coalesced_and_release_ddp_process_group(one_rank_group):
    """_sync_params_and_buffers takes (group, tensors, bucket bytes, src); DDP keeps reducer/logger to delete."""
    tensors = [torch.ones(3), torch.zeros(2, dtype=torch.int64)]
    _torch_private.broadcast_coalesced(tensors, src=0)  # one rank: the values stay
    assert tensors[0].tolist() == [1.0, 1.0, 1.0] and tensors[1].tolist() == [0, 0]
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    assert hasattr(ddp, "reducer") and hasattr(ddp, "logger")
    _torch_private.release_ddp_process_group(ddp)
    assert not hasattr(ddp, "reducer") and not hasattr(ddp, "logger") and ddp.process_group is None


@pytest.mark.parametrize("hook", ["allreduce_hook", "fp16_compress_hook"])
def test_counting_process_group_sees_what_the_hooks_all_reduce(one_rank_group, hook):
    """The default hooks call only size() and all_reduce (-> group.allreduce([t], opts)) on a hook's state."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    seen = []
    group = _torch_private.CountingProcessGroup(None, lambda tensors: seen.extend(t.dtype for t in tensors))
    assert group.size() == 1 and group.rank() == 0
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    ddp.register_comm_hook(group, getattr(default_hooks, hook))
    ddp(torch.ones(2, 4)).sum().backward()
    assert seen == [torch.float32 if hook == "allreduce_hook" else torch.float16]
    assert ddp.module.weight.grad[0].tolist() == [2.0] * 4
    dist.all_reduce(torch.ones(1), group=group)
    assert len(seen) == 2


def test_default_store_is_the_world_groups_store(one_rank_group):
    """failures.run_reports keeps its keys in the default group's store (_get_default_store): a key set there is
    seen by a second handle on it, and it refuses without a group."""
    _torch_private.default_store().set("ddp_strategy/guard", "1")
    assert _torch_private.default_store().get("ddp_strategy/guard") == b"1"
    dist.destroy_process_group()
    with pytest.raises(ValueError):
        _torch_private.default_store()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # for the fixture's teardown


def test_compiled_modules_keep_the_original_under_the_compile_segment():
    """torch.compile gives an ``OptimizedModule`` holding the module under ``_orig_mod``, which prefixes its keys;
    a plain module (even one with a child of that name) is not taken for one."""
    net = nn.Linear(2, 1)
    compiled = torch.compile(net, backend="eager")
    assert type(compiled).__name__ == "OptimizedModule" and _torch_private.compiled_original(compiled) is net
    segment = _torch_private.COMPILE_SEGMENT
    assert list(compiled.state_dict()) == [f"{segment}.weight", f"{segment}.bias"]
    impostor = nn.Module()
    impostor._orig_mod = net
    assert _torch_private.compiled_original(impostor) is None and _torch_private.compiled_original(net) is None


def test_ddp_join_mode_and_the_shadows_use_ddps_own_join_internals(one_rank_group):
    """set_ddp_join_mode sets DDP's _join_config (a _JoinConfig), which DDP's forward reads to take the buffers from
    an active rank and to tell the joined ranks whether the backward syncs, notifying no join context itself (not
    the first joinable); shadow_ddp_forward/backward call what DDP's own join hook calls, in its order; in a world of
    one each runs (the shadow on a module without buffers: a lone joined rank has no active rank to take them from).
    """
    from torch.distributed.algorithms.join import Join, _JoinConfig
    from torch.nn.parallel.distributed import _DDPJoinHook

    assert _JoinConfig._fields == ("enable", "throw_on_early_termination", "is_first_joinable")
    hook = inspect.getsource(_DDPJoinHook.main_hook)
    order = [
        "reducer._rebuild_buckets()",
        "_check_and_sync_module_buffers()",
        "_check_global_requires_backward_grad_sync(",
        "_match_all_reduce_for_bwd_pass()",
        "_match_unused_params_allreduce()",
        "reducer._push_all_rebuilt_params()",
    ]
    assert [hook.index(call) for call in order] == sorted(hook.index(call) for call in order)
    assert "if self._join_config.enable:" in inspect.getsource(DistributedDataParallel._sync_buffers)
    forward = inspect.getsource(DistributedDataParallel._pre_forward)
    assert "self._check_global_requires_backward_grad_sync(is_joined_rank=False)" in forward
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2)), find_unused_parameters=True)
    _torch_private.set_ddp_join_mode(ddp, True)
    assert ddp._join_config.enable and not ddp._join_config.is_first_joinable
    assert Join.notify_join_context(ddp) is None
    ddp(torch.ones(2, 4)).sum().backward()  # the buffers' source: the highest active rank, 0 here
    _torch_private.set_ddp_join_mode(ddp, False)
    assert not ddp._join_config.enable
    plain = DistributedDataParallel(nn.Linear(4, 2), find_unused_parameters=True)  # no buffers: no rank to find
    _torch_private.shadow_ddp_forward(plain)
    _torch_private.shadow_ddp_backward(plain)


@pytest.mark.parametrize("static", [True, False])
def test_set_gradient_divisor_divides_by_the_works_sum_or_the_world_size(one_rank_group, static):
    """Reducer._set_forward_pass_work_handle(work, static): the next backward's gradients are divided by the world
    size (static, here 1) or by the number the work all-reduced (4, what Join.notify_join_context counts); with no
    work (None), by the world size again."""
    ddp = DistributedDataParallel(nn.Linear(4, 1, bias=False))
    work = dist.all_reduce(torch.tensor([4]), async_op=True)
    work.wait()
    _torch_private.set_gradient_divisor(ddp, work, static)
    ddp(torch.ones(1, 4)).sum().backward()
    assert ddp.module.weight.grad.tolist() == [[1.0 if static else 0.25] * 4]
    _torch_private.set_gradient_divisor(ddp, None, True)  # no handle, as an uneven epoch's end resets it
    ddp.module.weight.grad = None
    ddp(torch.ones(1, 4)).sum().backward()
    assert ddp.module.weight.grad.tolist() == [[1.0] * 4]


def test_all_reduce_first_static_graph_step_flushes_a_backward_outside_ddps_output(one_rank_group):
    """static_graph: a first backward not through DDP's output (Lightning's manual_backward inside the forward) all-
    reduces nothing until the flush (DDP's ``_static_graph_delay_allreduce_enqueued``, ``reducer._delay_all_reduce``),
    which all-reduces once; a second call, a later step and a plain module make no all-reduce of their own."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    ddp = DistributedDataParallel(nn.Linear(4, 2), static_graph=True)
    ddp.register_comm_hook(None, counting)
    x = torch.ones(2, 4)
    ddp(x)  # prepares the reducer; the backward below does not go through this output
    ddp.module(x).sum().backward()
    assert calls == [] and not ddp._static_graph_delay_allreduce_enqueued
    _torch_private.all_reduce_first_static_graph_step(ddp)
    assert calls == [0] and ddp._static_graph_delay_allreduce_enqueued
    torch.testing.assert_close(ddp.module.bias.grad, torch.full((2,), 2.0))
    _torch_private.all_reduce_first_static_graph_step(ddp)
    assert calls == [0]
    ddp(x).sum().backward()  # a later step: DDP's own hooks all-reduce
    assert calls == [0, 0]
    _torch_private.all_reduce_first_static_graph_step(nn.Linear(2, 2))


MODULES = ("torch.distributed.nn.functional", "torch.distributed.optim.zero_redundancy_optimizer")


def test_a_group_made_before_lightning_is_imported_is_freed_when_destroyed():
    """A fresh interpreter makes its group first, then imports Lightning and the package (as a Ray Train worker
    does): torch functions then hold the group as a default argument (in MODULES); destroying it frees
    it (its connections close: a failing rank's peers learn at once), and the collectives still take the default
    group. Fails if torch captures the group elsewhere too."""
    code = f"""
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
import lightning.pytorch, ddp_strategy
from torch.distributed.nn.functional import all_reduce
from ddp_strategy.process import failures
held = [m for m in {MODULES!r} if any(
    dist.group.WORLD in (getattr(f, "__defaults__", None) or ()) for f in vars(__import__("sys").modules[m]).values())]
print("held", sorted(held))
print("freed", failures.destroy_process_group())
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
print("sum", all_reduce(torch.ones(1)).item())
dist.destroy_process_group()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert f"held {sorted(MODULES)}" in lines  # what release_world_defaults undoes is there
    assert "freed True" in lines and "sum 1.0" in lines
