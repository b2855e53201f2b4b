"""OpenAI request bodies -> SamplingParams, and the errors for what the server refuses (no server needed)."""

from __future__ import annotations

import pytest

from sparseserve_hf.serve.protocol import ApiError, chat_request, parse_chat, parse_completion


def completion(**fields):
    return parse_completion({"prompt": "hi", **fields}, "m", 100)


def test_openai_defaults_and_every_supported_field():
    parsed = completion()
    assert parsed.params.max_new_tokens == 16 and parsed.params.temperature == 1.0 and not parsed.stream
    parsed = completion(model="m", max_tokens=5, temperature=0, top_p=0.5, top_k=3, seed=7, stop="x", n=1, user="u",
                        stream=True, stream_options={"include_usage": True})  # fmt: skip
    p = parsed.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (5, 0.0, 0.5, 3, 7, ("x",))
    assert parsed.stream and parsed.include_usage


def test_token_id_prompts_and_a_batch_of_one():
    assert parse_completion({"prompt": [1, 2, 3]}, "m", 100).prompt == [1, 2, 3]
    assert parse_completion({"prompt": ["hello"]}, "m", 100).prompt == "hello"


@pytest.mark.parametrize(
    "fields,status,param",
    [
        ({"logprobs": 2}, 400, "logprobs"),
        ({"echo": True, "best_of": 2}, 400, "best_of"),
        ({"bogus": 1}, 400, "bogus"),
        ({"n": 2}, 400, "n"),
        ({"max_tokens": -1}, 400, "max_tokens"),
        ({"max_tokens": 1.5}, 400, "max_tokens"),
        ({"temperature": -0.1}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"top_k": -1}, 400, "top_k"),
        ({"seed": -3}, 400, "seed"),
        ({"stop": ["a", ""]}, 400, "stop"),
        ({"stream": "yes"}, 400, "stream"),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": [1] * 100}, 400, "prompt"),
        ({"prompt": [[1], [2]]}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"model": "other"}, 404, "model"),
    ],
)
def test_refused_requests_name_the_field(fields, status, param):
    with pytest.raises(ApiError) as err:
        completion(**fields)
    assert err.value.status == status and err.value.param == param
    body = err.value.body()["error"]
    assert body["code"] == status and param in body["message"] or param == "prompt"


def test_a_missing_prompt_and_a_body_that_is_not_an_object():
    for body in ({}, [1, 2], "x"):
        with pytest.raises(ApiError) as err:
            parse_completion(body, "m", 100)
        assert err.value.status == 400


def test_chat_messages_and_the_default_length_is_the_rest_of_the_context():
    messages, fields = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, "m", 100)
    assert messages == [{"role": "user", "content": "hi"}]
    assert chat_request(fields, [1] * 30, 100).params.max_new_tokens == 70
    _, fields = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}, "m", 100)
    assert chat_request(fields, [1] * 30, 100).params.max_new_tokens == 4


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"content": "x"}],
        [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        [{"role": "user", "content": "x", "tool_calls": []}],
    ],
)
def test_chat_refuses_messages_it_cannot_template(messages):
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": messages}, "m", 100)
    assert err.value.status == 400 and err.value.param == "messages"
