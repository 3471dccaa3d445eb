"""notebooks/attention_analysis.ipynb runs headless from top to bottom and is committed without outputs."""
import nbformat
import pytest
from helpers import ROOT
from nbclient import NotebookClient

NOTEBOOK = ROOT / "notebooks" / "attention_analysis.ipynb"


def test_notebook_is_committed_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") and cell.get("execution_count") is None
               for cell in notebook.cells if cell.cell_type == "code")


@pytest.mark.slow  # executes the notebook
def test_notebook_executes(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "| deit_tiny_mhla | 196 | 64 |" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)
