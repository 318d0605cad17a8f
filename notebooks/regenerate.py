"""Execute ``notebooks/ddp_reference.ipynb`` and save it with its outputs: ``python notebooks/regenerate.py``.

The notebook is committed executed, so that a viewer without a kernel shows its figures. This script is the one
way to write those outputs, so that regenerating them gives a small diff: no execution timestamps
(``record_timing=False``), stream outputs merged per cell and name, and the communication timings the strategy logs
at fit end (they change every run) left out. Each code cell records the SHA-256 of its source in its metadata
(``source_sha256``): ``tests/reference/test_notebook.py`` fails when a cell was edited without regenerating, and
when a fresh run's outputs (:func:`comparable`) differ from the committed ones.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import sys
import tempfile
from pathlib import Path

import nbformat

NOTEBOOK = Path(__file__).with_name("ddp_reference.ipynb")
COMMAND = "python notebooks/regenerate.py"
_TIMINGS = re.compile(r"(DDP communication per step \(ms, [^)]*\)):.*(\nHint: communication dominates.*)?")
_FLOAT = re.compile(r"\d+\.\d+")


def source_hash(cell: nbformat.NotebookNode) -> str:
    """The first 16 hex digits of the SHA-256 of a cell's source (UTF-8)."""
    return hashlib.sha256(cell.source.encode()).hexdigest()[:16]


def stale_cells(nb: nbformat.NotebookNode) -> list[int]:
    """Indices of the code cells whose source changed since their outputs were written (or that have none)."""
    return [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and cell.metadata.get("source_sha256") != source_hash(cell)
    ]


def comparable(nb: nbformat.NotebookNode) -> list[tuple[int, str, list[str]]]:
    """What a fresh run must reproduce: per code cell, its stdout and its stderr lines, and its number of images
    (figures are counted, not compared pixel by pixel)."""
    result = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            for name in ("stdout", "stderr"):
                text = "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == name)
                result.append((i, name, text.splitlines()))
            result.append((i, "images", [str(sum("image/png" in o.get("data", {}) for o in cell.outputs))]))
    return result


def _same(old: list[str], new: list[str]) -> bool:
    """Equal lines in any order (the ranks' lines interleave freely), numbers with a decimal point within 2%."""

    def key(line: str) -> str:
        return _FLOAT.sub("#", line)

    old, new = sorted(old, key=key), sorted(new, key=key)
    return len(old) == len(new) and all(
        key(a) == key(b)
        and all(
            math.isclose(float(x), float(y), rel_tol=0.02, abs_tol=0.01)
            for x, y in zip(_FLOAT.findall(a), _FLOAT.findall(b), strict=True)
        )
        for a, b in zip(old, new, strict=True)
    )


def differences(committed: nbformat.NotebookNode, fresh: nbformat.NotebookNode) -> list[str]:
    """The parts of :func:`comparable` in which a fresh run differs from the committed notebook; [] if none."""
    if len(comparable(committed)) != len(comparable(fresh)):
        return ["the number of code cells differs"]
    return [
        f"cell {i} {name}: committed {old!r}, fresh run {new!r}"
        for (i, name, old), (_, _, new) in zip(comparable(committed), comparable(fresh), strict=True)
        if not _same(old, new)
    ]


def regenerate(output: Path) -> None:
    """Execute :data:`NOTEBOOK` on the ``python3`` kernel of this interpreter, in an empty temporary folder, and write
    it with its outputs to ``output``. Raises ``RuntimeError`` if the notebook leaves files in that folder."""
    from nbclient import NotebookClient  # here: it loads jupyter_client, which test processes must not import

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The python3 kernelspec runs "python": make that this interpreter (the venv's), whatever PATH says.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    with tempfile.TemporaryDirectory(prefix="ddp_reference_run_") as cwd:
        NotebookClient(
            nb, timeout=300, kernel_name="python3", record_timing=False, resources={"metadata": {"path": cwd}}
        ).execute()
        if os.listdir(cwd):
            raise RuntimeError(f"the notebook left files in its working directory: {sorted(os.listdir(cwd))}")
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.metadata["source_sha256"] = source_hash(cell)
            streams: dict[str, nbformat.NotebookNode] = {}  # each stream's first output, which gets the rest
            outputs = []
            for out in cell.outputs:
                if out.output_type == "stream" and out.name in streams:
                    streams[out.name].text += out.text
                else:
                    outputs.append(out)
                    streams.update({out.name: out} if out.output_type == "stream" else {})
            if "stderr" in streams:
                streams["stderr"].text = _TIMINGS.sub(
                    r"\1: left out of the saved notebook (they change every run)", streams["stderr"].text
                )
            cell.outputs = outputs
    nbformat.validate(nb)
    nbformat.write(nb, output)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=NOTEBOOK, help="where to write it (default: in place)")
    regenerate(parser.parse_args().output)
