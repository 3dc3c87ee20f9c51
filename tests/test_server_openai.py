"""The server through the official ``openai`` client, against FakeEngine (outputs known by hand)."""

import openai
import pytest
import requests

from tests.fake_engine import FakeEngine, RunningServer

PROMPT = "the cat sat"


@pytest.fixture(scope="module")
def server():
    with RunningServer(FakeEngine(max_model_len=64, max_num_seqs=4), api_key="sk-test") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-test", max_retries=0, timeout=30)


def echo(tokenizer, text: str, num: int, offset: int = 0) -> str:
    """What FakeEngine generates for a prompt: its content tokens, cycled from ``offset``."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode([ids[(i + offset) % len(ids)] for i in range(num)])


def test_completion_text_usage_and_finish_reason(client, server):
    tok = server.engine.tokenizer
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text == echo(tok, PROMPT, 4)
    assert r.choices[0].finish_reason == "length"
    prompt_tokens = len(tok.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt_tokens, 4, prompt_tokens + 4)


def test_completion_n_and_several_prompts_index_like_openai(client, server):
    tok = server.engine.tokenizer
    prompts = [PROMPT, "on the mat"]
    r = client.completions.create(model=server.model, prompt=prompts, max_tokens=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    expected = [echo(tok, p, 3, s) for p in prompts for s in range(2)]
    assert [c.text for c in r.choices] == expected
    assert r.usage.completion_tokens == 12


def test_completion_token_id_prompt_echo_and_stop(client, server):
    tok = server.engine.tokenizer
    ids = tok.encode(PROMPT, add_special_tokens=False)
    r = client.completions.create(model=server.model, prompt=ids, max_tokens=5, echo=True)
    assert r.choices[0].text == PROMPT + echo(tok, PROMPT, 5)
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=10, stop=[" s"])
    assert r.choices[0].text == "the cat" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == " s"
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=10,
                                  extra_body={"stop_token_ids": [ids[2]], "min_tokens": 1, "top_k": 5,
                                              "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True})
    assert r.choices[0].text == echo(tok, PROMPT, 3) and r.choices[0].finish_reason == "stop"


def test_completion_logprobs(client, server):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([-0.1, -0.2, -0.3])
    tok = server.engine.tokenizer
    tokens = [tok.decode([i]) for i in tok.encode(PROMPT, add_special_tokens=False)[:3]]
    assert lp.tokens == tokens
    assert all(len(top) == 2 for top in lp.top_logprobs)  # the top 2 (the sampled token is the best here)
    assert lp.text_offset == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]


def test_chat_and_chat_logprobs(client, server):
    tok = server.engine.tokenizer
    messages = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=4,
                                       logprobs=True, top_logprobs=2, seed=1)
    ids = [t for t in tok.encode_chat(messages) if t < 507]  # content tokens, specials dropped
    assert r.choices[0].message.content == tok.decode(ids[:4])
    assert r.choices[0].message.role == "assistant"
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert r.usage.prompt_tokens == len(tok.encode_chat(messages))


def test_chat_stream_with_usage(client, server):
    stream = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=5, n=2, stream=True, stream_options={"include_usage": True})
    text, reasons, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert reasons == {0: "length", 1: "length"}
    assert text[0] and text[1] and text[0] != text[1]
    assert usage.completion_tokens == 10


def test_completion_stream_matches_whole_response(client, server):
    whole = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6)
    parts = [c.choices[0].text for c in client.completions.create(model=server.model, prompt=PROMPT,
                                                                   max_tokens=6, stream=True) if c.choices]
    assert "".join(parts) == whole.choices[0].text


def test_error_classes(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=PROMPT, max_tokens=100)
    prompt_tokens = len(server.engine.tokenizer.encode(PROMPT))
    assert e.value.body["message"].startswith(
        f"This model's maximum context length is 64 tokens. However, you requested {prompt_tokens + 100} tokens "
        f"({prompt_tokens} in the prompt, 100 in the completion).")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="the " * 200)
    assert "maximum context length is 64" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt=PROMPT, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"chat_template": "{{ 7 * 7 }}"})
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_models_tokenize_detokenize_and_request_id(client, server):
    assert [m.id for m in client.models.list().data] == [server.model]
    headers = {"Authorization": "Bearer sk-test", "X-Request-Id": "my-trace-42"}
    r = requests.post(server.base_url + "/tokenize", json={"prompt": "Hello world"}, headers=headers)
    assert r.headers["X-Request-Id"] == "my-trace-42"
    tokens = r.json()["tokens"]
    assert r.json()["count"] == len(tokens) and r.json()["max_model_len"] == 64
    r = requests.post(server.base_url + "/detokenize", json={"tokens": tokens}, headers=headers)
    assert r.json()["prompt"] == "Hello world"
    r = requests.post(server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, headers=headers)
    assert r.json()["tokens"] == server.engine.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert requests.get(server.base_url + "/health").status_code == 200  # probes need no key
    assert requests.post(server.base_url + "/tokenize", json={"prompt": "x"}).status_code == 401
