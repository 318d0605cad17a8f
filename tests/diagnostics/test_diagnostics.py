"""The rank-0 diagnostics: summary and warning texts from given numbers, then from real fits (1 and 2 processes)."""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from ddp_testing import one_rank_trainer, quiet_trainer
from diagnostics_workers import ListHandler, MultipliedBatchDigits, UnusedHeadClassifier
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ddp_strategy import DigitsClassifier, DigitsDataModule, MyDDPStrategy
from ddp_strategy.diagnostics import (
    COMM_DOMINATES_FRACTION,
    CommStats,
    FitSummary,
    GradientTracker,
    batch_size_warnings,
    communication_messages,
)

# ------------------------------------------------------------------------------------------ fit summary


def test_fit_summary_states_every_number():
    """4 ranks on 2 nodes, B=32, 2 accumulation steps, 1,437 samples: global batch 256, 360 per rank, 3 padding."""
    summary = FitSummary(
        world_size=4,
        num_nodes=2,
        backend="nccl",
        start_method="popen",
        per_device_batch_size=32,
        accumulate_grad_batches=2,
        dataset_size=1437,
        samples_per_rank=360,
        padding=3,
        batches_per_epoch=12,
        ddp_options={"find_unused_parameters": True, "bucket_cap_mb": 50},
        comm_hook="fp16_compress_hook",
    )
    assert summary.global_batch_size == 256
    assert summary.optimizer_steps_per_epoch == 6
    assert summary.format().splitlines() == [
        "DDP fit summary: world size 4 (2 nodes x 2 processes), backend nccl, start method popen",
        "  batch: 32 per device x 4 processes x 2 accumulation = global batch size 256 samples per step",
        "  data: 1437 training samples, 360 per rank per epoch (3 repeated as padding), 12 batches per epoch per"
        " rank = 6 optimizer steps",
        "  DDP options: bucket_cap_mb=50, find_unused_parameters=True; comm hook: fp16_compress_hook",
    ]


def test_fit_summary_with_drop_last_unknown_batch_and_iterable_data():
    """Dropped samples are reported as such; unknown sizes say so instead of guessing."""
    dropped = FitSummary(
        world_size=2,
        num_nodes=1,
        backend="gloo",
        start_method="spawn",
        per_device_batch_size=8,
        accumulate_grad_batches=3,
        dataset_size=9,
        samples_per_rank=4,
        padding=-1,
        batches_per_epoch=1,
    )
    assert "4 per rank per epoch (1 dropped by drop_last)" in dropped.format()
    assert "1 batch per epoch per rank = 1 optimizer step\n" in dropped.format()  # one of each, singular
    unknown = FitSummary(world_size=2, num_nodes=1, backend="gloo", start_method="fork", per_device_batch_size=None)
    assert unknown.global_batch_size is None and math.isinf(unknown.optimizer_steps_per_epoch)
    text = unknown.format()
    assert "per-device batch size unknown" in text
    assert "training samples: ?, batches and optimizer steps per epoch unknown (streaming loader)\n" in text
    assert "inf" not in text
    assert "DDP options: defaults; comm hook: none" in text


# -------------------------------------------------------------------------------------- batch warnings


@pytest.mark.parametrize(
    ("batch", "world", "n", "configured"),
    [
        (32, 2, 1438, None),
        (32, 2, 1438, 32),
        (32, 1, 1438, 32),
        (719, 2, 1438, 16),
        (64, 2, None, None),
        (None, 2, 10, 5),
    ],
)
def test_sensible_batch_sizes_give_no_warning(batch, world, n, configured):
    """Per-device batches that fit the data and were not multiplied by W give no warning (719 x 2 = 1438 fits)."""
    assert batch_size_warnings(batch, world, n, configured) == []


def test_global_batch_larger_than_the_data_set_is_reported_with_numbers():
    """B=1024 on 2 ranks with 1,438 samples: global 2048 > 1438, each rank holds 719, suggest B=512."""
    (message,) = batch_size_warnings(1024, 2, 1438)
    assert message.startswith(
        "Global batch size 2048 (batch_size=1024 per device x 2 processes) exceeds the 1438"
        " training samples: each rank holds only 719 samples"
    )
    assert "for a global batch of 1024 pass batch_size=512, and keep batch_size x 2 <= 1438." in message
    assert batch_size_warnings(512, 2, 1438) == []  # the suggested batch size is silent


@pytest.mark.parametrize(
    ("batch", "world", "n", "suggested"),
    [(1024, 2, 1438, 512), (2048, 2, 1438, 719), (2048, 1, 1438, 1438), (5000, 3, 1438, 479)],
)
def test_the_batch_size_a_global_batch_warning_suggests_gives_no_warning(batch, world, n, suggested):
    """Whatever the batch, the world size (one process too) and the data set, the batch_size the warning suggests
    fits the data set and gives no warning (a suggestion of batch // W alone still overflowed when batch > N)."""
    (message,) = batch_size_warnings(batch, world, n)
    assert f"for a global batch of {suggested * world} pass batch_size={suggested}," in message
    assert batch_size_warnings(suggested, world, n) == []
    processes = "1 process" if world == 1 else f"{world} processes"
    assert f"per device x {processes})" in message


def test_batch_size_multiplied_by_world_size_is_reported_with_numbers():
    """Loader B=64 with configured batch_size=32 on 2 ranks: each step sees 128, not 64; use 32."""
    (message,) = batch_size_warnings(64, 2, 1438, configured_batch_size=32)
    assert message.startswith("The training loader's batch_size=64 is the configured batch_size=32 x 2 processes.")
    assert "each step sees 128 samples, not 64. Build the loader with batch_size=32 (global batch 64)" in message
    assert len(batch_size_warnings(96, 3, 1438, configured_batch_size=32)) == 1
    assert batch_size_warnings(96, 2, 1438, configured_batch_size=32) == []


def test_both_batch_rules_can_fire_together():
    """B=2048 = 1024 x 2 on 1,438 samples breaks both rules: two messages, rule 1 first."""
    messages = batch_size_warnings(2048, 2, 1438, configured_batch_size=1024)
    assert [m.split()[0] for m in messages] == ["Global", "The"]
    assert "Global batch size 4096" in messages[0]


# -------------------------------------------------------------------------------------- communication


def _ns(ms: float) -> int:
    return int(ms * 1e6)


def test_comm_stats_read_ddp_nanoseconds_as_milliseconds():
    """DDP's ns averages become ms; exposed comm = all-reduce - overlap; shares follow from them."""
    data = {
        "avg_forward_compute_time": _ns(1.0),
        "avg_backward_compute_time": _ns(1.5),
        "avg_backward_comm_time": _ns(12.0),
        "avg_backward_compute_comm_overlap_time": _ns(1.0),
        "iteration": 10,
    }
    stats = CommStats.from_ddp_logging_data(data)
    assert stats == CommStats(forward_ms=1.0, backward_compute_ms=1.5, allreduce_ms=12.0, overlap_ms=1.0)
    assert stats.compute_ms == 2.5 and stats.exposed_comm_ms == 11.0
    assert stats.comm_fraction == pytest.approx(11.0 / 13.5)
    assert stats.overlap_fraction == pytest.approx(1 / 12)
    torch.testing.assert_close(stats.as_tensor(), torch.tensor([1.0, 1.5, 12.0, 1.0], dtype=torch.float64))
    assert CommStats.from_ddp_logging_data({"iteration": 0, "avg_forward_compute_time": 5}) is None
    fully_hidden = CommStats(forward_ms=1.0, backward_compute_ms=2.0, allreduce_ms=1.0, overlap_ms=1.5)
    assert fully_hidden.exposed_comm_ms == 0.0 and fully_hidden.comm_fraction == 0.0
    assert fully_hidden.overlap_fraction == 1.0


def test_communication_summary_and_hint_when_communication_dominates():
    """11 ms of 13.5 waiting for the all-reduce (81%) gives the summary with those numbers and the hint."""
    stats = CommStats(forward_ms=1.0, backward_compute_ms=1.5, allreduce_ms=12.0, overlap_ms=1.0)
    infos, warns = communication_messages(stats, [], world_size=2, per_device_batch_size=32, bucket_cap_mb=25)
    assert warns == []
    assert infos[0] == (
        "DDP communication per step (ms, averaged over DDP's sampled steps and 2 ranks): compute 2.50 (forward 1.00"
        " + backward 1.50), gradient all-reduce 12.00, of which 1.00 (8%) overlapped with backward; waiting for"
        " communication 11.00 = 81% of the step."
    )
    assert infos[1].startswith(
        "Hint: communication dominates (81% of each step waits for the gradient all-reduce),"
        " so 2 processes may be slower than one."
    )
    for advice in (
        "a larger per-device batch_size than 32",
        "MyDDPStrategy(bucket_cap_mb=...) (now 25 MiB)",
        "fp16_compress_hook",
        "fewer devices",
    ):
        assert advice in infos[1]


def test_the_hint_suggests_accumulation_only_where_it_saves_all_reduces():
    """Accumulation gives each all-reduce more work only where its micro-batches skip it (no_sync: one all-reduce
    per window, tests/sync/test_ddp_equivalence.py); under static_graph=True each micro-batch all-reduces
    (tests/sync/test_backward.py), so the hint leaves it out there. One process gets no hint: there is nothing to
    compare with and no device to drop."""
    stats = CommStats(forward_ms=1.0, backward_compute_ms=1.5, allreduce_ms=12.0, overlap_ms=1.0)
    (_, dynamic), _ = communication_messages(stats, [], world_size=2, per_device_batch_size=32)
    (_, static), _ = communication_messages(stats, [], world_size=2, per_device_batch_size=32, static_graph=True)
    assert "a larger per-device batch_size than 32 or accumulate_grad_batches; a larger" in dynamic
    assert "a larger per-device batch_size than 32; a larger" in static and "accumulate" not in static
    (summary,), _ = communication_messages(stats, [], world_size=1)
    assert summary.startswith("DDP communication per step (ms, averaged over DDP's sampled steps and 1 rank)")


@pytest.mark.parametrize("static_graph", [False, True])
def test_accumulation_saves_all_reduces_without_static_graph_only(tmp_path, static_graph):
    """What the hint's accumulation advice rests on, in a fit: accumulate_grad_batches=2 over 4 batches makes 2
    gradient all-reduces (DDP's comm hook is called once per bucket, here 1) without static_graph, 4 under it."""
    calls = []

    def counting_allreduce(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    strategy = MyDDPStrategy(timeout=30, ddp_comm_hook=counting_allreduce, static_graph=static_graph)
    trainer = one_rank_trainer(tmp_path, strategy, max_steps=2, accumulate_grad_batches=2, limit_val_batches=0)
    trainer.fit(DigitsClassifier(), DigitsDataModule(batch_size=64))
    assert len(calls) == (4 if static_graph else 2)


def test_no_hint_when_communication_is_hidden_or_at_the_threshold():
    """Exposed communication of 50% exactly (the threshold) or less gives the summary only."""
    assert COMM_DOMINATES_FRACTION == 0.5
    at_threshold = CommStats(forward_ms=1.0, backward_compute_ms=1.0, allreduce_ms=3.0, overlap_ms=1.0)
    assert at_threshold.comm_fraction == 0.5
    infos, _ = communication_messages(at_threshold, [], world_size=2)
    assert len(infos) == 1 and "waiting for communication 2.00 = 50% of the step." in infos[0]
    infos, _ = communication_messages(None, [], world_size=2)
    assert infos == ["DDP communication: no step was timed (DDP times iterations 1-10 and every 100th after)."]


def test_unused_parameters_are_named_in_a_warning():
    """Parameters without gradients are listed by name, with the count."""
    _, warns = communication_messages(None, ["aux_head.weight", "aux_head.bias"], world_size=2)
    assert warns == [
        "2 parameter(s) never received a gradient on any rank during fit: aux_head.weight, aux_head.bias. They are"
        " not trained. Use them in the forward pass, freeze them (requires_grad=False) or remove them; with"
        " find_unused_parameters=True DDP also pays an extra graph traversal every step."
    ]


def test_gradient_tracker_records_which_parameters_got_gradients():
    """Only parameters in the backward graph are flagged; frozen ones are not tracked; close() stops recording."""
    net = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2), "frozen": nn.Linear(3, 2)})
    net["frozen"].requires_grad_(False)
    tracker = GradientTracker(net)
    assert tracker.names == ["used.weight", "used.bias", "unused.weight", "unused.bias"]
    net["used"](torch.ones(1, 3)).sum().backward()
    assert tracker.seen == [True, True, False, False]
    tracker.prune()  # the used parameters' hooks go; the unused ones keep theirs
    assert sorted(tracker._handles) == [2, 3]
    net["used"](torch.ones(1, 3)).sum().backward()
    assert tracker.seen == [True, True, False, False]
    tracker.close()
    net["unused"](torch.ones(1, 3)).sum().backward()
    assert tracker.seen == [True, True, False, False]


# ------------------------------------------------------------------------------------------- real fits


@pytest.fixture
def lightning_log():
    """Messages rank_zero_info logs during the test: on ``lightning.pytorch`` or ``pytorch_lightning``, whichever
    namespace's ``rank_zero`` module was imported last (each points lightning_utilities' logger at its own)."""
    handler = ListHandler()
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "pytorch_lightning")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.messages
    for logger in loggers:
        logger.removeHandler(handler)


@pytest.mark.timeout(120)
def test_one_process_fit_logs_summary_and_names_the_unused_head(tmp_path, lightning_log):
    """A 1-process fit (in this process) logs the summary, the timings and warns about aux_head's parameters."""
    pl.seed_everything(0)
    trainer = one_rank_trainer(
        tmp_path, MyDDPStrategy(find_unused_parameters=True, timeout=30), max_steps=12, limit_val_batches=0
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(UnusedHeadClassifier(), DigitsDataModule(batch_size=1024))
    summary = next(m for m in lightning_log if m.startswith("DDP fit summary"))
    assert summary.splitlines() == [
        "DDP fit summary: world size 1 (1 node x 1 process), backend gloo, start method popen",
        "  batch: 1024 per device x 1 process x 1 accumulation = global batch size 1024 samples per step",
        "  data: 1438 training samples, 1438 per rank per epoch (0 repeated as padding), 2 batches per epoch per"
        " rank = 2 optimizer steps",
        "  DDP options: find_unused_parameters=True; comm hook: none",
    ]
    assert any(
        m.startswith("DDP communication per step (ms, averaged over DDP's sampled steps and 1 rank)")
        for m in lightning_log
    )
    texts = [str(w.message) for w in caught]
    assert any(
        t.startswith("2 parameter(s) never received a gradient on any rank during fit: aux_head.weight, aux_head.bias.")
        for t in texts
    )
    assert not any(t.startswith("Global batch size") for t in texts)  # 1024 x 1 <= 1438
    assert "MyDDPStrategy: world size 1, backend=gloo" in lightning_log


SUMMARY_RE = re.compile(
    r"DDP communication per step \(ms, averaged over DDP's sampled steps and 2 ranks\): compute (?P<compute>[\d.]+)"
    r" \(forward (?P<fwd>[\d.]+) \+ backward (?P<bwd>[\d.]+)\), gradient all-reduce (?P<comm>[\d.]+), of which"
    r" (?P<overlap>[\d.]+) \(\d+%\) overlapped with backward; waiting for communication (?P<exposed>[\d.]+) ="
    r" (?P<share>\d+)% of the step\."
)


@contextmanager
def _fds_to(path: Path) -> Iterator[None]:
    """Send this process's (and its children's) fd 1 and 2 to ``path``; module fixtures cannot use capfd."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


@pytest.fixture(scope="module")
def two_process_output(tmp_path_factory) -> str:
    """Output of a 2-process spawn fit: loader batch 16 x 2 = 32, 2 accumulation steps, 1,437 samples, unused head."""
    out_dir = tmp_path_factory.mktemp("diagnostics_fit")
    with _fds_to(out_dir / "output.txt"):
        pl.seed_everything(7)
        trainer = quiet_trainer(
            2,
            MyDDPStrategy(start_method="spawn", timeout=60, find_unused_parameters=True),
            max_epochs=1,
            accumulate_grad_batches=2,
            limit_val_batches=2,
            num_sanity_val_steps=0,
            default_root_dir=out_dir,
        )
        trainer.fit(UnusedHeadClassifier(), MultipliedBatchDigits(batch_size=16, val_fraction=0.2003))
    return (out_dir / "output.txt").read_text()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_process_summary_is_logged_once_with_the_fit_numbers(two_process_output):
    """Rank 0 alone logs the summary: W=2, global batch 32 x 2 x 2 = 128, 719 per rank with 1 padding, 12 steps."""
    out = two_process_output
    assert out.count("DDP fit summary") == 1, out[-3000:]
    start = out.index("DDP fit summary")
    assert out[start:].splitlines()[:4] == [
        "DDP fit summary: world size 2 (1 node x 2 processes), backend gloo, start method spawn",
        "  batch: 32 per device x 2 processes x 2 accumulation = global batch size 128 samples per step",
        "  data: 1437 training samples, 719 per rank per epoch (1 repeated as padding), 23 batches per epoch per"
        " rank = 12 optimizer steps",
        "  DDP options: find_unused_parameters=True; comm hook: none",
    ]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_process_fit_warns_once_about_the_multiplied_batch_size(two_process_output):
    """The loader's 32 = configured 16 x 2 is reported once, with the global batch it really gives (64)."""
    out = two_process_output
    message = "The training loader's batch_size=32 is the configured batch_size=16 x 2 processes."
    assert out.count(message) == 1
    assert "each step sees 64 samples, not 32. Build the loader with batch_size=16 (global batch 32)" in out
    assert "Global batch size" not in out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_process_communication_summary_is_consistent(two_process_output):
    """The fit-end summary appears once and its numbers add up: compute = fwd + bwd, exposed = comm - overlap."""
    matches = list(SUMMARY_RE.finditer(two_process_output))
    assert len(matches) == 1, two_process_output[-3000:]
    v = {k: float(x) for k, x in matches[0].groupdict().items()}
    assert v["comm"] > 0 and v["compute"] > 0
    assert v["compute"] == pytest.approx(v["fwd"] + v["bwd"], abs=0.011)
    assert v["exposed"] == pytest.approx(max(v["comm"] - v["overlap"], 0.0), abs=0.011)
    assert v["share"] == pytest.approx(100 * v["exposed"] / (v["compute"] + v["exposed"]), abs=1.0)
    hinted = "Hint: communication dominates" in two_process_output
    assert hinted == (v["share"] > 100 * COMM_DOMINATES_FRACTION + 1) or abs(v["share"] - 50) <= 1


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_process_fit_names_the_unused_head_once(two_process_output):
    """aux_head never got a gradient on either rank: one warning naming both of its parameters."""
    message = "2 parameter(s) never received a gradient on any rank during fit: aux_head.weight, aux_head.bias."
    assert two_process_output.count(message) == 1
