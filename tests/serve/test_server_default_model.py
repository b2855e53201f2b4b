"""The server on the default real model (no model folder given), and the command's own refusals."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from served import ROOT, Server

from sparseserve_hf import SparseServeConfig
from sparseserve_hf.data.models import load_default
from sparseserve_hf.generation import Generator, SamplingParams


@pytest.mark.slow
def test_the_default_model_answers_a_chat_as_the_in_process_generator_does(tmp_path):
    server = Server(None, "--served-model-name", "smollm2", "--token-budget", "512", log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
        model, tokenizer = load_default()
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        want = Generator(model, tokenizer, SparseServeConfig(token_budget=512)).generate(
            [ids], SamplingParams(max_new_tokens=8)
        )
        assert reply.choices[0].message.content == want[0].text and "Paris" in want[0].text
    finally:
        assert server.stop() == 0


def test_bad_engine_options_stop_the_command_with_a_message():
    command = [sys.executable, "-m", "sparseserve_hf.serve", "--token-budget", "3", "--device", "cpu"]
    done = subprocess.run(
        command,
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""},
    )
    assert done.returncode != 0 and "token_budget" in done.stderr
