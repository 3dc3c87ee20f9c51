"""Adversarial clients: odd-but-valid OpenAI fields, hostile bytes and numbers, raw HTTP, and
streams that must equal the whole response (stop strings spanning tokens, partial UTF-8).

Most cases run against FakeEngine (outputs known by hand); the few where real tokenization and
sampling matter run against the real engine on the tiny Llama-3 fixture (random weights, a 512-token
byte-level vocabulary: its outputs are full of characters split over several tokens).
"""

import json
import logging
import socket
import time
from pathlib import Path

import hypothesis.strategies as st
import openai
import pytest
import requests
from hypothesis import HealthCheck, given, settings

from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.server.protocol import ParsedRequest, Prompt
from jaxinfer.server.responses import ResponseBuilder
from tests.fake_engine import FakeEngine, RunningServer, load_tiny_tokenizer

REPO = Path(__file__).resolve().parent.parent
KEY = "sk-adversarial"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def server():
    with RunningServer(FakeEngine(max_model_len=64, max_num_seqs=4), api_key=KEY, max_body_bytes=64 * 1024) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def real_server():
    from jaxinfer.llm import LLM

    llm = LLM(str(REPO / "tests" / "fixtures" / "tiny-llama3"), max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, num_pages=64, use_tqdm=False)
    with RunningServer(llm.engine) as s:
        yield s


def post(server, path: str, body, headers=None, **kw) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(server.base_url + path, data=data, timeout=30,
                         headers={**AUTH, "Content-Type": "application/json", **(headers or {})}, **kw)


def assert_openai_error(r: requests.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text and ".py" not in r.text and "/work/" not in r.text
    if param != "any":
        assert error["param"] == param, error
    return error


def sse_events(r: requests.Response) -> list:
    """The data of every SSE event, parsed (the final "[DONE]" kept as a string)."""
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = []
    for line in r.iter_lines():
        if line.startswith(b"data: "):
            data = line[6:].decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream_and_whole(server, path: str, body: dict, headers=None) -> tuple[dict, dict, dict]:
    """(the whole response, text per choice joined from a stream of the same request, finish per choice)."""
    whole = post(server, path, {**body, "stream": False}, headers)
    assert whole.status_code == 200, whole.text
    events = sse_events(post(server, path, {**body, "stream": True}, headers, stream=True))
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) and "error" not in e for e in events[:-1]), events
    text, finish = {}, {}
    for event in events[:-1]:
        for c in event["choices"]:
            piece = c["text"] if "text" in c else c["delta"].get("content") or ""
            text[c["index"]] = text.get(c["index"], "") + piece
            if c["finish_reason"]:
                assert c["index"] not in finish, "two finish chunks for one choice"
                finish[c["index"]] = (c["finish_reason"], c.get("stop_reason"))
    return whole.json(), text, finish


def whole_texts(whole: dict) -> dict:
    return {c["index"]: c["text"] if "text" in c else c["message"]["content"] for c in whole["choices"]}


# ---------------------------------------------------------------- numbers, bytes and JSON


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                  "repetition_penalty"])
def test_integers_too_large_for_a_float_are_400_not_500(server, name):
    # 10**400 is valid JSON; math.isfinite() raised OverflowError on it (a 500).
    body = '{"model": "tiny-llama3", "prompt": "hi", "%s": 1%s}' % (name, "0" * 400)
    assert_openai_error(post(server, "/v1/completions", body), 400, name)
    body = '{"model": "tiny-llama3", "messages": [{"role": "user", "content": "hi"}], "%s": -1%s}' % (name, "0" * 400)
    assert_openai_error(post(server, "/v1/chat/completions", body), 400, name)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_400(server, token):
    body = '{"model": "tiny-llama3", "prompt": "hi", "temperature": %s}' % token
    assert_openai_error(post(server, "/v1/completions", body), 400, "temperature")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi \ud800 there"}),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud83d"], "echo": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]}),
    ("/tokenize", {"prompt": "\ud800"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}),
])
def test_lone_surrogates_are_400(server, path, body):
    # json.dumps writes them as "\ud800" escapes, valid JSON that Python decodes to an unencodable str;
    # the tokenizer then raised TypeError and the response writer UnicodeEncodeError (500s).
    r = post(server, path, {"model": server.model, "max_tokens": 2, **body})
    assert "surrogate" in assert_openai_error(r, 400)["message"]


def test_surrogate_pairs_and_raw_unicode_still_work(server):
    for data in ['{"model": "tiny-llama3", "prompt": "emoji \\ud83d\\ude00 ok", "max_tokens": 3}',
                 '{"model": "tiny-llama3", "prompt": "\\u65e5\\u672c \\\\ud800 is text", "max_tokens": 3}',
                 json.dumps({"model": "tiny-llama3", "prompt": "日本語 🎉", "max_tokens": 3}, ensure_ascii=False)]:
        r = post(server, "/v1/completions", data.encode())
        assert r.status_code == 200, (data, r.text)


@pytest.mark.parametrize("raw", [b"", b"null", b"[]", b'"x"', b"{", b'{"prompt": "hi",}', b"\xff\xfe{}",
                                 b'{"prompt": "h\xffi"}', b"[" * 50_000, b'{"prompt": "hi"} {"prompt": "x"}'])
def test_malformed_bodies_are_400(server, raw):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert_openai_error(post(server, path, raw), 400)


def test_duplicate_keys_content_types_and_query_strings(server):
    # Duplicate keys: the last wins (Python's json, as most servers); any Content-Type is read as JSON.
    r = post(server, "/v1/completions?api-version=2024-01-01&x=%00",
             b'{"model": "tiny-llama3", "prompt": "the cat", "prompt": "on mat", "max_tokens": 2}',
             headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "on m"  # FakeEngine echoes 2 tokens
    for content_type in ("text/plain", "multipart/form-data; boundary=x", "application/json; charset=utf-8"):
        r = post(server, "/v1/completions", {"model": server.model, "prompt": "hi", "max_tokens": 1},
                 headers={"Content-Type": content_type})
        assert r.status_code == 200, (content_type, r.text)


@pytest.mark.parametrize("body,param", [
    ({"prompt": [5, 512]}, "prompt"),
    ({"prompt": [5, -1]}, "prompt"),
    ({"prompt": [5, 10**30]}, "prompt"),
    ({"prompt": [[5, 6], []]}, "prompt"),
    ({"prompt": [[5, 6], [True]]}, "prompt"),
    ({"prompt": [5, "x"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt"),
    ({"prompt": [5.0, 6.0]}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [512]}, "stop_token_ids"),
])
def test_bad_token_id_prompts_are_400(server, body, param):
    assert_openai_error(post(server, "/v1/completions", {"model": server.model, **body}), 400, param)


def test_detokenize_out_of_vocabulary_is_400(server):
    assert_openai_error(post(server, "/detokenize", {"tokens": [1, 2, 10**20]}), 400, "tokens")
    assert_openai_error(post(server, "/detokenize", {"tokens": "abc"}), 400, "tokens")


# ---------------------------------------------------------------- OpenAI fields, valid and not


def test_unusual_but_valid_completion_fields(client, server):
    tok = server.engine.tokenizer
    ids = tok.encode(PROMPT, add_special_tokens=False)
    for kwargs in [dict(stop=None), dict(stop=[]), dict(stop="zzz"), dict(logit_bias={}), dict(user="u-1"),
                   dict(frequency_penalty=-2, presence_penalty=2), dict(best_of=1), dict(suffix=None), dict(suffix=""),
                   dict(max_tokens=None), dict(seed=-1), dict(seed=-2**63), dict(seed=2**63 - 1),
                   dict(logprobs=0), dict(echo=False, n=2, best_of=2, temperature=0),
                   dict(extra_body={"top_k": 10**12, "min_p": 0, "ignore_eos": True, "skip_special_tokens": False,
                                    "stream_options": None, "top_logprobs": 3})]:
        r = client.completions.create(model=server.model, prompt=PROMPT, **{"max_tokens": 3, **kwargs})
        assert r.choices and r.choices[0].finish_reason in ("length", "stop"), kwargs
        assert r.usage.completion_tokens >= 1
    r = client.completions.create(model=server.model, prompt=[ids, ids[:2]], max_tokens=2, echo=True)
    assert r.choices[0].text.startswith(PROMPT)


def test_unusual_but_valid_chat_fields_and_messages(client, server):
    base = [{"role": "user", "content": PROMPT}]
    for kwargs in [dict(tool_choice="none"), dict(tools=[]), dict(response_format={"type": "text"}),
                   dict(parallel_tool_calls=False), dict(metadata={"k": "v"}, store=False), dict(user="u"),
                   dict(logprobs=False), dict(logprobs=True), dict(logprobs=True, top_logprobs=0),
                   dict(max_completion_tokens=2, max_tokens=None), dict(n=2, temperature=0, seed=3),
                   dict(stop=["\n\n\n"], stream_options=None), dict(seed=-7)]:
        r = client.chat.completions.create(model=server.model, messages=base, **{"max_tokens": 3, **kwargs})
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content, kwargs
    for messages in [[{"role": "system", "content": "only a system prompt"}],
                     [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, here"}],
                     [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                     [{"role": "user", "content": "x", "name": "bob"}],
                     [{"role": "assistant", "content": None, "tool_calls": []}, {"role": "user", "content": "x"}],
                     [{"role": "user", "content": ""}]]:
        r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
        assert r.choices[0].finish_reason == "length", messages


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"bad_words": [""]}, "bad_words"),
    ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3, "n": 2}, "best_of"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"stream": True, "stream_options": "yes"}, "stream_options"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    # echo + logprobs is served now (prompt logprobs, tests/test_prompt_logprobs.py); its limits are not.
    ("/v1/completions", {"echo": True, "logprobs": 1, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"echo": True, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"max_completion_tokens": 0, "max_tokens": 4}, "max_completion_tokens"),
    ("/v1/completions", {"stop": ["a"] * 17}, "stop"),
    ("/v1/completions", {"stop": [""]}, "stop"),
    ("/v1/completions", {"stop": [1]}, "stop"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 10**30}, "n"),
    ("/v1/completions", {"seed": 2**64}, "seed"),
    ("/v1/completions", {"seed": "1"}, "seed"),
    ("/v1/completions", {"top_p": 0}, "top_p"),
    ("/v1/completions", {"top_k": -2}, "top_k"),
    ("/v1/completions", {"min_tokens": 17}, "min_tokens"),
    ("/v1/completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/completions", {"stream": "true"}, "stream"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"chat_template": "{{ 7 * 7 }}"}, "chat_template"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": "x"}}, "chat_template"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": None}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0]"),
    ("/v1/chat/completions", {"max_tokens": 64}, "max_tokens"),
])
def test_rejected_fields_are_400_naming_the_field(server, path, body, param):
    base = {"model": server.model, "prompt": "hi"} if path == "/v1/completions" else \
        {"model": server.model, "messages": [{"role": "user", "content": "hi"}]}
    assert_openai_error(post(server, path, {**base, **body}), 400, param)


def test_context_errors_say_the_numbers(server):
    error = assert_openai_error(post(server, "/v1/chat/completions", {
        "model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}), 400)
    assert error["code"] == "context_length_exceeded" and "64" in error["message"] and "1000" in error["message"]
    error = assert_openai_error(post(server, "/v1/completions", {"model": server.model, "prompt": list(range(1, 65))}), 400)
    assert error["code"] == "context_length_exceeded" and "64 input tokens" in error["message"]


def test_unknown_model_is_404_everywhere(server):
    for path, body in [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
        error = assert_openai_error(post(server, path, {"model": "gpt-4o", **body}), 404, "model")
        assert error["code"] == "model_not_found"
    r = requests.get(server.base_url + "/v1/models/gpt-4o", headers=AUTH)
    assert assert_openai_error(r, 404, "model")["code"] == "model_not_found"


# ---------------------------------------------------------------- HTTP itself


def test_methods_not_allowed_are_405_with_allow(server):
    for method, path in [("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("DELETE", "/v1/models"),
                         ("POST", "/health"), ("PATCH", "/tokenize"), ("GET", "/detokenize")]:
        r = requests.request(method, server.base_url + path, headers=AUTH, timeout=10)
        assert_openai_error(r, 405)
        assert r.json()["error"]["code"] == "method_not_allowed"
        assert "Allow" in r.headers, (method, path, dict(r.headers))  # HTTP requires it on a 405
    r = requests.head(server.base_url + "/v1/completions", headers=AUTH, timeout=10)
    assert r.status_code == 405 and "POST" in r.headers["Allow"]
    r = requests.head(server.base_url + "/v1/models", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.content == b""
    assert requests.options(server.base_url + "/v1/completions", headers=AUTH, timeout=10).status_code < 500


def test_api_key_variants(server):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    for auth in [f"bearer {KEY}", f"BEARER {KEY}", f"Bearer {KEY} "]:  # the scheme is case-insensitive
        assert post(server, "/v1/completions", body, {"Authorization": auth}).status_code == 200, auth
    for auth in ["", KEY, f"Basic {KEY}", f"Bearer {KEY}x", "Bearer ", f"Bearer {KEY[:-1]}", "Bearer \u00e9\u00e9"]:
        r = post(server, "/v1/completions", body, {"Authorization": auth.encode("latin-1")})
        assert assert_openai_error(r, 401)["code"] == "invalid_api_key", auth
    assert requests.get(server.base_url + "/live", timeout=5).status_code == 200
    assert requests.get(server.base_url + "/metrics", timeout=5).status_code == 200


def test_request_ids_with_odd_characters_are_replaced(server):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    for rid in ["ok-id_1.2:3", "x" * 128]:
        assert post(server, "/v1/completions", body, {"X-Request-Id": rid}).headers["X-Request-Id"] == rid
    for rid in ["has space", "x" * 129, "<script>", "semi;colon", "\u00e9t\u00e9".encode("latin-1"), "a\tb", ""]:
        got = post(server, "/v1/completions", body, {"X-Request-Id": rid}).headers["X-Request-Id"]
        assert len(got) == 32 and all(c in "0123456789abcdef" for c in got), (rid, got)


def raw_http(server, data: bytes, timeout: float = 10) -> bytes:
    sock = socket.create_connection(("127.0.0.1", server.server.effective_port), timeout=timeout)
    try:
        sock.sendall(data)
        out = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out:
                head, _, rest = out.partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
                if length and len(rest) >= length[0]:
                    break
        return out
    finally:
        sock.close()


def test_chunked_bodies(server):
    body = json.dumps({"model": server.model, "prompt": "the cat", "max_tokens": 2}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + \
           b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    half = len(body) // 2
    out = raw_http(server, head + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:]))
    assert out.startswith(b"HTTP/1.1 200") and b'"text": "the"' in out, out[:300]


LIMIT = 64 * 1024  # the module's server's max_body_bytes


def padded_body(server, size: int) -> bytes:
    """A valid completion request of exactly ``size`` bytes (JSON padded with spaces)."""
    body = json.dumps({"model": server.model, "prompt": "the cat", "max_tokens": 2}).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def assert_too_large_then_serves(server, r_or_raw) -> None:
    if isinstance(r_or_raw, bytes):
        assert r_or_raw.startswith(b"HTTP/1.1 413"), r_or_raw[:300]
        error = json.loads(r_or_raw.partition(b"\r\n\r\n")[2])["error"]
    else:
        error = assert_openai_error(r_or_raw, 413, None)
    assert error["code"] == "request_entity_too_large" and str(LIMIT) in error["message"], error
    assert post(server, "/v1/completions", padded_body(server, LIMIT)).status_code == 200  # still serving


def test_a_body_one_byte_over_the_limit_is_json_413(server):
    assert_too_large_then_serves(server, post(server, "/v1/completions", padded_body(server, LIMIT + 1)))


def test_a_chunked_body_over_the_limit_is_json_413(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + \
           b"\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    body = padded_body(server, LIMIT + 1)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 4096]), body[i:i + 4096]) for i in range(0, len(body), 4096))
    assert_too_large_then_serves(server, raw_http(server, head + chunks + b"0\r\n\r\n"))


@pytest.mark.parametrize("chunked", [False, True])
def test_a_40_mib_body_is_json_413_without_being_read(server, chunked):
    # Far past the limit: refused from its Content-Length (or as the chunks arrive), by waitress,
    # before the app; the answer must still be OpenAI's JSON, not waitress's plain-text page.
    big = b"x" * (40 << 20)
    data = (big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)) if chunked else big  # a generator: chunked
    r = requests.post(server.base_url + "/v1/completions", data=data, timeout=60, headers=AUTH)
    assert_too_large_then_serves(server, r)


def test_errors_waitress_answers_itself_are_json(server):
    body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
    r = post(server, "/v1/completions", body, {"X-Junk": "x" * 300_000})
    assert_openai_error(r, 431)  # waitress's own header limit, before the app
    out = raw_http(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: nine\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400") and set(json.loads(out.partition(b"\r\n\r\n")[2])["error"]) == \
        {"message", "type", "param", "code"}, out[:300]
    assert post(server, "/v1/completions", body).status_code == 200


def test_unknown_paths_and_handler_bugs_are_json(server, monkeypatch):
    assert_openai_error(requests.get(server.base_url + "/nope", headers=AUTH, timeout=10), 404)
    assert_openai_error(post(server, "/v1/nope", {}), 404)

    def broken(*args, **kwargs):
        raise RuntimeError("bug in /secret/path/protocol.py")

    monkeypatch.setattr("jaxinfer.server.protocol.parse_completion", broken)
    logging.getLogger("jaxinfer.server").disabled = True
    try:
        r = post(server, "/v1/completions", {"model": server.model, "prompt": "hi"})
    finally:
        logging.getLogger("jaxinfer.server").disabled = False
    assert assert_openai_error(r, 500)["code"] == "internal_error" and "secret" not in r.text


# ---------------------------------------------------------------- streams equal whole responses


@pytest.mark.parametrize("stop", ["cat s", ["at s", "xyz q"], " sat", "t", ["mat", "on t"], "the cat sat on the"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_string_spanning_tokens_is_never_streamed(server, path, stop):
    # The stream sent "the cat" and then the engine cut "cat s" (the stop) from the text: the
    # concatenated deltas said "the cat", the whole response "the ".
    body = {"model": server.model, "max_tokens": 12, "n": 2, "stop": stop}
    body.update({"prompt": PROMPT} if "chat" not in path else {"messages": [{"role": "user", "content": PROMPT}]})
    whole, streamed, finish = stream_and_whole(server, path, body)
    assert streamed == whole_texts(whole)
    assert finish == {c["index"]: (c["finish_reason"], c.get("stop_reason")) for c in whole["choices"]}


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_kept_in_output_streams_the_same(server, include):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 12, "stop": ["cat s"], "echo": True,
            "include_stop_str_in_output": include}
    whole, streamed, _ = stream_and_whole(server, "/v1/completions", body)
    assert streamed == whole_texts(whole)
    assert whole_texts(whole)[0].startswith(PROMPT + "the ")  # (FakeEngine always cuts the stop string)


words = st.sampled_from(["the", "cat", "sat", "on", "mat", "a", "dog", "ran"])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt=st.lists(words, min_size=1, max_size=6).map(" ".join),
       stops=st.lists(st.text(alphabet="the catsonmdgr", min_size=1, max_size=6), max_size=3),
       n=st.integers(1, 3), max_tokens=st.integers(1, 12), chat=st.booleans())
def test_fuzzed_streams_equal_whole_responses(server, prompt, stops, n, max_tokens, chat):
    body = {"model": server.model, "max_tokens": max_tokens, "n": n, "stop": stops}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    whole, streamed, finish = stream_and_whole(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert streamed == whole_texts(whole)
    assert set(finish) == set(range(n))


def test_stream_usage_only_in_the_last_chunk(server):
    body = {"model": server.model, "prompt": [PROMPT, "on the mat"], "max_tokens": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse_events(post(server, "/v1/completions", body, stream=True))
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert all(e["usage"] is None for e in events[:-2])
    assert sorted({c["index"] for e in events[:-2] for c in e["choices"]}) == [0, 1, 2, 3]


def test_a_server_fault_mid_stream_is_an_error_event_then_done(server, monkeypatch):
    calls = []
    original = ResponseBuilder.stream_chunks

    def flaky(self, prompt_index, out):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom in /secret/path/responses.py")
        return original(self, prompt_index, out)

    monkeypatch.setattr(ResponseBuilder, "stream_chunks", flaky)
    logging.getLogger("jaxinfer.server").disabled = True
    try:
        events = sse_events(post(server, "/v1/completions", {"model": server.model, "prompt": PROMPT,
                                                             "max_tokens": 20, "stream": True}, stream=True))
    finally:
        logging.getLogger("jaxinfer.server").disabled = False
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "internal_error" and "secret" not in json.dumps(events)
    deadline = time.monotonic() + 5
    while server.loop.num_in_flight() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.loop.num_in_flight() == 0  # the rest of the request was aborted


def test_stream_logprobs_wait_for_their_entries():
    # The engine's token and logprob lists grow while the handler reads them, the token first: a
    # chunk must not count a token whose logprobs are not there yet, or that entry is never sent.
    tokenizer, _ = load_tiny_tokenizer()
    ids = tokenizer.encode("the cat sat", add_special_tokens=False)
    params = SamplingParams(max_tokens=3, logprobs=1)
    parsed = ParsedRequest("completion", "m", [Prompt([1, 2], "p")], [params], stream=True, include_usage=False)
    builder = ResponseBuilder(parsed, "cmpl-x", tokenizer)
    entries = [{t: -0.5 * (i + 1)} for i, t in enumerate(ids[:3])]

    def out(num_tokens, num_logprobs, finish=None):
        sample = CompletionOutput(0, tokenizer.decode(ids[:num_tokens]), ids[:num_tokens], finish_reason=finish,
                                  logprobs=entries[:num_logprobs])
        return RequestOutput("r", "p", [1, 2], [sample], finished=finish is not None)

    seen = []
    for n_tokens, n_logprobs, finish in [(1, 1, None), (2, 1, None), (3, 3, "length")]:
        for event in builder.stream_chunks(0, out(n_tokens, n_logprobs, finish)):
            logprobs = json.loads(event[6:])["choices"][0]["logprobs"]
            seen += logprobs["token_logprobs"] if logprobs else []
    assert seen == [-0.5, -1.0, -1.5]


def test_chat_logprob_bytes_rebuild_split_characters(server):
    # A byte-level token holding part of a character decodes alone to U+FFFD; "bytes" must be the
    # token's own bytes (OpenAI's promise), not those of U+FFFD, so that joined they give the text.
    text = "日本 🎉 é"  # 30 prompt tokens: the 24 echoed ones fit the context of 64
    messages = [{"role": "user", "content": text}]
    tok = server.engine.tokenizer
    source = [t for t in tok.encode_chat(messages) if t < 507]  # what FakeEngine echoes
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": messages, "max_tokens": len(source),
                                               "logprobs": True, "top_logprobs": 2})
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(source) and "\ufffd" in "".join(c["token"] for c in content)
    assert b"".join(bytes(c["bytes"]) for c in content) == choice["message"]["content"].encode()
    assert text in choice["message"]["content"]
    for c in content:
        for alt in c["top_logprobs"]:
            assert all(0 <= b < 256 for b in alt["bytes"]) and len(alt["bytes"]) >= 1


# ---------------------------------------------------------------- the real engine


@pytest.mark.parametrize("extra", [{"top_k": 2**31}, {"top_k": 10**18}, {"top_k": 512}, {"temperature": 1e-300},
                                   {"temperature": 3e38}, {"repetition_penalty": 3e38},
                                   {"repetition_penalty": 1e-300, "presence_penalty": -2, "frequency_penalty": 2},
                                   {"min_p": 5e-324, "top_p": 1e-300}, {"seed": -1, "n": 3}])
def test_extreme_sampling_values_do_not_kill_the_engine(real_server, extra):
    # top_k = 2**31 went into the engine's int32 sampling array: OverflowError in step(), every
    # request in flight failed and the server was dead until restarted.
    body = {"model": real_server.model, "prompt": "the cat", "max_tokens": 3, **extra}
    r = requests.post(real_server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert requests.get(real_server.base_url + "/health", timeout=5).json() == {"status": "ok"}


def test_top_k_past_the_vocabulary_is_top_k_off(real_server):
    base = {"model": real_server.model, "prompt": "the cat sat", "max_tokens": 8, "seed": 11}
    texts = [requests.post(real_server.base_url + "/v1/completions", json={**base, **extra}, timeout=60).json()
             ["choices"][0]["text"] for extra in ({}, {"top_k": 10**9}, {"top_k": -1})]
    assert texts[0] == texts[1] == texts[2]


@pytest.mark.parametrize("prompt", ["日本語のテキスト", "emoji 🎉🐱🚀 party", "Ελληνικά καὶ русский", "the cat sat"])
def test_real_streams_with_split_characters_equal_whole_responses(real_server, prompt):
    # Random weights over a byte-level vocabulary: most characters arrive over several tokens.
    for path, body in [("/v1/completions", {"prompt": prompt, "n": 2, "logprobs": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "logprobs": True,
                                                 "top_logprobs": 1})]:
        body = {"model": real_server.model, "max_tokens": 24, "seed": 5, "temperature": 1.0, **body}
        whole, streamed, finish = stream_and_whole(real_server, path, body)
        assert streamed == whole_texts(whole), (path, prompt)
        assert finish == {c["index"]: (c["finish_reason"], c.get("stop_reason")) for c in whole["choices"]}


def test_real_stop_strings_stream_like_whole_responses(real_server):
    base = {"model": real_server.model, "prompt": "the cat sat", "max_tokens": 30, "temperature": 0}
    text = requests.post(real_server.base_url + "/v1/completions", json=base, timeout=60).json()["choices"][0]["text"]
    plain = [text[i:i + 3] for i in range(2, len(text) - 3, 5) if "\ufffd" not in text[i:i + 3]][:3]
    assert plain, text
    for stop, include in [(s, False) for s in plain] + [(["zzzz", plain[-1]], False), (plain[0], True)]:
        whole, streamed, finish = stream_and_whole(real_server, "/v1/completions",
                                                   {**base, "stop": stop, "include_stop_str_in_output": include})
        assert streamed == whole_texts(whole)
        assert whole["choices"][0]["finish_reason"] == "stop" and finish[0][0] == "stop"
        if include:
            assert whole_texts(whole)[0].endswith(stop)


def test_real_greedy_n_and_seeds_are_reproducible(real_server):
    url = real_server.base_url + "/v1/completions"
    r = requests.post(url, json={"model": real_server.model, "prompt": "the cat", "max_tokens": 8, "n": 3,
                                 "temperature": 0}, timeout=60).json()
    assert len({c["text"] for c in r["choices"]}) == 1
    body = {"model": real_server.model, "prompt": "the cat", "max_tokens": 8, "seed": 123}
    assert requests.post(url, json=body, timeout=60).json()["choices"][0]["text"] == \
        requests.post(url, json=body, timeout=60).json()["choices"][0]["text"]


def test_real_disconnect_mid_stream_frees_pages(real_server):
    engine = real_server.engine
    body = json.dumps({"model": real_server.model, "prompt": "the cat sat on the mat", "max_tokens": 100,
                       "stream": True, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", real_server.server.effective_port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(65536)
    assert engine.allocator.num_used_pages > 0
    sock.close()
    deadline = time.monotonic() + 10
    while (real_server.loop.num_in_flight() or engine.allocator.num_used_pages) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert real_server.loop.num_in_flight() == 0 and engine.allocator.num_used_pages == 0
    r = requests.post(real_server.base_url + "/v1/completions", timeout=60,
                      json={"model": real_server.model, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


def test_real_engine_rejects_bad_token_ids_with_400(real_server):
    url = real_server.base_url + "/v1/completions"
    for prompt in ([1, 2, 512], [[1, 2], [3, 99999]], [-5]):
        r = requests.post(url, json={"model": real_server.model, "prompt": prompt, "max_tokens": 2}, timeout=30)
        assert_openai_error(r, 400, "prompt")
    r = requests.post(url, json={"model": real_server.model, "prompt": [[1, 2], [3, 4]], "max_tokens": 2, "echo": True},
                      timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_real_engine_rejections_name_their_field(real_server):
    url = real_server.base_url + "/v1/completions"
    body = {"model": real_server.model, "prompt": "hello", "max_tokens": 4}
    # More stop ids than the device can ban before min_tokens: the engine refuses, naming min_tokens.
    r = requests.post(url, json={**body, "min_tokens": 2, "stop_token_ids": list(range(40))}, timeout=30)
    assert assert_openai_error(r, 400, "min_tokens")["code"] == "invalid_value"
    # Past float32 (the device's type) a temperature or penalty would arrive as inf: refused.
    for field, value in (("temperature", 1e300), ("temperature", 10**300), ("repetition_penalty", 1e300)):
        r = requests.post(url, json={**body, field: value}, timeout=30)
        assert_openai_error(r, 400, field)
    assert requests.post(url, json=body, timeout=30).status_code == 200  # and the engine still serves
