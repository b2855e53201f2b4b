"""The OpenAI-compatible server end to end: a subprocess on a tiny random model, the real `openai` client."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest
from served import Server, tiny_model_folder
from transformers import AutoModelForCausalLM, AutoTokenizer

from sparseserve_hf import SparseServeConfig
from sparseserve_hf.generation import Generator, SamplingParams

KEY = "test-key"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    running = Server(folder, "--api-key", KEY, log=tmp_path_factory.mktemp("log") / "server.log")
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def in_process(folder):
    """The same model and tokenizer in this process: what the server's greedy answers must equal."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sparseserve").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return Generator(model, tokenizer, SparseServeConfig()), tokenizer


def words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(2, 256)}" for _ in range(count))


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_health_models_and_auth(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/v1/models").status_code == 401  # no key at all
    assert httpx.get(f"{server.url}/metrics").status_code == 200  # scrapers need no key


def test_greedy_completions_equal_the_in_process_generator_streamed_or_not(client, in_process):
    generator, _ = in_process
    prompt = words(40, seed=1)
    want = generator.generate(prompt, SamplingParams(max_new_tokens=12))[0]
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == want.text and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(want.prompt_token_ids), 12)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_greedy_chat_equals_the_generator_on_the_templated_prompt(client, in_process):
    generator, tokenizer = in_process
    messages = [{"role": "system", "content": words(5, 2)}, {"role": "user", "content": words(30, 3)}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))["input_ids"]
    want = generator.generate([ids], SamplingParams(max_new_tokens=9))[0]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0)
    assert reply.choices[0].message.content == want.text and reply.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_seeded_sampling_repeats_and_stop_strings_cut_the_text(client):
    prompt = words(20, seed=4)
    runs = [client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.9, top_p=0.9, seed=11, extra_body={"top_k": 20})
            for _ in range(2)]  # fmt: skip
    assert runs[0].choices[0].text == runs[1].choices[0].text
    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    stop = greedy.split()[2]
    cut = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and greedy.startswith(cut.text)


def test_bad_requests_get_openai_errors_and_leave_a_running_request_alone(server, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    running = client.completions.create(model="tiny", prompt=words(10, 5), max_tokens=60, temperature=0, stream=True)
    first = next(iter(running))
    bad = [
        ({"prompt": "w2", "logprobs": 1}, 400, "logprobs"),
        ({"prompt": "w2", "n": 2}, 400, "n"),
        ({"prompt": "w2", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "w2", "temperature": -1}, 400, "temperature"),
        ({"prompt": [3] * 2048}, 400, "prompt"),  # the tiny model's context is 2048
        ({"prompt": "w2", "frobnicate": 1}, 400, "frobnicate"),
        ({"prompt": "w2", "model": "gpt-9"}, 404, "model"),
    ]
    for body, status, param in bad:
        answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
        assert answer.status_code == status, body
        assert answer.json()["error"]["param"] == param and answer.json()["error"]["message"]
    garbled = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers=headers)
    assert garbled.status_code == 400
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="w2", logprobs=2)
    rest = list(running)
    assert first.choices[0].text is not None and rest[-1].choices[0].finish_reason == "length"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_32_concurrent_clients_some_disconnecting_leave_nothing_behind(server):
    """8 of 32 streaming clients hang up after their first chunk: the other 24 complete, every
    request ends (the dropped ones cancelled, their blocks freed), and /metrics counts what the clients saw."""
    before = {
        r: metric(server.url, f'sparseserve_requests_total{{finish_reason="{r}"}}') for r in ("length", "cancelled")
    }

    async def one(index: int) -> tuple[str, int]:
        body = {"prompt": words(30 + index, 100 + index), "max_tokens": 24, "temperature": 0, "stream": True}
        async with (
            httpx.AsyncClient(timeout=120) as http,
            http.stream(
                "POST", f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
            ) as reply,
        ):
            assert reply.status_code == 200
            texts, reason = [], None
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                texts.append(choice["text"])
                reason = choice["finish_reason"] or reason
                if index % 4 == 0:
                    return "dropped", 0  # leaves the stream: the connection closes
            return reason, len("".join(texts).split())

    async def everyone():
        return await asyncio.gather(*(one(i) for i in range(32)))

    results = asyncio.run(everyone())
    assert sorted(r for r, _ in results).count("length") == 24 and [r for r, _ in results].count("dropped") == 8
    assert all(n == 24 for r, n in results if r == "length")  # one word per token
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and metric(server.url, "sparseserve_requests_running") + metric(
        server.url, "sparseserve_requests_waiting"
    ):
        time.sleep(0.2)
    time.sleep(1.0)  # the engine's gauges refresh when it goes idle
    after = {
        r: metric(server.url, f'sparseserve_requests_total{{finish_reason="{r}"}}') for r in ("length", "cancelled")
    }
    assert after["length"] - before["length"] == 24 and after["cancelled"] - before["cancelled"] == 8
    assert (
        metric(server.url, "sparseserve_requests_running") == 0
        and metric(server.url, "sparseserve_requests_waiting") == 0
    )
    assert metric(server.url, "sparseserve_dram_kv_bytes") == 0
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_full_queue_gets_503(folder, tmp_path):
    full = Server(folder, "--max-queue", "0", log=tmp_path / "full.log")
    try:
        answer = httpx.post(f"{full.url}/v1/completions", json={"prompt": "w2 w3", "max_tokens": 2})
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "overloaded"
    finally:
        assert full.stop() == 0


def test_timeout_and_sigterm_let_running_requests_finish_and_exit_0(folder, tmp_path):
    slow = Server(folder, "--request-timeout", "1.5", "--grace-seconds", "60", log=tmp_path / "slow.log")
    try:
        client = openai.OpenAI(base_url=f"{slow.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(
                model="tiny", prompt=words(10, 7), max_tokens=1900, temperature=0, extra_body={"top_k": 0}
            )
        assert err.value.status_code == 504
        stream = client.completions.create(model="tiny", prompt=words(10, 8), max_tokens=40, temperature=0, stream=True)
        first = next(iter(stream))
        slow.process.send_signal(15)  # SIGTERM while the stream runs
        rest = list(stream)
        assert first.choices and rest[-1].choices[0].finish_reason == "length"
        assert slow.process.wait(60) == 0
    finally:
        slow.stop()


def test_http_load_runs_a_poisson_trace_through_the_server(server):
    """`eval.serving.http_load`: every request completes with its exact token count, summarized as in-process runs are."""
    from eval.serving.http_load import run_load, synthetic_trace

    trace = synthetic_trace(12, prompt_tokens=40, output_tokens=10, vocab=256, seed=3)
    records = asyncio.run(run_load(server.url, trace, rate=20.0, api_key=KEY))
    assert all(r.error is None and len(r.token_times) == 10 and r.finish_reason == "length" for r in records)
    from eval.serving.metrics import summarize

    summary = summarize(records)
    assert summary["completed"] == 12 and summary["failed"] == 0 and summary["p50_ttft_s"] > 0


def test_two_engines_behind_one_server_answer_as_one_engine_does(folder, tmp_path, in_process):
    """`--devices cpu,cpu`: a GeneratorGroup of two replicas serves the same endpoints; greedy
    answers equal the in-process Generator's, and /metrics reports both engines' work."""
    group = Server(folder, "--devices", "cpu,cpu", "--api-key", KEY, log=tmp_path / "group.log")
    try:
        client = openai.OpenAI(base_url=f"{group.url}/v1", api_key=KEY, max_retries=0)
        generator, _ = in_process
        prompts = [words(30 + 7 * i, seed=i) for i in range(4)]
        want = [out.text for out in generator.generate(prompts, SamplingParams(max_new_tokens=6))]

        async def ask_all() -> list[str]:
            aclient = openai.AsyncOpenAI(base_url=f"{group.url}/v1", api_key=KEY, max_retries=0)
            answers = await asyncio.gather(
                *(aclient.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0) for p in prompts)
            )
            return [a.choices[0].text for a in answers]

        assert asyncio.run(ask_all()) == want
        assert client.models.list().data[0].id
        time.sleep(1.2)  # engine figures are published at most once a second
        assert metric(group.url, "sparseserve_dram_kv_bytes") == 0
    finally:
        assert group.stop() == 0
