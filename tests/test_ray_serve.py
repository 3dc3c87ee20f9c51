"""The Ray Serve deployment (jaxinfer.ray_serve) on a local Ray cluster: routes, SSE, load
shedding, disconnects and autoscaling through the fake engine; prefix-aware routing against
round robin with the tiny model.

One Ray cluster (loopback, no dashboard, no usage stats, 2 logical CPUs) serves every test in
turn; each test deploys its own application at "/" and deletes it. It runs Serve's default
proxy: the low-latency path (``serve-ray --low-latency``) binds HAProxy's stats and metrics ports
on every interface, at fixed numbers.
"""

import functools
import io
import json
import os
import pickle
import socket
import threading
import time
import types

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
requests = pytest.importorskip("requests")

from jaxinfer.engine_client import EngineFault, QueueFullError  # noqa: E402
from jaxinfer.engine_config import EngineConfig  # noqa: E402
from jaxinfer.errors import PromptTooLongError  # noqa: E402
from jaxinfer.model_registry import default_cache_dir  # noqa: E402
from jaxinfer.ray_serve import wire  # noqa: E402
from jaxinfer.ray_serve.application import ENGINE_DEPLOYMENT, build_application  # noqa: E402
from jaxinfer.ray_serve.autoscaling import KV_CACHE_USAGE, NUM_REQUESTS_WAITING, QueueAutoscalingPolicy  # noqa: E402
from jaxinfer.ray_serve.config import NUM_CONTROL_SLOTS, ModelSpec, RayServeConfig  # noqa: E402
from jaxinfer.ray_serve.remote_client import sum_replica_stats  # noqa: E402
from jaxinfer.server.admission import AdmissionConfig  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.fake_engine import TINY_LLAMA3, FakeEngine  # noqa: E402

# Serve warns that the metrics_interval_s it still reads is deprecated (docs/RAY.md).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

APP = "jaxinfer"
MODEL = "tiny"
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Replicas are new processes: they import tests.fake_engine and reuse the compilation cache.
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    "JAX_PLATFORMS": "cpu",
    "JAX_COMPILATION_CACHE_DIR": str(default_cache_dir() / "jax-compilation-cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url():
    saved = {name: os.environ.get(name) for name in RAY_ENV}
    os.environ.update(RAY_ENV)  # inherited by the Ray processes ray.init starts
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def deploy(build_engine, **config) -> None:
    """Deploys the application; without the Batch API unless ``batch_store`` is given (one replica fewer)."""
    config = RayServeConfig(MODEL, **{"max_num_seqs": 8, "num_cpus_per_replica": 0, "ingress_num_cpus": 0,
                                      "batch_num_cpus": 0, "ingress_threads": 64, "batch_store": None, **config})
    serve.run(build_application(build_engine, config), name=APP, route_prefix="/")


@pytest.fixture
def app_cleanup(base_url):
    yield
    serve.delete(APP)


def engine_stats() -> list[dict]:
    return serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP).broadcast("stats").results()


def num_engine_replicas() -> tuple[int, int]:
    """(running, all) replicas of the engine deployment."""
    states = serve.status().applications[APP].deployments[ENGINE_DEPLOYMENT].replica_states
    return states.get("RUNNING", 0), sum(states.values())


def sse_events(r) -> list:
    return [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]


def wait_for(predicate, timeout_s: float, what: str) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout_s``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - start


def test_wire_keeps_what_pickle_loses():
    """Engine errors cross the Ray boundary with their typed fields."""
    refusal = pickle.loads(pickle.dumps(wire.encode(PromptTooLongError("too long", field="prompt", limit=7), {})))
    error, timing = wire.decode(refusal)
    assert type(error) is PromptTooLongError and (error.field, error.limit, str(error)) == ("prompt", 7, "too long")
    assert timing is None and isinstance(wire.decode(wire.encode(EngineFault("x"), {}))[0], EngineFault)
    unavailable = pickle.loads(pickle.dumps(wire.Unavailable.from_error(QueueFullError("full", 2.5)))).to_error()
    assert type(unavailable) is QueueFullError and unavailable.retry_after_s == 2.5


def test_wsgi_bridge_sends_every_chunk_in_order_to_a_slow_client():
    """The bridge's responder hands chunks to the event loop without waiting for each; a client
    slower than the app still gets every chunk, in order (the app waits once the buffer is full)."""
    import asyncio

    from jaxinfer.ray_serve.wsgi_bridge import MAX_BUFFERED_CHUNKS, WSGIBridge

    num_chunks = 3 * MAX_BUFFERED_CHUNKS

    def app(environ, start_response):
        name = environ["wsgi.input"].read()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return (b"%s %d," % (name, i) for i in range(num_chunks))

    async def serve_one() -> list[dict]:
        bridge, sent = WSGIBridge(app, num_threads=2), []
        inbox = [{"type": "http.request", "body": b"c", "more_body": False}]

        async def receive():
            if inbox:
                return inbox.pop(0)
            await asyncio.sleep(3600)  # the client stays

        async def send(message):
            await asyncio.sleep(0.002)  # a slow client
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"", "headers": [],
                 "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "scheme": "http",
                 "http_version": "1.1", "root_path": ""}
        await bridge(scope, receive, send)
        return sent

    sent = asyncio.run(serve_one())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert b"".join(m["body"] for m in sent[1:]) == b"".join(b"c %d," % i for i in range(num_chunks))
    assert not sent[-1].get("more_body", False) and all(m["more_body"] for m in sent[1:-1])


def autoscaling_context(n: int, waiting: list[float], kv: list[float], queued: float = 0.0, max_replicas: int = 4):
    ids = [f"replica-{i}" for i in range(n)]
    return types.SimpleNamespace(
        current_num_replicas=n, target_num_replicas=n, total_queued_requests=queued,
        aggregated_metrics={NUM_REQUESTS_WAITING: dict(zip(ids, waiting)), KV_CACHE_USAGE: dict(zip(ids, kv))},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=max_replicas)


@pytest.mark.parametrize("waiting, kv, queued, expected", [
    ([9.0, 0.0], [0.1, 0.1], 0.0, 3),  # 4.5 waiting per replica > 4: up, to cover the queue
    ([2.0, 2.0], [0.1, 0.1], 5.0, 3),  # Serve's own queue counts as waiting
    ([0.0, 0.0], [0.85, 0.9], 0.0, 3),  # KV past 0.8: up by one
    ([20.0, 20.0], [0.1, 0.1], 0.0, 4),  # capped at max_replicas
    ([0.0, 0.0], [0.1, 0.2], 0.0, 1),  # empty queue and low KV: down by one
    ([0.5, 0.0], [0.1, 0.1], 0.0, 2),  # something waits: hold
    ([0.0, 0.0], [0.6, 0.6], 0.0, 2),  # KV between low and high: hold
])
def test_autoscaling_rule(waiting, kv, queued, expected):
    desired, _ = QueueAutoscalingPolicy()(autoscaling_context(2, waiting, kv, queued))
    assert desired == expected


def test_sum_replica_stats():
    total = sum_replica_stats([{"num_running": 2, "kv_cache_usage": 0.2, "server_num_requests_waiting": 1},
                               {"num_running": 3, "kv_cache_usage": 0.4, "server_num_requests_waiting": 0}])
    assert total == {"num_replicas": 2, "num_running": 5, "kv_cache_usage": pytest.approx(0.3),
                     "server_num_requests_waiting": 1}
    ratios = sum_replica_stats([{"admission_new_token_ratio": 0.2, "admission_reserved_pages": 10},
                                {"admission_new_token_ratio": 0.6, "admission_reserved_pages": 5}])
    assert ratios["admission_new_token_ratio"] == pytest.approx(0.4) and ratios["admission_reserved_pages"] == 15


@pytest.mark.timeout(240)
def test_routes_stream_shed_load_and_abort_on_disconnect(base_url, app_cleanup):
    deploy(functools.partial(FakeEngine, max_num_seqs=1, step_delay=0.05, max_model_len=1024),
           admission=AdmissionConfig(max_waiting_requests=1, retry_after_s=3))
    r = requests.get(base_url + "/v1/models", timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL

    # A streamed chat arrives through Serve as several SSE chunks, then [DONE].
    r = requests.post(base_url + "/v1/chat/completions", stream=True, timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "the cat sat"}], "max_tokens": 5, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert len(events) >= 4 and events[-1] == b"[DONE]"

    # The engine's refusal keeps its field and code through the replica and the wire.
    r = requests.post(base_url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "the cat sat", "max_tokens": 2000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"

    # One request runs, one waits: the third is shed by the replica's admission, 503 + Retry-After.
    running = requests.post(base_url + "/v1/completions", stream=True, timeout=30,
                            json={"model": MODEL, "prompt": "the cat sat", "max_tokens": 400, "stream": True})
    assert running.status_code == 200
    running_lines = running.iter_lines()  # kept: a line iterator collected mid-stream closes the connection
    next(running_lines)
    waiting = threading.Thread(target=requests.post, args=(base_url + "/v1/completions",),
                               kwargs={"json": {"model": MODEL, "prompt": "a dog", "max_tokens": 2}, "timeout": 60})
    waiting.start()
    wait_for(lambda: sum(s.get("server_num_requests_waiting", 0) for s in engine_stats()) == 1, 20, "a waiting request")
    shed = requests.post(base_url + "/v1/completions", timeout=30,
                         json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert shed.status_code == 503 and shed.headers["Retry-After"] == "3"
    assert shed.json()["error"]["code"] == "queue_full"

    # The client of the 20 s stream hangs up: the engine request is aborted, not run to its end.
    running.close()
    seconds = wait_for(lambda: all(s.get("num_running", 0) == 0 and s.get("num_waiting", 0) == 0
                                   for s in engine_stats()), 8, "the abort")
    waiting.join(timeout=30)

    # A client waiting for a whole (non-streamed) answer that gives up is aborted too.
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(base_url + "/v1/completions", timeout=(5, 1),
                      json={"model": MODEL, "prompt": "the cat sat", "max_tokens": 400})
    whole_seconds = wait_for(lambda: all(s.get("num_running", 0) == 0 for s in engine_stats()), 8, "the abort")
    print(f"\ndisconnect -> engine request gone in {seconds:.2f} s (streamed), {whole_seconds:.2f} s (whole)")


@pytest.mark.timeout(240)
def test_serves_queue_full_is_a_503_with_retry_after(base_url, app_cleanup):
    """Serve's own queue: when every replica holds max_ongoing_requests calls, Serve queues
    max_queued_requests more (1 here), and refuses the next itself (BackPressureError); it leaves as
    the routes' 503 queue_full with Retry-After, not a 500. To fill the replica's slots with calls
    its admission does not refuse, the config understates the engine's max_num_seqs (1, the fake
    runs 16): the replica takes 1 + 1 + NUM_CONTROL_SLOTS calls, all of them running."""
    deploy(functools.partial(FakeEngine, max_num_seqs=16, step_delay=0.05, max_model_len=1024), max_num_seqs=1,
           admission=AdmissionConfig(max_waiting_requests=1, retry_after_s=4), max_queued_requests=1)
    capacity = 2 + NUM_CONTROL_SLOTS
    streams = []

    def start_stream():
        r = requests.post(base_url + "/v1/completions", stream=True, timeout=60,
                          json={"model": MODEL, "prompt": "the cat sat", "max_tokens": 400, "stream": True})
        lines = r.iter_lines()  # kept: a line iterator collected mid-stream closes the connection
        next(lines)  # its first token: it no longer counts as waiting for the admission
        streams.append((r, lines))

    queued = threading.Thread(target=start_stream)
    try:
        for _ in range(capacity):  # one at a time: each runs before the next arrives
            start_stream()
        assert all(r.status_code == 200 for r, _ in streams)
        queued.start()
        time.sleep(2)  # this call waits in Serve's handle queue (nothing answers it yet)
        assert len(streams) == capacity
        shed = requests.post(base_url + "/v1/completions", timeout=30,
                             json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert shed.status_code == 503, shed.text
        assert shed.headers["Retry-After"] == "4" and shed.json()["error"]["code"] == "queue_full"
        assert "Serve's queue is full" in shed.json()["error"]["message"]  # Serve's refusal, not the replica's
    finally:
        for r, _ in list(streams):
            r.close()  # the clients hang up: their engine requests are aborted, the queued call runs
        if queued.is_alive():
            queued.join(timeout=60)
        for r, _ in list(streams):
            r.close()


def merged_value(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("store", ["sqlite", pytest.param("redis", marks=pytest.mark.slow)])
def test_batch_api_and_metrics_through_the_ray_ingress(base_url, app_cleanup, tmp_path, store, request):
    """The Batch API round trip through the openai SDK against the Ray ingress (SQLite: one
    batch-runner replica owning the file; Redis: two runners on one stream, the ingress opening
    Redis itself; lines run on the engine replicas), and /metrics: the engine replicas' metrics
    merged, every name deploy/ uses exported."""
    import openai

    from jaxinfer.ray_serve.config import BatchStoreOptions
    from jaxinfer.server.batch_runner import BatchRunnerConfig
    from tests.deploy_metrics import exported_metric_names, metric_names_used_in_deploy

    if store == "redis":
        from tests.redis_server import RedisServer

        redis = RedisServer(tmp_path)
        request.addfinalizer(lambda: (serve.delete(APP), redis.stop()))  # the runners stop before Redis does
        store_options = BatchStoreOptions(redis_url=redis.url, num_runners=2)
    else:
        store_options = BatchStoreOptions(db_path=str(tmp_path / "batches.db"))
    deploy(functools.partial(FakeEngine, max_num_seqs=4, max_model_len=256), max_num_seqs=4, min_replicas=2,
           max_replicas=2, batch_store=store_options,
           batch_runner=BatchRunnerConfig(poll_s=0.01, housekeeping_s=0.1), max_file_bytes=1 << 20)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    bodies = {f"l{i}": {"model": MODEL, "prompt": f"the cat sat {i}", "max_tokens": 3} for i in range(6)}
    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body} for cid, body in bodies.items()]
    content = "".join(json.dumps(line) + "\n" for line in lines) + "not json\n"
    uploaded = client.files.create(file=("input.jsonl", io.BytesIO(content.encode())), purpose="batch")
    assert client.files.content(uploaded.id).content == content.encode()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.status == "validating" and batch.request_counts.total == 7 and batch.request_counts.failed == 1
    wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", 60, "the batch")
    batch = client.batches.retrieve(batch.id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 1)
    assert [b.id for b in client.batches.list(limit=5)] == [batch.id]
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(bodies)
    for o in out:  # each line answered as its endpoint answers over HTTP
        direct = requests.post(base_url + "/v1/completions", json=bodies[o["custom_id"]], timeout=30).json()
        assert o["response"]["body"]["choices"] == direct["choices"] and o["response"]["body"]["usage"] == direct["usage"]
    [error] = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["error"]["code"] == "invalid_json_line"

    text = requests.get(base_url + "/metrics", timeout=30).text
    assert metric_names_used_in_deploy() - exported_metric_names(text) == set()
    # 6 batch lines and 6 direct requests ran on the two engine replicas: their counters add up here.
    assert merged_value(text, "jaxinfer:request_success_total") == 12
    assert merged_value(text, "jaxinfer:time_to_first_token_seconds_count") == 12
    assert merged_value(text, "jaxinfer:batch_lines_completed_total") == 6
    assert merged_value(text, "jaxinfer:batch_lines_failed_total") == 1
    assert merged_value(text, "jaxinfer:kv_cache_usage_perc") == 0 and merged_value(text, "jaxinfer:server_healthy") == 1
    assert text.count("# TYPE jaxinfer:num_requests_waiting gauge") == 1


def test_merged_metrics_sum_counters_average_kv_and_keep_devices_per_replica():
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from jaxinfer.ray_serve.metrics import merge_families

    def replica(hits: float, kv: float, waiting: float, gpu_util: float) -> list:
        counter = CounterMetricFamily("jaxinfer:prefix_cache_hits", "hits", labels=["model_name"])
        counter.add_metric(["m"], hits)
        families = [counter]
        for name, value in (("kv_cache_usage_perc", kv), ("num_requests_waiting", waiting), ("server_healthy", 1)):
            gauge = GaugeMetricFamily("jaxinfer:" + name, name, labels=["model_name"])
            gauge.add_metric(["m"], value)
            families.append(gauge)
        gpu = GaugeMetricFamily("jaxinfer:gpu_utilization_perc", "gpu", labels=["gpu"])
        gpu.add_metric(["0"], gpu_util)
        return families + [gpu]

    ingress = replica(0, 0, 0, 0.99)  # the ingress runs no engine: its device and KV samples are not the engines'
    ingress[3].samples[0] = ingress[3].samples[0]._replace(value=0)  # and says whether it is healthy
    merged = {f.name: f for f in merge_families(ingress, {"a": replica(5, 0.2, 1, 0.5), "b": replica(7, 0.6, 2, 0.7)},
                                                [])}
    value = {name: [(s.labels, s.value) for s in f.samples] for name, f in merged.items()}
    assert value["jaxinfer:prefix_cache_hits"] == [({"model_name": "m"}, 12)]
    assert value["jaxinfer:num_requests_waiting"] == [({"model_name": "m"}, 3)]
    assert value["jaxinfer:kv_cache_usage_perc"] == [({"model_name": "m"}, pytest.approx(0.4))]
    assert value["jaxinfer:server_healthy"] == [({"model_name": "m"}, 0)]
    assert value["jaxinfer:gpu_utilization_perc"] == [({"gpu": "0", "replica": "a"}, 0.5),
                                                      ({"gpu": "0", "replica": "b"}, 0.7)]


def completion(base_url: str, prompt, max_tokens: int) -> tuple[int, dict]:
    r = requests.post(base_url + "/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
    return r.status_code, r.json()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_autoscaling_follows_the_queue_up_and_down(base_url, app_cleanup):
    """1 -> 2 replicas while requests wait, back to 1 once the queue is empty (a client still
    sending); every request answered."""
    deploy(functools.partial(FakeEngine, max_num_seqs=2, step_delay=0.05), max_num_seqs=2, min_replicas=1,
           max_replicas=2, max_waiting_per_replica=1, upscale_delay_s=0.5, downscale_delay_s=3,
           look_back_period_s=1, metrics_interval_s=0.25, graceful_shutdown_timeout_s=60)
    assert num_engine_replicas() == (1, 1)
    results, max_tokens = [], 30  # 1.5 s a request; 2 run at once per replica
    start = time.monotonic()

    def client(i: int) -> None:
        for j in range(3):
            results.append(completion(base_url, f"the cat sat {i} {j}", max_tokens))

    clients = [threading.Thread(target=client, args=(i,)) for i in range(10)]
    for c in clients:
        c.start()
    scale_decided_s = wait_for(lambda: num_engine_replicas()[1] == 2, 60, "a second replica to be started")
    # A replica's start is a process that imports jax: seconds on a quiet host, over a minute on a
    # loaded 2-core one (a full run beside a CPU benchmark took > 60 s), so this wait is generous.
    scale_up_s = wait_for(lambda: num_engine_replicas()[0] == 2, 150, "the second replica to run") + scale_decided_s
    for c in clients:
        c.join(timeout=120)
    load_s = time.monotonic() - start
    # One client goes on, one request at a time (nothing waits), while a replica is removed.
    scaled_down = threading.Event()

    def trickle() -> None:
        while not scaled_down.is_set():
            results.append(completion(base_url, "a trickle", max_tokens))

    trickle_client = threading.Thread(target=trickle)
    trickle_client.start()
    scale_down_s = wait_for(lambda: num_engine_replicas() == (1, 1), 60, "the scale down")
    scaled_down.set()
    trickle_client.join(timeout=30)
    failed = [(status, body) for status, body in results
              if status != 200 or body["usage"]["completion_tokens"] != max_tokens]
    print(f"\nautoscaling: 1->2 decided after {scale_decided_s:.1f} s, second replica running after "
          f"{scale_up_s:.1f} s; load took {load_s:.1f} s; back to 1 replica {scale_down_s:.1f} s after the load; "
          f"{len(failed)} of {len(results)} requests failed")
    assert len(results) > 30 and not failed


def prefix_hit_rate(base_url: str, router: str) -> float:
    """The replicas' own prefix-cache hit rate (hit tokens / looked-up tokens) on 3 long prefixes,
    each sent 3 times in turn to 2 replicas of the tiny model, one request at a time."""
    spec = ModelSpec(str(TINY_LLAMA3), "float32", EngineConfig(max_num_seqs=4, max_model_len=512, num_pages=64,
                                                               page_size=32))
    deploy(spec, max_num_seqs=4, min_replicas=2, max_replicas=2, router=router, page_size=32)
    try:
        prefixes = [[10 + (37 * k + 11 * i) % 490 for i in range(96)] for k in range(3)]  # 3 pages each
        for turn in range(3):
            for k, prefix in enumerate(prefixes):
                status, body = completion(base_url, prefix + [400 + turn, 401 + k, 402, 403, 404, 405, 406, 407], 1)
                assert status == 200, body
        stats = engine_stats()
        assert len(stats) == 2
        return sum(s["prefix_cache_hits"] for s in stats) / sum(s["prefix_cache_queries"] for s in stats)
    finally:
        serve.delete(APP)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prefix_aware_routing_beats_round_robin(base_url):
    prefix_aware, round_robin = prefix_hit_rate(base_url, "prefix"), prefix_hit_rate(base_url, "round-robin")
    print(f"\nprefix-cache hit rate: prefix-aware {prefix_aware:.3f}, round robin {round_robin:.3f} "
          f"({prefix_aware / max(round_robin, 1e-9):.2f}x)")
    assert prefix_aware >= 1.8 * round_robin > 0


def test_serve_config_yaml_builds_the_application():
    """deploy/ray/serve_config.yaml's args are serve-ray flags: they build the same deployments."""
    import yaml

    from jaxinfer.ray_serve.serve_ray import build_app

    [application] = yaml.safe_load((REPO / "deploy" / "ray" / "serve_config.yaml").read_text())["applications"]
    app = build_app({**application["args"], "accelerator": "cpu"})
    engine = app._bound_deployment.init_args[0]._bound_deployment  # the ingress's first argument
    assert engine.name == ENGINE_DEPLOYMENT
    assert engine._deployment_config.autoscaling_config.max_replicas == 4
    # The CPU default max_num_seqs (16) plus the waiting limit: the engine's queue forms inside the
    # replica; plus the control calls' slots.
    assert engine._deployment_config.max_ongoing_requests == 16 + 256 + NUM_CONTROL_SLOTS
    with pytest.raises(ValueError, match="unknown args"):
        build_app({"min_replica": 1, "accelerator": "cpu"})


def test_tool_call_parser_reaches_the_ingress():
    """serve-ray takes --tool-call-parser as serve does, and hands it to the ingress's app."""
    from jaxinfer.ray_serve.serve_ray import build_app

    app = build_app({"tool_call_parser": "llama3_json", "accelerator": "cpu"})
    options = app._bound_deployment.init_args[2]  # (engine handle, batch handle, IngressOptions)
    assert options.tool_call_parser == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_parser"):  # serve_config.yaml skips argparse's choices
        build_app({"tool_call_parser": "no_such_format", "accelerator": "cpu"})
