"""`sparseserve-hf serve [MODEL_FOLDER]`: load a model, start the engine, serve the OpenAI API.

Every engine option defaults to `SparseServeConfig()`'s value; only the options given change it.
SIGTERM (or Ctrl-C) stops accepting requests, lets the running ones finish for up to
`--grace-seconds`, stops the engine and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

GIB = 1 << 30
DTYPES = ("auto", "float32", "bfloat16", "float16")
# SparseServeConfig fields a deployer tunes: (flag, field, type); sizes in GiB are converted to bytes.
CONFIG_FLAGS: tuple[tuple[str, str, type], ...] = (
    ("--block-size", "block_size", int),
    ("--token-budget", "token_budget", int),
    ("--sink-blocks", "sink_blocks", int),
    ("--window-blocks", "window_blocks", int),
    ("--metadata", "metadata", str),
    ("--selection", "selection", str),
    ("--max-batch", "max_batch", int),
    ("--max-batch-tokens", "max_batch_tokens", int),
    ("--working-set-window", "working_set_window", int),
    ("--prefill-mode", "prefill_mode", str),
    ("--max-inject-tokens", "max_inject_tokens", int),
    ("--target-tbt-ms", "target_tbt_ms", float),
    ("--backend", "backend", str),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`sparseserve-hf COMMAND ...` (one command so far: serve)."""
    parser = argparse.ArgumentParser(prog="sparseserve-hf", description="sparseserve_hf command line")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="an OpenAI-compatible server on the Generator", description=__doc__)
    add_serve_arguments(serve)
    return parser.parse_args(argv)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve options: where to listen, the model, auth and limits, and the engine's config."""
    parser.add_argument("model", nargs="?", default=None, help="a model folder (default: the default real model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help=f"the model's weights ({', '.join(DTYPES)}; auto: the folder's)"
    )
    parser.add_argument(
        "--device", default="auto", help="'auto' (CUDA when there is one), 'cpu', 'cuda', 'cuda:1', ..."
    )
    parser.add_argument(
        "--devices",
        default=None,
        help="data parallel: one engine per device, comma-separated (e.g. cuda:0,cuda:1); overrides --device",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients pass as `model` (default: the folder's)"
    )
    parser.add_argument("--api-key", default=None, help="bearer token for /v1 (default: no auth)")
    parser.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond which new ones get 503")
    parser.add_argument("--request-timeout", type=float, default=None, help="seconds one request may take")
    parser.add_argument(
        "--grace-seconds", type=float, default=30.0, help="on SIGTERM, how long running requests may finish"
    )
    parser.add_argument("--log-level", default="info", help="uvicorn's and the engine's log level")
    engine = parser.add_argument_group("engine (SparseServeConfig; each defaults to the config's default)")
    for flag, name, kind in CONFIG_FLAGS:
        engine.add_argument(flag, dest=name, type=kind, default=None, help=f"SparseServeConfig.{name}")
    engine.add_argument("--hbm-cache-gib", type=float, default=None, help="device block cache (default: unlimited)")
    engine.add_argument("--dram-gib", type=float, default=None, help="host block pool (default: grows on demand)")
    engine.add_argument("--cuda-graphs", action="store_true", default=None, help="decode steps as CUDA-graph replays")
    engine.add_argument(
        "--no-admission", dest="admission", action="store_false", default=None, help="admit without working-set control"
    )
    engine.add_argument(
        "--no-reserve-decode",
        dest="reserve_decode",
        action="store_false",
        default=None,
        help="start a request once its prefill fits, not only where it could also decode beside those in flight "
        "(SparseServeConfig.reserve_decode=False)",
    )


def engine_config(args: argparse.Namespace) -> Any:
    """The SparseServeConfig the options describe (ValueError names a bad one)."""
    from .. import SparseServeConfig

    values = {name: getattr(args, name) for _, name, _ in CONFIG_FLAGS if getattr(args, name) is not None}
    for flag, name in (("hbm_cache_gib", "hbm_cache_bytes"), ("dram_gib", "dram_bytes")):
        if getattr(args, flag) is not None:
            values[name] = int(getattr(args, flag) * GIB)
    for name in ("cuda_graphs", "admission", "reserve_decode"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    return SparseServeConfig(**values)


def load(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """(model, tokenizer, served name) on the chosen device, attn_implementation="sparseserve"."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import sparseserve_hf  # noqa: F401  registers attn_implementation="sparseserve"
    from sparseserve_hf.data.models import prepare_default_model

    folder = Path(args.model) if args.model is not None else prepare_default_model()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sparseserve").to(device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model.eval(), tokenizer, args.served_model_name or folder.name


def main(argv: list[str] | None = None) -> None:
    """Run the command until SIGTERM; bad options exit non-zero with a message before any loading."""
    args = parse_args(argv)
    try:
        config = engine_config(args)
    except (TypeError, ValueError) as exc:
        sys.exit(f"sparseserve-hf serve: {exc}")
    if args.max_queue < 0:
        sys.exit("sparseserve-hf serve: --max-queue must be >= 0")
    import uvicorn

    from ..cache.forward_log import PositionLimit
    from ..generation import Generator, GeneratorGroup
    from .app import ServerSettings, create_app
    from .engine import EngineThread
    from .metrics import ServerMetrics

    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices is not None else None
    if devices is not None and not devices:
        sys.exit("sparseserve-hf serve: --devices must name at least one device, e.g. cuda:0,cuda:1")
    if devices is not None:
        args.device = devices[0]
    model, tokenizer, name = load(args)
    metrics = ServerMetrics()
    if devices is None:
        generator = Generator(model, tokenizer, config)
    else:
        generator = GeneratorGroup.replicate(model, tokenizer, config, devices=devices)
    engine = EngineThread(generator, metrics.finished, metrics.engine_totals)
    settings = ServerSettings(
        model_name=name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        context_length=PositionLimit.of(model.config.get_text_config()).limit,
    )
    app = create_app(engine, tokenizer, settings, metrics)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it with the handler it found: make
    # that one a clean exit, so a stopped server exits 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=args.grace_seconds
    )


if __name__ == "__main__":
    main()
