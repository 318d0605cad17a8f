"""The notebook's demonstrations, checked by value: sharding, the set_epoch pitfall, and a real 2-process all-reduce."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddp_strategy import DigitsNet
from ddp_strategy.reference.data import load_digits_tensors
from ddp_strategy.reference.demo import allreduce_demo, epoch_shards, forgotten_set_epoch


def test_epoch_shards_match_the_sampler_docstring_example():
    """5 samples, 2 ranks, no shuffle: rank 0 [0, 2, 4], rank 1 [1, 3, 0] (0 repeated as padding)."""
    assert epoch_shards(5, 2, epochs=1, shuffle=False) == [[[0, 2, 4], [1, 3, 0]]]


def test_epoch_shards_are_disjoint_and_reshuffled():
    """20 samples on 2 ranks: each epoch splits them 10/10 without overlap, and epoch 1 differs from epoch 0."""
    shards = epoch_shards(20, 2, epochs=2, seed=0)
    for r0, r1 in shards:
        assert len(r0) == len(r1) == 10 and set(r0) | set(r1) == set(range(20)) and set(r0).isdisjoint(r1)
    assert shards[0][0] != shards[1][0]


def test_forgotten_set_epoch_repeats_the_order():
    """A plain DistributedSampler repeats epoch 0's order; the strategy's sampler changes it every epoch."""
    orders = forgotten_set_epoch(12, epochs=3)
    plain, ours = orders["DistributedSampler without set_epoch"], orders["EpochSeededDistributedSampler"]
    assert plain[0] == plain[1] == plain[2]
    assert ours[0] == plain[0] and ours[1] != ours[0] and ours[2] not in (ours[0], ours[1])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_allreduce_demo_gradients_and_weights():
    """Local gradients differ; after the all-reduce they are equal, equal DDP's and one process's on both batches."""
    demo = allreduce_demo(world_size=2, batch_size=16, lr=0.1)  # fork: spawn would re-import Lightning per rank
    assert [len(b) for b in demo.batches] == [16, 16] and set(demo.batches[0]).isdisjoint(demo.batches[1])
    names = list(demo.initial)
    assert any(not torch.equal(demo.local_grads[0][n], demo.local_grads[1][n]) for n in names)
    x, y = load_digits_tensors()
    union = demo.batches[0] + demo.batches[1]
    single = DigitsNet(hidden_size=32)
    single.load_state_dict(demo.initial)
    F.cross_entropy(single(x[union]), y[union]).backward()
    for n, p in single.named_parameters():
        assert torch.equal(demo.averaged_grads[0][n], demo.averaged_grads[1][n])
        torch.testing.assert_close(demo.averaged_grads[0][n], p.grad, rtol=0, atol=1e-6)
        for rank in range(2):
            torch.testing.assert_close(demo.ddp_grads[rank][n], demo.averaged_grads[rank][n], rtol=0, atol=1e-6)
        expected = demo.initial[n] - 0.1 * demo.averaged_grads[0][n]
        torch.testing.assert_close(demo.weights_after_step[0][n], expected)
        assert torch.equal(demo.weights_after_step[0][n], demo.weights_after_step[1][n])
    assert set(demo.ddp_state_dict) == {f"module.{n}" for n in names}
    assert demo.comm_stats is not None and demo.comm_stats.allreduce_ms > 0
