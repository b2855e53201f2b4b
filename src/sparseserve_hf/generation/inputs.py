"""What users hand the Generator, checked before any engine state changes.

Prompts: what counts as one prompt (against a list of them) and its token ids. Constructor
arguments: the model, tokenizer, config and metrics file. Wrong types raise TypeError naming the
argument, wrong shapes ValueError; the vocabulary and context checks live in `EngineSizes`.
"""

from __future__ import annotations

import io
import numbers
import os
from collections.abc import Sequence
from typing import IO, Any

import torch

from ..config import SparseServeConfig

PROMPT_KINDS = "a str, a flat list/tuple of int token ids or a 1-D integer tensor"


def is_single_prompt(prompts: object) -> bool:
    """True when `prompts` is one prompt rather than a list of prompts.

    One prompt: a str (or bytes, refused later by `prompt_token_ids`), a tensor or array of at
    most one dimension, or a non-empty sequence whose first element is a scalar (a flat list of
    token ids). A 2-D tensor is a list of rows; `[]` is an empty list of prompts.
    """
    if isinstance(prompts, (str, bytes, bytearray)):
        return True
    if isinstance(prompts, torch.Tensor) or _is_array(prompts):
        return len(prompts.shape) <= 1
    if isinstance(prompts, Sequence) and len(prompts) > 0:
        return not _is_container(prompts[0])
    return False


def as_prompt_list(prompts: object) -> list[Any]:
    """`prompts` as a list of prompts: one prompt becomes a list of one (as vLLM's `LLM.generate`).

    Raises:
        TypeError: `prompts` is neither a prompt nor a sequence of prompts (None, an int, a dict...).
    """
    if is_single_prompt(prompts):
        return [prompts]
    if isinstance(prompts, torch.Tensor) or _is_array(prompts) or isinstance(prompts, Sequence):
        return list(prompts)
    raise TypeError(f"prompts must be one prompt ({PROMPT_KINDS}) or a list of them, got {type(prompts).__name__}")


def prompt_token_ids(prompt: object, tokenizer: Any) -> tuple[int, ...]:
    """The token ids of one prompt (a str is tokenized as is, without a chat template).

    Raises:
        TypeError: `prompt` is not one of PROMPT_KINDS, or holds non-int ids (bools, floats,
            nested lists), or is a tensor of a non-integer dtype.
        ValueError: a str without a tokenizer, or a tensor that is not (T,) or (1, T).
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a string prompt needs a tokenizer: pass one to Generator or give token ids")
        return _ids_of(tokenizer(prompt)["input_ids"], "the tokenizer's input_ids")
    return _ids_of(prompt, "prompt")


def _ids_of(prompt: object, name: str) -> tuple[int, ...]:
    if _is_array(prompt):
        prompt = _array_as_tensor(prompt, name)
    if isinstance(prompt, torch.Tensor):
        return _tensor_ids(prompt, name)
    if isinstance(prompt, (str, bytes, bytearray)) or not isinstance(prompt, Sequence):
        hint = " (pass its ['input_ids'])" if isinstance(prompt, dict) or hasattr(prompt, "input_ids") else ""
        raise TypeError(f"{name} must be {PROMPT_KINDS}, got {type(prompt).__name__}{hint}")
    if set(map(type, prompt)) <= {int}:  # plain ints, checked in C: no Python check per token
        return tuple(prompt)
    return tuple(_token_id(token, position, name) for position, token in enumerate(prompt))


def _tensor_ids(prompt: torch.Tensor, name: str) -> tuple[int, ...]:
    if prompt.dtype == torch.bool or prompt.dtype.is_floating_point or prompt.dtype.is_complex:
        raise TypeError(f"{name} tensor must have an integer dtype (token ids), got {prompt.dtype}")
    if prompt.dim() not in (1, 2) or (prompt.dim() == 2 and prompt.shape[0] != 1):
        raise ValueError(f"a {name} tensor must be (T,) or (1, T), got {tuple(prompt.shape)}")
    return tuple(prompt.flatten().tolist())


def _token_id(token: object, position: int, name: str) -> int:
    # numbers.Integral admits numpy integers; bool is an int to Python but never a token id.
    if isinstance(token, numbers.Integral) and not isinstance(token, bool):
        return int(token)
    if _is_container(token):
        raise TypeError(
            f"{name} must be a flat sequence of token ids, got a nested {type(token).__name__} at position "
            f"{position} (give several prompts to generate/stream, one to submit)"
        )
    raise TypeError(f"{name} token ids must be ints, got {type(token).__name__} {token!r} at position {position}")


def _array_as_tensor(prompt: Any, name: str) -> torch.Tensor:
    try:
        return torch.as_tensor(prompt)
    except (TypeError, RuntimeError, ValueError) as exc:  # object arrays, ragged nests
        raise TypeError(f"{name} must be {PROMPT_KINDS}, got an array torch cannot read: {exc}") from exc


def _is_array(value: object) -> bool:
    """A numpy-style array (not a tensor, not a list): read like a tensor."""
    return hasattr(value, "__array__") and hasattr(value, "shape") and not isinstance(value, (torch.Tensor, Sequence))


def _is_container(value: object) -> bool:
    return isinstance(value, (str, bytes, bytearray, Sequence, torch.Tensor)) or _is_array(value)


# ---- constructor arguments ------------------------------------------------------------------------


def check_engine_arguments(model: object, tokenizer: object, config: object) -> None:
    """Raise TypeError for a model, tokenizer or config of the wrong kind, naming the argument.

    The commonest slip, `Generator(model, SparseServeConfig(...))`, puts the config where the
    tokenizer goes; accepted, it failed only inside every later `step()`.
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(
            f"model must be a transformers causal LM (a torch.nn.Module with a .config), got {_kind(model)}"
        )
    if isinstance(tokenizer, SparseServeConfig):
        raise TypeError(
            "tokenizer is a SparseServeConfig: the config goes third, Generator(model, tokenizer, config), "
            "or by keyword, Generator(model, config=...)"
        )
    if tokenizer is not None and not (callable(tokenizer) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(
            f"tokenizer must be None or a tokenizer (callable, with .decode), got {_kind(tokenizer)}"
            + (" (load it with AutoTokenizer.from_pretrained)" if isinstance(tokenizer, (str, os.PathLike)) else "")
        )
    if config is not None and not isinstance(config, SparseServeConfig):
        hint = " (SparseServeConfig.from_dict(...) builds one from a dict)" if isinstance(config, dict) else ""
        raise TypeError(f"config must be a SparseServeConfig or None, got {_kind(config)}{hint}")


def metrics_sink(metrics_file: object) -> str | IO[str] | None:
    """`metrics_file` as `MetricsRecorder` takes it: None, a path (str; path-likes converted) or a
    text handle. Checked now, since it is first written when a request finishes, mid-`step()`.

    Raises:
        TypeError: not a path or a text handle (a binary handle, bytes path, anything else).
        ValueError: a path whose folder does not exist, or a folder.
    """
    if metrics_file is None:
        return None
    if isinstance(metrics_file, (str, os.PathLike)):
        path = os.fspath(metrics_file)
        if not isinstance(path, str):
            raise TypeError(f"metrics_file must be a str path, a path-like or a text handle, got {path!r}")
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path) or not os.path.isdir(folder):
            raise ValueError(f"metrics_file must be a file path in an existing folder, got {path!r}")
        return path
    if isinstance(metrics_file, (io.RawIOBase, io.BufferedIOBase)):
        raise TypeError("metrics_file is a binary handle: open it in text mode ('a' or 'w', not 'ab'/'wb')")
    if not callable(getattr(metrics_file, "write", None)):
        raise TypeError(f"metrics_file must be None, a path or a text handle (with .write), got {_kind(metrics_file)}")
    return metrics_file


def _kind(value: object) -> str:
    return "None" if value is None else type(value).__name__
