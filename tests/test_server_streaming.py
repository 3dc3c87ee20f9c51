"""Streaming through waitress: chunks leave as tokens are made; disconnects abort and free pages."""

import json
import random
import socket
import threading
import time

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.fake_engine import FakeEngine, RunningServer


def metric(text: str, name: str, **labels) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples
              if s.name == name and labels.items() <= s.labels.items()]
    assert values, f"{name} {labels} not in /metrics"
    return sum(values)


def wait_until(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_first_chunk_reaches_the_client_before_the_last_token_exists():
    release = threading.Event()
    steps_seen = []

    def before_step(step):
        steps_seen.append(step)
        if step == 3:  # two tokens exist; the engine holds the rest back
            assert release.wait(10), "the test never released the engine"

    with RunningServer(FakeEngine(before_step=before_step)) as s:
        r = requests.post(s.base_url + "/v1/completions", stream=True, timeout=10,
                          json={"model": s.model, "prompt": "the cat sat on the mat", "max_tokens": 4, "stream": True})
        assert r.headers["Content-Type"].startswith("text/event-stream")
        received = b""
        chunks = r.iter_content(chunk_size=None)
        while received.count(b"data: ") < 2:
            received += next(chunks)
        # Two chunks are here while the engine is still blocked inside step 3.
        assert not release.is_set() and steps_seen[-1] == 3
        release.set()
        for chunk in chunks:
            received += chunk
        events = [line[6:] for line in received.decode().split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
        assert len(texts) == 4


def _stream(base_url: str, model: str, disconnect_after: int | None, results: list) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "one two three four five"}],
            "max_tokens": 30, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with requests.post(base_url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
            assert r.status_code == 200, r.text
            n = 0
            for line in r.iter_lines():
                if line.startswith(b"data: "):
                    n += 1
                    if disconnect_after is not None and n >= disconnect_after:
                        r.raw._fp.fp.raw._sock.shutdown(socket.SHUT_RDWR)  # hang up like a killed client
                        results.append("disconnected")
                        return
            results.append("completed" if line == b"data: [DONE]" or n else "empty")
    except Exception as e:  # noqa: BLE001  recorded, asserted below
        results.append(repr(e))


def test_64_streams_with_random_disconnects_leave_nothing_in_flight():
    engine = FakeEngine(max_num_seqs=64, step_delay=0.01, num_pages_total=4096)
    with RunningServer(engine, threads=96) as s:
        rng = random.Random(0)
        plans = [None if rng.random() < 0.5 else rng.randint(1, 20) for _ in range(64)]
        results: list = []
        threads = [threading.Thread(target=_stream, args=(s.base_url, s.model, p, results)) for p in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert set(results) <= {"completed", "disconnected"}, results
        assert results.count("disconnected") == sum(p is not None for p in plans)
        assert wait_until(lambda: s.loop.num_in_flight() == 0)
        text = ""

        def idle():
            nonlocal text
            text = requests.get(s.base_url + "/metrics").text
            return (metric(text, "jaxinfer:num_requests_running") == 0
                    and metric(text, "jaxinfer:kv_cache_num_pages_used") == 0)
        assert wait_until(idle), text
        aborted = metric(text, "jaxinfer:request_success_total", finished_reason="abort")
        finished = metric(text, "jaxinfer:request_success_total", finished_reason="length")
        assert aborted + finished == 64
        assert aborted == engine.num_aborted >= 1
        assert finished >= results.count("completed")
        assert metric(text, "jaxinfer:e2e_request_latency_seconds_count") == 64
        assert metric(text, "jaxinfer:generation_tokens_total") == engine._counters["generation_tokens_total"]
        assert s.loop.admission.num_waiting == 0 and s.loop.admission.num_waiting_tokens == 0


def test_non_streaming_client_that_hangs_up_is_aborted():
    engine = FakeEngine(step_delay=0.05, max_model_len=1024)
    with RunningServer(engine) as s:
        body = json.dumps({"model": s.model, "prompt": "the cat", "max_tokens": 500}).encode()
        sock = socket.create_connection(("127.0.0.1", s.server.effective_port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_until(lambda: s.loop.num_in_flight() == 1, 5)
        sock.close()
        assert wait_until(lambda: engine.num_aborted == 1, 5)
        assert wait_until(lambda: s.loop.num_in_flight() == 0, 5)
