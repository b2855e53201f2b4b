"""Suite-wide test behaviour: marker handling, seeding and CPU threads.

Markers are declared in pyproject.toml ([tool.pytest.ini_options]). Fixtures live in the
conftest.py files of the sub-suites (unit/, ops/, integration/).
"""

import os

import pytest
import torch

torch.set_num_threads(os.cpu_count() or 1)

if not torch.cuda.is_available():
    # Triton's CPU interpreter must be on before anything imports triton: `import transformers`
    # does (tests in every folder), and triton.language's own @jit helpers (tl.zeros...) made before
    # the switch fail inside interpreted kernels. tests/ops/conftest.py alone was too late whenever
    # another folder ran first in the same pytest process. `import torch` does not import triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`-marked tests when CUDA is unavailable."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def seed():
    """Seed torch before every test so random inputs are reproducible."""
    torch.manual_seed(0)
    return 0
