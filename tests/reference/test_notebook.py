"""The reference notebook runs top to bottom on CPU with 2 processes, draws its figures and prints what it claims;
its committed outputs are what it prints now (else the failure names the command that regenerates them)."""

from __future__ import annotations

import base64
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

import nbformat
import pytest
from ddp_testing import finish, start_session

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "ddp_reference.ipynb"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# The tool that writes the committed outputs; imported by path (notebooks/ is no package). Importing it loads
# nbformat only: it imports nbclient (and jupyter_client, which would load ipykernel into pytest's process, where
# MyDDPStrategy takes "ipykernel" in sys.modules as a sign of Jupyter) inside the function that executes.
_spec = importlib.util.spec_from_file_location("regenerate", ROOT / "notebooks" / "regenerate.py")
regenerate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(regenerate)


def _committed() -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK, as_version=4)


def _assert_current(nb: nbformat.NotebookNode, fresh: nbformat.NotebookNode | None = None) -> None:
    """Fail, naming the command that regenerates the outputs, if a code cell of ``nb`` was edited since its outputs
    were written, or (given a fresh run) if the outputs differ from what the notebook prints now."""
    stale = regenerate.stale_cells(nb)
    problems = [f"code cell(s) {stale} edited since the outputs were written"] if stale else []
    problems += regenerate.differences(nb, fresh) if fresh is not None else []
    assert not problems, (
        f"{NOTEBOOK.name}'s committed outputs are stale: {'; '.join(problems)}. "
        f"Regenerate them with `{regenerate.COMMAND}` and commit the notebook."
    )


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> tuple[nbformat.NotebookNode, float]:
    """The notebook executed as the committed one was (``notebooks/regenerate.py``), into tmp; its wall time in s."""
    result = tmp_path_factory.mktemp("notebook") / "executed.ipynb"
    start = time.monotonic()
    proc = start_session([sys.executable, str(ROOT / "notebooks" / "regenerate.py"), "--output", str(result)])
    code, out = finish(proc, 540)
    seconds = time.monotonic() - start
    assert code == 0, out[-6000:]  # also fails if the notebook leaves files in its working directory
    return nbformat.read(result, as_version=4), seconds


def test_committed_notebook_is_executed_with_its_cells_current():
    """Committed with outputs and its 5 figures, each code cell's recorded source hash matching its source."""
    nb = _committed()
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count == i for i, c in enumerate(code, start=1))
    assert sum("image/png" in o.get("data", {}) for c in code for o in c.outputs) == 5
    _assert_current(nb)


def test_committed_outputs_hold_no_paths_or_timings():
    """No machine-specific path (repo, venv, home, tmp), timestamp or measured timing in the saved outputs."""
    nb = _committed()
    outputs = "".join(str(o) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    for word in (str(ROOT), sys.prefix, os.path.expanduser("~"), "/tmp/", "ddp_reference_"):
        assert word not in outputs, word
    assert "execution" not in str([c.metadata for c in nb.cells])
    assert "DDP communication per step (ms, averaged over DDP's sampled steps and 2 ranks): left out" in outputs


@pytest.mark.slow
def test_committed_outputs_match_a_fresh_run(executed):
    """Every code cell's stdout and stderr lines and image count match a fresh run (decimals within 2%)."""
    _assert_current(_committed(), executed[0])


@pytest.mark.slow
def test_a_stale_notebook_is_caught(tmp_path, executed):
    """Copies with an edited cell, a line or a value the notebook no longer prints fail with the command to run."""
    edited, outdated, moved = _committed(), _committed(), _committed()
    cell = next(c for c in edited.cells if c.cell_type == "code" and "samples per rank" in c.source)
    cell.source = cell.source.replace("samples per rank", "samples on each rank")  # code changed, outputs not
    stream = next(o for c in outdated.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream")
    stream.text = stream.text.replace("rank 0", "rank 1", 1)  # the package changed what an unchanged cell prints
    fit = next(c for c in moved.cells if c.cell_type == "code" and "trainer.fit(" in c.source)
    stdout = next(o for o in fit.outputs if o.output_type == "stream" and o.name == "stdout")
    stdout.text = re.sub(r"final val_acc: [\d.]+", "final val_acc: 0.500", stdout.text)  # beyond the tolerance
    for name, nb, words in (
        ("edited", edited, f"code cell(s) [{edited.cells.index(cell)}] edited"),
        ("outdated", outdated, "cell 3 stdout: committed ['epoch 0, rank 1:"),
        ("moved", moved, "final val_acc: 0.500"),
    ):
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
        with pytest.raises(AssertionError, match=re.escape(words)) as info:
            _assert_current(nbformat.read(tmp_path / f"{name}.ipynb", as_version=4), executed[0])
        assert f"Regenerate them with `{regenerate.COMMAND}`" in str(info.value)
        assert regenerate.COMMAND == "python notebooks/regenerate.py"


def _text(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _all_text(nb: nbformat.NotebookNode) -> str:
    return "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")


@pytest.mark.slow
def test_notebook_draws_its_five_figures(executed):
    """Shard map, gradients, loss/accuracy curves, confusion matrix and prediction grid: 5 readable PNGs."""
    nb, _ = executed
    pngs = [
        base64.b64decode(o.data["image/png"])
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "data" in o and "image/png" in o.data
    ]
    assert len(pngs) == 5
    for png in pngs:
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # the IHDR chunk
        assert png.startswith(PNG_MAGIC) and 1_000 < len(png) < 150_000 and width >= 400 and height >= 150


@pytest.mark.slow
def test_notebook_sharding_gradients_and_weights(executed):
    """Sections 1-3 print disjoint reshuffled shards, differing-then-equal gradients, and equal weights."""
    out = _all_text(executed[0])
    for line in (
        "shards disjoint in every epoch: True",
        "shards cover the data set in every epoch: True",
        "rank 0 reshuffled between epochs: True",
        "samples per rank: [719, 719]",
        "with 1,437 samples: [719, 719] -> repeated for padding: 1",
        "max |grad rank 0 - grad rank 1| after all-reduce: 0.0000",
        "DDP's gradients equal the all-reduced ones: True",
        "averaged gradient == one process's gradient on both batches: True",
        "max |weight rank 0 - weight rank 1| after the step: 0.0000",
    ):
        assert line in out, line
    before = float(re.search(r"before all-reduce: ([\d.]+)", out).group(1))
    moved = float(re.search(r"max \|weight change\| in the step: ([\d.]+)", out).group(1))
    assert before > 0.001 and moved > 0.0001


@pytest.mark.slow
def test_notebook_trains_with_fork_and_shows_rank_zero_diagnostics_once(executed):
    """Section 4 fits in the kernel with start method fork; rank 0's summary and timings appear exactly once."""
    nb, _ = executed
    fit_cell = next(c for c in nb.cells if c.cell_type == "code" and "trainer.fit(" in c.source)
    out = _text(fit_cell)
    assert "start method in this kernel: fork" in out
    assert out.count("DDP fit summary: world size 2 (1 node x 2 processes), backend gloo, start method fork") == 1
    assert "32 per device x 2 processes x 1 accumulation = global batch size 64 samples per step" in out
    assert "1438 training samples, 719 per rank per epoch (0 repeated as padding), 23 batches" in out
    assert out.count("DDP communication per step (ms, averaged over DDP's sampled steps and 2 ranks)") == 1
    assert float(re.search(r"final val_acc: ([\d.]+)", out).group(1)) >= 0.9


@pytest.mark.slow
def test_notebook_checkpoint_inference_and_pitfalls(executed):
    """Sections 5-6: the plain model predicts like the trained one; each pitfall prints its evidence."""
    out = _all_text(executed[0])
    kernel_acc = float(re.search(r"accuracy of the weights in this kernel: ([\d.]+)", out).group(1))
    plain_acc = float(re.search(r"plain DigitsNet accuracy: ([\d.]+)", out).group(1))
    assert plain_acc == kernel_acc >= 0.9
    assert "same predictions as the trained LightningModule: True" in out
    assert re.search(r"DistributedSampler without set_epoch: .*\n  -> same order every epoch: True", out)
    assert re.search(r"EpochSeededDistributedSampler: .*\n  -> same order every epoch: False", out)
    assert "warning: Global batch size 2048 (batch_size=1024 per device x 2 processes) exceeds the 1438" in out
    assert "warning: The training loader's batch_size=64 is the configured batch_size=32 x 2 processes." in out
    assert "batch_size=32 on 2 devices: no warning" in out
    assert "plain load fails: Error(s) in loading state_dict for DigitsNet: Missing key(s)" in out
    assert "after strip_ddp_prefix it loads; keys: ['layers.0.weight', 'layers.0.bias']" in out
    assert "our checkpoint has module. keys: False" in out
    assert "Hint: communication dominates (81% of each step waits for the gradient all-reduce)" in out
    assert "warning: 2 parameter(s) never received a gradient on any rank during fit: aux_head.weight" in out


@pytest.mark.slow
def test_notebook_runs_in_about_a_minute(executed):
    """The whole notebook stays laptop-sized (generous bound: CI machines are shared)."""
    assert executed[1] < 240
