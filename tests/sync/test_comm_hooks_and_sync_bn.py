"""Comm-hook configuration, BatchNorm conversion and revert, and the rank check, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from ddp_strategy.sync import comm_hooks, rank_check, sync_batchnorm


class RecordingDDP(nn.parallel.DistributedDataParallel):
    """DDP that keeps the ``(state, hook)`` registered on it."""

    def register_comm_hook(self, state, hook):
        self.registered = (state, hook)
        super().register_comm_hook(state, hook)


def test_hook_names_resolve_and_bf16_is_replaced_off_nccl(world_of_one, monkeypatch):
    """Names map to hooks, with the wrapper's group as the (counted) state; PowerSGD's default state is rank 1 from
    iteration 10; PyTorch's bf16 hook/wrapper become ours on gloo but stay on NCCL (where DDP checks for CUDA)."""
    model = RecordingDDP(nn.Linear(3, 2))
    comm_hooks.register_comm_hook(model, comm_hooks.CommHookConfig())
    assert not hasattr(model, "registered")
    comm_hooks.register_comm_hook(model, comm_hooks.CommHookConfig("fp16"))
    state, hook = model.registered
    assert hook is default_hooks.fp16_compress_hook and state.group is model.process_group
    model = RecordingDDP(nn.Linear(3, 2))
    comm_hooks.register_comm_hook(model, comm_hooks.CommHookConfig(default_hooks.bf16_compress_hook))
    assert model.registered[1] is comm_hooks.bf16_all_reduce_hook
    model = RecordingDDP(nn.Linear(3, 2))
    comm_hooks.register_comm_hook(model, comm_hooks.CommHookConfig("powersgd"))
    state, hook = model.registered
    assert isinstance(state, powersgd.PowerSGDState) and hook is powersgd.powerSGD_hook
    assert state.matrix_approximation_rank == 1 and state.start_powerSGD_iter == 10
    assert state.process_group.group is model.process_group
    model = RecordingDDP(nn.Linear(3, 2))
    config = comm_hooks.CommHookConfig("allreduce", wrapper=default_hooks.bf16_compress_wrapper)
    comm_hooks.register_comm_hook(model, config)
    assert model.registered[1].__name__ == "bf16_wrapped_hook"
    model = RecordingDDP(nn.Linear(3, 2))  # wrapped by the user: renamed too, and it all-reduces in bfloat16
    comm_hooks.register_comm_hook(
        model, comm_hooks.CommHookConfig(default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook))
    )
    assert model.registered[1].__name__ == "bf16_wrapped_hook"
    with comm_hooks.count_collective_bytes() as counts:
        model(torch.ones(4, 3)).sum().backward()
    assert set(counts.by_dtype) == {"torch.bfloat16"} and model.module.bias.grad.tolist() == [4.0, 4.0]
    monkeypatch.setattr(comm_hooks.dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(TypeError, match="BF16 all reduce communication hook required CUDA"):
        comm_hooks.register_comm_hook(
            RecordingDDP(nn.Linear(3, 2)), comm_hooks.CommHookConfig(default_hooks.bf16_compress_hook)
        )


def test_hooks_register_on_gloo_and_count_bytes(world_of_one):
    """In a 1-rank gloo group each hook registers on a CPU DDP model and the counter sees its dtype."""
    for name, nbytes in [("allreduce", 4), ("fp16", 2), ("bf16", 2)]:
        model = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
        comm_hooks.register_comm_hook(model, comm_hooks.CommHookConfig(name))
        with comm_hooks.count_collective_bytes() as counts:
            model(torch.ones(4, 3)).sum().backward()
        assert counts.bytes_sent == 8 * nbytes
        assert model.module.weight.grad[0].tolist() == [4.0, 4.0, 4.0]


def test_convert_and_revert_keep_tensors_class_and_keys():
    """CPU BatchNorm becomes CPUSyncBatchNorm sharing its tensors, and reverts to BatchNorm1d with the same keys."""
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU())
    weight, keys = net[1].weight, set(net.state_dict())
    converted = sync_batchnorm.DDPSyncBatchNorm().apply(net)
    assert type(converted[1]) is sync_batchnorm.CPUSyncBatchNorm and converted[1].weight is weight
    x = torch.randn(8, 4)
    plain = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU())
    plain.load_state_dict(converted.state_dict())
    torch.testing.assert_close(converted(x), plain(x))  # no process group: plain BatchNorm behaviour
    reverted = sync_batchnorm.DDPSyncBatchNorm().revert(converted)
    assert type(reverted[1]) is nn.BatchNorm1d and reverted[1].weight is weight
    assert set(reverted.state_dict()) == keys


def test_cpu_capable_only_replaces_lightnings_default_plugin():
    """Lightning's TorchSyncBatchNorm is upgraded; None and custom plugins are kept."""
    from lightning.pytorch.plugins import TorchSyncBatchNorm

    assert isinstance(sync_batchnorm.cpu_capable(TorchSyncBatchNorm()), sync_batchnorm.DDPSyncBatchNorm)
    assert sync_batchnorm.cpu_capable(None) is None
    custom = sync_batchnorm.DDPSyncBatchNorm()
    assert sync_batchnorm.cpu_capable(custom) is custom


def test_parameter_checksums_see_a_change():
    """Checksums are (P, 2) float64 and change when one parameter changes."""
    net = nn.Linear(3, 2)
    names, sums = rank_check.parameter_checksums(net)
    assert names == ["weight", "bias"] and sums.shape == (2, 2) and sums.dtype == torch.float64
    with torch.no_grad():
        net.bias.neg_()
    _, after = rank_check.parameter_checksums(net)
    assert torch.equal(after[0], sums[0]) and not torch.equal(after[1], sums[1])
