"""assets/demo.ipynb runs end to end in a fresh kernel of this venv's Python without an error.

Checks that every cell executes, the trace's rich display and the figures produce output, and that
the kernel ran this venv's interpreter. Does not check what the figures look like (test_plots.py does).
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "assets" / "demo.ipynb"
PLOTLY_MIME = "application/vnd.plotly.v1+json"


@pytest.mark.slow
def test_demo_notebook_runs_end_to_end_without_errors(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    # The "python3" kernel spec starts `python`, which jupyter_client maps to sys.executable (this venv).
    client = NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    code = [c for c in nb.cells if c.cell_type == "code"]
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert code[-1].outputs[0]["text"].strip() == sys.executable
    assert any('class="slmviz-trace"' in o.get("data", {}).get("text/html", "") for o in outputs)
    html = [o.get("data", {}).get("text/html", "") for o in outputs]
    figures = [o for o, h in zip(outputs, html, strict=True) if PLOTLY_MIME in o.get("data", {}) or "plotly" in h]
    assert len(figures) >= 6
