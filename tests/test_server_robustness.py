"""Bad input, overload, engine faults and shutdown: the server stays up and answers in OpenAI's shape."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import hypothesis.strategies as st
import openai
import pytest
import requests
from hypothesis import HealthCheck, given, settings

from jaxinfer.server.admission import AdmissionConfig
from tests.fake_engine import FakeEngine, RunningServer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server():
    with RunningServer(FakeEngine(max_model_len=64, max_num_seqs=8), max_body_bytes=64 * 1024) as s:
        yield s


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p",
          "top_k", "min_p", "stop", "stop_token_ids", "stream", "stream_options", "logprobs", "top_logprobs",
          "echo", "seed", "ignore_eos", "min_tokens", "repetition_penalty", "presence_penalty", "tokens",
          "chat_template", "chat_template_kwargs", "response_format", "tools", "best_of", "logit_bias",
          "add_special_tokens", "add_generation_prompt", "skip_special_tokens", "suffix", "tool_choice",
          "parallel_tool_calls", "structured_outputs", "guided_json", "guided_choice", "bad_words"]
GOOD = {"model": "tiny-llama3", "prompt": "the cat sat", "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 3, "tokens": [1, 2, 3]}
field_values = st.one_of(json_values, st.integers(-5, 70), st.sampled_from([None, 0, 1, -1, "", [], {}, True]),
                         st.lists(st.integers(-3, 600), max_size=5),
                         st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x", 3]),
                                                         "content": json_values}), max_size=3))
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), field_values, max_size=8).map(lambda d: {**GOOD, **d}),
    st.dictionaries(st.sampled_from(FIELDS), field_values, max_size=6),
    json_values,
)
ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(endpoint=st.sampled_from(ENDPOINTS), body=bodies)
def test_fuzzed_bodies_never_give_5xx(server, endpoint, body):
    data = json.dumps(body, allow_nan=True)
    r = requests.post(server.base_url + endpoint, data=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code < 500, (r.status_code, r.text)
    text = r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "Traceback" not in text and "/work/" not in text and ".py" not in text
    else:
        assert "engine_error" not in text and "internal_error" not in text


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=200))
def test_fuzzed_raw_bytes_give_400(server, raw):
    r = requests.post(server.base_url + "/v1/chat/completions", data=raw, timeout=30)
    assert r.status_code in (400, 404), r.text


def test_server_still_answers_and_limits_body_size(server):
    r = requests.post(server.base_url + "/v1/completions", json={"model": server.model, "prompt": "x" * 100_000})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = requests.post(server.base_url + "/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    assert requests.get(server.base_url + "/health").json() == {"status": "ok"}
    assert requests.get(server.base_url + "/nope").status_code == 404


def test_overload_gives_503_with_retry_after():
    release = threading.Event()
    engine = FakeEngine(max_num_seqs=1, before_step=lambda step: release.wait(10))
    admission = AdmissionConfig(max_waiting_requests=2, max_waiting_prompt_tokens=10_000, retry_after_s=1)
    with RunningServer(engine, admission=admission) as s:
        body = {"model": s.model, "prompt": "the cat sat", "max_tokens": 2}
        results = []
        held = [threading.Thread(target=lambda: results.append(requests.post(s.base_url + "/v1/completions",
                                                                             json=body, timeout=30)))
                for _ in range(2)]
        for t in held:
            t.start()
        deadline = time.monotonic() + 5
        while s.loop.admission.num_waiting < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = requests.post(s.base_url + "/v1/completions", json=body, timeout=5)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=s.model, prompt="the cat", max_tokens=2)
        assert e.value.status_code == 503
        release.set()
        for t in held:
            t.join(10)
        assert [r.status_code for r in results] == [200, 200]
        metrics = requests.get(s.base_url + "/metrics").text
        assert 'jaxinfer:request_rejected_total{model_name="tiny-llama3",reason="queue_full"} 2.0' in metrics


def test_engine_fault_fails_requests_in_flight_and_health_reports_it():
    engine = FakeEngine(step_delay=0.01, fail_on_step=5)
    with RunningServer(engine) as s:
        stream_body = {"model": s.model, "prompt": "the cat sat", "max_tokens": 20, "stream": True}
        plain_body = {"model": s.model, "prompt": "on the mat", "max_tokens": 20}
        plain = []
        t = threading.Thread(target=lambda: plain.append(requests.post(s.base_url + "/v1/completions",
                                                                       json=plain_body, timeout=10)))
        t.start()
        r = requests.post(s.base_url + "/v1/completions", json=stream_body, stream=True, timeout=10)
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "engine_error" and error["type"] == "server_error"
        t.join(10)
        assert plain[0].status_code == 500 and plain[0].json()["error"]["code"] == "engine_error"
        assert "secret" not in plain[0].text and not any(b"secret" in e for e in events)
        health = requests.get(s.base_url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert requests.get(s.base_url + "/live", timeout=5).status_code == 503
        after = requests.post(s.base_url + "/v1/completions", json=plain_body, timeout=5)
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"


def test_a_fault_while_adding_one_request_fails_only_that_request():
    engine = FakeEngine(fail_on_prompt="poison")
    with RunningServer(engine) as s:
        bad = requests.post(s.base_url + "/v1/completions", json={"model": s.model, "prompt": "poison"}, timeout=10)
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_error"
        assert "secret" not in bad.text
        good = requests.post(s.base_url + "/v1/completions",
                             json={"model": s.model, "prompt": "the cat sat", "max_tokens": 4}, timeout=10)
        assert good.status_code == 200 and good.json()["choices"][0]["text"]
        assert requests.get(s.base_url + "/health", timeout=5).status_code == 200


SERVE_FAKE = """
import sys
sys.path.insert(0, {repo!r})
from tests.fake_engine import FakeEngine
import jaxinfer.server.serve as serve
import argparse
parser = argparse.ArgumentParser()
serve.add_serve_arguments(parser)
args = parser.parse_args(sys.argv[1:])
sys.exit(serve.run_server(args, engine_factory=lambda a: FakeEngine(max_model_len=2048, step_delay=0.02)))
"""


def test_sigterm_drains_then_exits_0():
    command = [sys.executable, "-c", SERVE_FAKE.format(repo=str(REPO)), "--port", "0", "--model", "tiny",
               "--drain-timeout", "1.5"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=REPO)
    logs: list[dict] = []

    def read_logs():
        for line in proc.stderr:
            # A warning written without a newline can share a line with the next JSON record.
            start = line.find("{")
            try:
                logs.append(json.loads(line[start:]) if start >= 0 else {"message": line})
            except ValueError:
                logs.append({"message": line})
    threading.Thread(target=read_logs, daemon=True).start()
    try:
        # Importing jax in a fresh process can take a minute on a loaded 2-core machine.
        deadline = time.monotonic() + 180
        while not any(e.get("message") == "ready" for e in logs) and time.monotonic() < deadline:
            assert proc.poll() is None, logs
            time.sleep(0.05)
        assert any(e.get("message") == "ready" for e in logs), f"server not ready after 180 s: {logs}"
        # A serving process freezes its start-up heap out of the collector (jaxinfer/gc_freeze.py).
        assert next(e for e in logs if e.get("message") == "ready")["gc_frozen_objects"] > 0
        port = next(e["port"] for e in logs if e.get("message", "").startswith("listening"))
        base = f"http://127.0.0.1:{port}"
        results = {}

        def run(name, max_tokens):
            body = {"model": "tiny", "prompt": "the cat sat", "max_tokens": max_tokens}
            results[name] = requests.post(base + "/v1/completions", json=body, timeout=30)
        threads = [threading.Thread(target=run, args=("short", 20)), threading.Thread(target=run, args=("long", 1000))]
        for t in threads:
            t.start()
        running = 'jaxinfer:num_requests_running{model_name="tiny"} 2.0'
        deadline = time.monotonic() + 10
        while running not in requests.get(base + "/metrics").text and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        refused = requests.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert requests.get(base + "/health", timeout=5).json()["status"] == "draining"
        for t in threads:
            t.join(30)
        assert proc.wait(timeout=30) == 0
        assert results["short"].json()["choices"][0]["finish_reason"] == "length"
        long = results["long"].json()["choices"][0]
        assert long["finish_reason"] == "abort" and 0 < len(long["text"])
        finished = [e for e in logs if e.get("message") == "request finished"]
        assert {e["finish_reason"] for e in finished} == {"length", "abort"}
        assert all({"queue_s", "prefill_s", "decode_s", "prompt_tokens", "completion_tokens", "request_id"} <= e.keys()
                   for e in finished)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def real_server():
    """The real engine on the tiny Llama-3 fixture: the fuzzing's real-model share."""
    from jaxinfer.llm import LLM

    llm = LLM(str(REPO / "tests" / "fixtures" / "tiny-llama3"), max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=64, num_pages=64, use_tqdm=False)
    with RunningServer(llm.engine, max_body_bytes=64 * 1024) as s:
        yield s


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(endpoint=st.sampled_from(ENDPOINTS), body=bodies)
def test_fuzzed_bodies_on_the_real_engine_never_give_5xx(real_server, endpoint, body):
    test_fuzzed_bodies_never_give_5xx.hypothesis.inner_test(real_server, endpoint, body)


def test_real_engine_is_live_and_holds_no_pages_after_fuzzing(real_server):
    r = requests.post(real_server.base_url + "/v1/completions", timeout=60,
                      json={"model": "tiny-llama3", "prompt": "the cat sat", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 30
    while real_server.engine.allocator.num_used_pages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert real_server.engine.allocator.num_used_pages == 0
    assert requests.get(real_server.base_url + "/health", timeout=10).status_code == 200
