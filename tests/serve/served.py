"""A real server in a subprocess (`python -m sparseserve_hf.serve`), for the HTTP tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 180.0


def tiny_model_folder(folder: Path) -> Path:
    """The tests' tiny Llama (random weights, seed 0) and a word tokenizer with a chat template, saved."""
    from tiny_models import VOCAB, tiny_model
    from toy_tokenizer import word_tokenizer

    tiny_model("llama", attn="sdpa").save_pretrained(folder)
    word_tokenizer(vocab_size=VOCAB).save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`python -m sparseserve_hf.serve FOLDER --port P ARGS...`, waited for until /health says ok."""

    def __init__(self, folder: Path | None, *args: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "sparseserve_hf.serve"]
        command += ([str(folder)] if folder is not None else []) + ["--port", str(self.port), "--device", "cpu", *args]
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        self.log = log
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {STARTUP_S} s:\n{self.log.read_text()}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
