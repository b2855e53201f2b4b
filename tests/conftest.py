"""Suite-wide test behaviour and the shared fixtures: marker handling, seeding, CPU threads, tiny models.

The folders mirror the package: tests of a subpackage's modules sit in the folder of that name
(`cache/`, `ops/`, `generation/`, `serve/`, `data/`), tests of the top-level modules (the decode
step, the config, the scorers) here, beside the helpers every folder imports (`tiny_models`,
`kernel_support`, `fake_graphs`, `sync_guard`, `toy_tokenizer`); `eval/`, `examples/` and
`notebooks/` test the folders of those names. Kinds of test are markers, declared in pyproject.toml
([tool.pytest.ini_options]): `gpu`, `slow`, `core`. `ops/conftest.py` adds the kernel fixtures.
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


@pytest.fixture(scope="module")
def llama():
    """Tiny fp32 Llama, 4 query / 2 KV heads, 2 layers, loaded with attn_implementation="sparseserve"."""
    from tiny_models import tiny_model  # imports transformers: only after TRITON_INTERPRET is set above

    return tiny_model("llama")


@pytest.fixture(scope="module")
def llama_sdpa():
    """The same weights under stock SDPA attention."""
    from tiny_models import tiny_model

    return tiny_model("llama", "sdpa")
