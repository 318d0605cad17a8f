"""The reference notebook runs top to bottom on CPU with 2 processes, draws its figures and prints what it claims."""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "ddp_reference.ipynb"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_notebook_is_saved_without_outputs():
    """The committed notebook carries no outputs or execution counts (small diffs, no stale results)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert nb.metadata.kernelspec.name == "python3"


# Run in a separate interpreter: importing nbclient/jupyter_client here would load ipykernel into pytest's process,
# and MyDDPStrategy takes "ipykernel" in sys.modules as a sign of Jupyter (start method fork) for later tests.
_EXECUTE = """
import sys, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": sys.argv[3]}}).execute()
nbformat.write(nb, sys.argv[2])
"""


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> tuple[nbformat.NotebookNode, float]:
    """The notebook executed by nbclient on the python3 kernel of this interpreter; and its wall time in s."""
    base = tmp_path_factory.mktemp("notebook")
    run_dir, result = base / "cwd", base / "executed.ipynb"
    run_dir.mkdir()
    # The python3 kernelspec runs "python": make that this interpreter (the venv's), whatever PATH says.
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", _EXECUTE, str(NOTEBOOK), str(result), str(run_dir)], env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the notebook did not finish in 540 s:\n{out[-4000:]}") from None
    seconds = time.monotonic() - start
    assert proc.returncode == 0, out[-6000:]
    assert os.listdir(run_dir) == [], "the notebook must clean up after itself"
    return nbformat.read(result, as_version=4), seconds


def _text(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _all_text(nb: nbformat.NotebookNode) -> str:
    return "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")


def test_notebook_draws_its_five_figures(executed):
    """Shard map, gradients, loss/accuracy curves, confusion matrix and prediction grid: 5 small PNGs."""
    nb, _ = executed
    pngs = [base64.b64decode(o.data["image/png"]) for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if "data" in o and "image/png" in o.data]
    assert len(pngs) == 5
    for png in pngs:
        assert png.startswith(PNG_MAGIC) and 1_000 < len(png) < 100_000


def test_notebook_sharding_gradients_and_weights(executed):
    """Sections 1-3 print disjoint reshuffled shards, differing-then-equal gradients, and equal weights."""
    out = _all_text(executed[0])
    for line in ("shards disjoint in every epoch: True", "shards cover the data set in every epoch: True",
                 "rank 0 reshuffled between epochs: True", "samples per rank: [719, 719]",
                 "with 1,437 samples: [719, 719] -> repeated for padding: 1",
                 "max |grad rank 0 - grad rank 1| after all-reduce: 0.0000",
                 "DDP's gradients equal the all-reduced ones: True",
                 "averaged gradient == one process's gradient on both batches: True",
                 "max |weight rank 0 - weight rank 1| after the step: 0.0000"):
        assert line in out, line
    before = float(re.search(r"before all-reduce: ([\d.]+)", out).group(1))
    moved = float(re.search(r"max \|weight change\| in the step: ([\d.]+)", out).group(1))
    assert before > 0.001 and moved > 0.0001


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


def test_notebook_runs_in_about_a_minute(executed):
    """The whole notebook stays laptop-sized (generous bound: CI machines are shared)."""
    assert executed[1] < 240
