"""The Batch API through the ``openai`` SDK, on a real server over the fake engine, with a SQLite store.

A batch line's response body must be the body its endpoint answers over HTTP (same validation,
same engine, same response builder), so the tests compare the two; invalid lines land in the
error file naming their field; uploads have their own size limit.
"""

import io
import json
import time

import openai
import pytest
import requests

from jaxinfer.server.batch_runner import BatchRunnerConfig
from jaxinfer.batch_api.sqlite_store import SQLiteBatchStore
from jaxinfer.server.background import BackgroundServer
from tests.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-llama3"
MAX_BODY_BYTES = 16 * 1024
MAX_FILE_BYTES = 64 * 1024
FAST_RUNNER = BatchRunnerConfig(poll_s=0.005, housekeeping_s=0.05)


def start_server(tmp_path, batch_window_s=None, **engine_kw) -> BackgroundServer:
    return BackgroundServer(FakeEngine(max_model_len=256, **engine_kw), served_model_name=MODEL, threads=8,
                            max_body_bytes=MAX_BODY_BYTES, batch_store=SQLiteBatchStore(tmp_path / "batches.db"),
                            max_file_bytes=MAX_FILE_BYTES, batch_runner=FAST_RUNNER, batch_window_s=batch_window_s)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with start_server(tmp_path_factory.mktemp("batch")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=10)


def jsonl(lines: list) -> bytes:
    return b"".join((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines)


def line(custom_id, body, url="/v1/completions", method="POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": {"model": MODEL, **body}}


def run_batch(client, content: bytes, endpoint="/v1/completions", timeout_s=30.0):
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    num_lines = len([x for x in content.splitlines() if x.strip()])
    assert batch.status == "validating" and batch.request_counts.total == num_lines
    deadline = time.monotonic() + timeout_s
    while batch.status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
    return batch


def file_lines(client, file_id) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_a_batch_answers_each_line_as_its_endpoint_would(client, server):
    bodies = {"cat": {"prompt": "the cat sat", "max_tokens": 5},
              "two": {"prompt": ["a b c", "d e"], "max_tokens": 3, "n": 2, "logprobs": 1},
              "echo": {"prompt": "x y z", "max_tokens": 2, "echo": True, "stop": ["y"]}}
    batch = run_batch(client, jsonl([line(cid, body) for cid, body in bodies.items()]))
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 3, 0)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    out = file_lines(client, batch.output_file_id)
    assert [o["custom_id"] for o in out] == list(bodies)
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200 and o["id"].startswith("batch_req_")
        direct = requests.post(server.base_url + "/v1/completions", json={"model": MODEL, **bodies[o["custom_id"]]},
                               timeout=10).json()
        assert without_ids(o["response"]["body"]) == without_ids(direct)
    tok = server.engine.tokenizer  # the fake repeats the prompt's content tokens
    content = tok.encode("the cat sat", add_special_tokens=False)
    assert out[0]["response"]["body"]["choices"][0]["text"] == tok.decode((content * 5)[:5])
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_chat_lines(client, server):
    messages = [{"role": "user", "content": "hi there"}]
    batch = run_batch(client, jsonl([line("c", {"messages": messages, "max_tokens": 4}, url="/v1/chat/completions")]),
                      endpoint="/v1/chat/completions")
    [out] = file_lines(client, batch.output_file_id)
    direct = requests.post(server.base_url + "/v1/chat/completions",
                           json={"model": MODEL, "messages": messages, "max_tokens": 4}, timeout=10).json()
    assert out["response"]["body"]["object"] == "chat.completion"
    assert without_ids(out["response"]["body"]) == without_ids(direct)


def test_invalid_lines_land_in_the_error_file_naming_their_field(client):
    good = line("good", {"prompt": "a b", "max_tokens": 2})
    batch = run_batch(client, jsonl([
        good,
        '{"custom_id": "broken", "method": "POST"',  # not JSON
        "[1, 2]",  # JSON, not an object
        {**line("x", {"prompt": "a"}), "custom_id": None},
        line("good", {"prompt": "a b", "max_tokens": 2}),  # a repeated custom_id
        line("get", {"prompt": "a"}, method="GET"),
        line("url", {"prompt": "a"}, url="/v1/embeddings"),
        {**line("nobody", {}), "body": "text"},
        line("negative", {"prompt": "a", "max_tokens": -1}),
        line("stream", {"prompt": "a", "stream": True}),
        line("model", {"prompt": "a", "model": "gpt-4"}),
        line("context", {"prompt": "a", "max_tokens": 10_000}),
        "",  # blank lines are skipped
    ]))
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (12, 1, 11)
    assert [o["custom_id"] for o in file_lines(client, batch.output_file_id)] == ["good"]
    errors = file_lines(client, batch.error_file_id)
    refused = [(e["custom_id"], e["error"]["param"], e["error"]["code"]) for e in errors if e["error"]]
    assert refused == [(None, "line", "invalid_json_line"), (None, "line", "invalid_json_line"),
                       (None, "custom_id", "missing_custom_id"), ("good", "custom_id", "duplicate_custom_id"),
                       ("get", "method", "invalid_method"), ("url", "url", "invalid_url"),
                       ("nobody", "body", "invalid_request")]
    assert all(e["response"] is None and e["error"]["message"].startswith("line ") for e in errors if e["error"])
    answered = {e["custom_id"]: e["response"] for e in errors if e["error"] is None}
    assert {cid: (r["status_code"], r["body"]["error"]["param"]) for cid, r in answered.items()} == {
        "negative": (400, "max_tokens"), "stream": (400, "stream"), "model": (404, "model"),
        "context": (400, "max_tokens")}
    assert answered["context"]["body"]["error"]["code"] == "context_length_exceeded"
    assert len({e["id"] for e in errors}) == len(errors)


@pytest.mark.parametrize("content, kw, param", [
    (b"\xff\xfe not text", {}, "input_file_id"),
    (b"\n  \n", {}, "input_file_id"),
    (b"hello\nworld\n", {}, "input_file_id"),
    (jsonl([line("a", {"prompt": "a"})]), {"endpoint": "/v1/embeddings"}, "endpoint"),
    (jsonl([line("a", {"prompt": "a"})]), {"completion_window": "1h"}, "completion_window"),
    (jsonl([line("a", {"prompt": "a"})]), {"input_file_id": "file-missing"}, "input_file_id"),
])
def test_a_file_that_cannot_be_a_batch_is_a_400_naming_the_field(client, content, kw, param):
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
    args = {"input_file_id": uploaded.id, "endpoint": "/v1/completions", "completion_window": "24h", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(**args)
    assert e.value.body["param"] == param


def test_files_round_trip_and_unknown_ids_are_404(client, server):
    content = jsonl([line("a", {"prompt": "a"})])
    uploaded = client.files.create(file=("mine.jsonl", io.BytesIO(content)), purpose="batch")
    assert (uploaded.filename, uploaded.bytes, uploaded.purpose, uploaded.object) == (
        "mine.jsonl", len(content), "batch", "file")
    assert client.files.retrieve(uploaded.id).bytes == len(content)
    assert client.files.content(uploaded.id).content == content
    for call in (lambda: client.files.retrieve("file-nope"), lambda: client.batches.retrieve("batch_nope"),
                 lambda: client.batches.cancel("batch_nope")):
        with pytest.raises(openai.NotFoundError):
            call()
    r = requests.post(server.base_url + "/v1/files", data={"purpose": "fine-tune"},
                      files={"file": ("a.jsonl", content)}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    r = requests.post(server.base_url + "/v1/files", data={"purpose": "batch"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"


def test_uploads_have_their_own_size_limit(server):
    url = server.base_url + "/v1/files"
    big = b"x" * (MAX_BODY_BYTES * 2)  # past the body limit, within the file limit
    r = requests.post(url, data={"purpose": "batch"}, files={"file": ("big.jsonl", big)}, timeout=10)
    assert r.status_code == 200 and r.json()["bytes"] == len(big)
    too_big = b"x" * MAX_FILE_BYTES
    r = requests.post(url, data={"purpose": "batch"}, files={"file": ("huge.jsonl", too_big)}, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_entity_too_large"
    assert str(MAX_FILE_BYTES) in r.json()["error"]["message"]
    chunked = requests.post(url, data=iter([too_big[:40_000], too_big[40_000:]]), timeout=10,
                            headers={"Content-Type": "multipart/form-data; boundary=x"})
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_entity_too_large"
    # Every other path keeps the body limit.
    r = requests.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "a " * MAX_BODY_BYTES},
                      timeout=10)
    assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.json()["error"]["message"]


def test_list_pages_newest_first(client):
    content = jsonl([line("a", {"prompt": "a", "max_tokens": 1})])
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
    made = [client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"i": str(i)}).id for i in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == made[0] and second.data[0].metadata == {"i": "0"}
    listed = [b.id for b in client.batches.list(limit=2)]  # the SDK follows the pages itself
    assert listed[:3] == made[::-1] and len(listed) == len(set(listed))
    with pytest.raises(openai.BadRequestError):
        client.batches.list(limit=0)


def test_cancel_stops_a_batch_and_keeps_what_was_done(tmp_path):
    with start_server(tmp_path, step_delay=0.01) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=10)
        content = jsonl([line(f"l{i}", {"prompt": "a b c", "max_tokens": 20}) for i in range(40)])
        uploaded = client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            time.sleep(0.02)
        cancelling = client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        deadline = time.monotonic() + 10
        while (batch := client.batches.retrieve(batch.id)).status != "cancelled":
            assert time.monotonic() < deadline, batch
            time.sleep(0.05)
        counts = batch.request_counts
        assert 2 <= counts.completed < 40 and counts.failed == 0
        out = file_lines(client, batch.output_file_id)
        assert len(out) == counts.completed and len({o["custom_id"] for o in out}) == len(out)
        assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling again changes nothing
        time.sleep(0.2)
        assert server.loop.num_in_flight() == 0  # the runner aborted its lines


def test_a_batch_not_done_within_its_window_expires(tmp_path):
    """The server's window is 1 s (a test option; clients still send "24h"): lines not run by then
    land in the error file as batch_expired, the answered ones stay in the output file."""
    with start_server(tmp_path, batch_window_s=1, step_delay=0.02) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=10)
        content = jsonl([line(f"l{i}", {"prompt": "a b c", "max_tokens": 20}) for i in range(40)])  # ~2 s of work
        uploaded = client.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        assert batch.expires_at - batch.created_at <= 2
        deadline = time.monotonic() + 20
        while (batch := client.batches.retrieve(batch.id)).status not in ("expired", "completed"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.05)
        counts = batch.request_counts
        assert batch.status == "expired" and batch.expired_at >= batch.expires_at and batch.completed_at is None
        assert counts.total == 40 and counts.completed + counts.failed == 40 and counts.failed > 0
        out, errors = file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
        assert len(out) == counts.completed and all(o["response"]["status_code"] == 200 for o in out)
        assert len(errors) == counts.failed
        assert {e["error"]["code"] for e in errors} == {"batch_expired"} and all(e["response"] is None for e in errors)
        assert {o["custom_id"] for o in out + errors} == {f"l{i}" for i in range(40)}
        time.sleep(0.2)
        assert server.loop.num_in_flight() == 0  # the lines running at expiry were aborted


def test_metrics_count_batch_lines(client, server):
    before = requests.get(server.base_url + "/metrics", timeout=5).text
    run_batch(client, jsonl([line("a", {"prompt": "a", "max_tokens": 1}), "not json"]))
    after = requests.get(server.base_url + "/metrics", timeout=5).text

    def value(text, name):
        return next(float(x.split()[-1]) for x in text.splitlines() if x.startswith(f"jaxinfer:{name}{{"))
    assert value(after, "batch_lines_completed_total") == value(before, "batch_lines_completed_total") + 1
    assert value(after, "batch_lines_failed_total") == value(before, "batch_lines_failed_total") + 1
    assert value(after, "batch_lines_pending") == 0
