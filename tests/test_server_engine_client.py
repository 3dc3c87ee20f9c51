"""The app against a second EngineClient: the routes need nothing of an engine but the interface.

``ReversingClient`` has no engine, no thread and no admission: each request is answered at once,
inside ``generate``, with its prompt's tokens in reverse order (cut to ``max_tokens``), or refused
with the typed error its prompt text is mapped to. A remote engine (a Ray replica) would sit
behind the same methods.
"""

import json
import threading
import time

import pytest
import requests

from jaxinfer.engine_client import EngineClient, EngineRequest, OutputStream
from jaxinfer.errors import PromptTooLongError, RequestError
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.server.app import create_app
from jaxinfer.server.engine_loop import EngineLoop
from jaxinfer.server.waitress_server import create_waitress_server, serve_forever
from tests.fake_engine import load_tiny_tokenizer

MODEL = "reversing"
REFUSED = {
    "stop ids": RequestError("stop_token_ids must be in [0, 512)", field="stop_token_ids", limit=512),
    "banned ids": RequestError("min_tokens needs 40 token ids banned, more than the 32 supported",
                               field="min_tokens", limit=32),
    "long prompt": PromptTooLongError("the prompt has 9 tokens, but max_model_len is 8", field="prompt", limit=7),
}


class ReversingClient:
    """An EngineClient whose outputs are the prompt reversed; see the module docstring."""

    def __init__(self):
        self.tokenizer, _ = load_tiny_tokenizer()
        self.max_model_len = 64
        self.state = "ready"
        self.aborted: list[str] = []

    def generate(self, requests: list[EngineRequest]) -> OutputStream:
        stream = OutputStream([r.request_id for r in requests])
        for r in requests:
            stream.put(REFUSED[r.prompt] if r.prompt in REFUSED else self._reversed(r))
        return stream

    def score(self, requests: list[EngineRequest]) -> OutputStream:
        stream = OutputStream([r.request_id for r in requests])
        for r in requests:
            samples = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="length")
                       for i in range(r.params.n)]
            stream.put(RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, samples, finished=True))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    def stats(self) -> dict:
        return {"server_num_requests_waiting": 0}

    def _reversed(self, r: EngineRequest) -> RequestOutput:
        tokens = list(reversed(r.prompt_token_ids))
        is_cut = len(tokens) > r.params.max_tokens
        tokens = tokens[: r.params.max_tokens]
        samples = [CompletionOutput(index=i, text=self.tokenizer.decode(tokens), token_ids=tokens,
                                    finish_reason="length" if is_cut else "stop") for i in range(r.params.n)]
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, samples, finished=True)


@pytest.fixture(scope="module")
def client():
    return ReversingClient()


@pytest.fixture(scope="module")
def base_url(client):
    app = create_app(client, MODEL, metrics=None)
    server = create_waitress_server(app, "127.0.0.1", 0, threads=4, max_body_bytes=64 * 1024)
    thread = threading.Thread(target=serve_forever, args=(server,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.effective_port}"
    server.close()


def post(base_url: str, path: str, body: dict, **kw) -> requests.Response:
    return requests.post(base_url + path, json={"model": MODEL, **body}, timeout=10, **kw)


def sse_data(r: requests.Response) -> list:
    return [json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]"
            for line in r.iter_lines() if line.startswith(b"data: ")]


def test_both_clients_have_the_whole_interface(client):
    assert isinstance(client, EngineClient) and isinstance(EngineLoop(), EngineClient)
    assert not isinstance(object(), EngineClient)


def test_completions_and_chat_come_from_the_client(client, base_url):
    tok = client.tokenizer
    ids = tok.encode("the cat sat")
    r = post(base_url, "/v1/completions", {"prompt": "the cat sat", "max_tokens": 50, "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == [tok.decode(list(reversed(ids)))] * 2
    assert choices[0]["finish_reason"] == "stop" and r.json()["usage"]["completion_tokens"] == 2 * len(ids)
    messages = [{"role": "user", "content": "hi"}]
    r = post(base_url, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "stream": True}, stream=True)
    events = sse_data(r)
    assert events[-1] == "[DONE]"
    text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])
    assert text == tok.decode(list(reversed(tok.encode_chat(messages)))[:3])
    r = post(base_url, "/v1/completions", {"prompt": "the cat sat", "max_tokens": 0, "echo": True})
    assert [(c["text"], c["finish_reason"]) for c in r.json()["choices"]] == [("the cat sat", "length")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", list(REFUSED))
def test_engine_refusals_keep_their_field_and_code(base_url, prompt, stream):
    error = REFUSED[prompt]
    r = post(base_url, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "stream": stream})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": str(error), "type": "invalid_request_error",
                                  "param": error.field, "code": error.code}}


def test_a_refusal_after_the_stream_started_is_an_error_event(client, base_url):
    client.aborted.clear()
    r = post(base_url, "/v1/completions", {"prompt": ["the cat", "long prompt"], "max_tokens": 2, "stream": True},
             stream=True)
    events = sse_data(r)
    assert events[0]["choices"][0]["index"] == 0  # the first prompt's answer went out
    assert events[-2]["error"]["param"] == "prompt" and events[-2]["error"]["code"] == "context_length_exceeded"
    assert events[-1] == "[DONE]"
    assert len(client.aborted) == 1 and client.aborted[0].endswith("-1")  # the refused prompt's request


def test_probes_and_routes_follow_the_clients_state(client, base_url):
    try:
        client.state = "warming"
        health = requests.get(base_url + "/health", timeout=5)
        assert health.status_code == 503 and health.headers["Retry-After"] == "1"
        r = post(base_url, "/v1/completions", {"prompt": "the cat"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        client.state = "dead"
        assert requests.get(base_url + "/live", timeout=5).status_code == 503
    finally:
        client.state = "ready"
    assert requests.get(base_url + "/health", timeout=5).json() == {"status": "ok"}
    r = requests.get(base_url + "/metrics", timeout=5)  # this app was made without metrics
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_an_idle_engine_loop_reports_the_engines_counters():
    """Before its first step the loop already answers stats with the engine's own (zero) counters:
    a Ray replica the router never picked was asked for them and answered with nothing."""

    class IdleEngine:
        def stats(self) -> dict:
            return {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_running": 0}

        def has_unfinished_requests(self) -> bool:
            return False

    loop = EngineLoop()
    loop.start(IdleEngine(), warmup=False)
    try:
        deadline = time.monotonic() + 5
        while "prefix_cache_hits" not in loop.stats() and time.monotonic() < deadline:
            time.sleep(0.01)  # the loop's thread reads them as it starts
        stats = loop.stats()
        assert stats["prefix_cache_hits"] == 0 and stats["prefix_cache_queries"] == 0
        assert "server_num_requests_waiting" in stats
    finally:
        loop.stop()
