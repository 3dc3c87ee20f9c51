"""Metrics (vLLM names under jaxinfer:), the Grafana dashboard's queries, JSON logs and traces."""

import io
import json
import logging
import re
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.fake_engine import FakeEngine, RunningServer

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana-dashboard.json"
VLLM_NAMES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
              "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
              "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds", "iteration_tokens_total", "request_prompt_tokens",
              "request_generation_tokens"]


def names_in(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


@pytest.fixture(scope="module")
def metrics_text():
    with RunningServer(FakeEngine()) as s:
        for stream in (False, True):
            r = requests.post(s.base_url + "/v1/completions",
                              json={"model": s.model, "prompt": "the cat sat", "max_tokens": 5, "stream": stream})
            assert r.status_code == 200
        return requests.get(s.base_url + "/metrics").text


def test_vllm_metric_names_with_jaxinfer_prefix(metrics_text):
    names = names_in(metrics_text)
    assert {"jaxinfer:" + n for n in VLLM_NAMES} <= names
    families = {f.name: f for f in text_string_to_metric_families(metrics_text)}
    ttft = families["jaxinfer:time_to_first_token_seconds"]
    assert [s.value for s in ttft.samples if s.name.endswith("_count")] == [2]
    assert sum(s.value for s in families["jaxinfer:inter_token_latency_seconds"].samples if s.name.endswith("_count")) == 8
    buckets = [s.labels["le"] for s in ttft.samples if s.name.endswith("_bucket")]
    assert buckets[:3] == ["0.001", "0.005", "0.01"] and len(buckets) == 23  # vLLM's 22 + Inf


def test_every_dashboard_query_names_an_exported_metric(metrics_text):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {m for e in exprs for m in re.findall(r"jaxinfer:[a-z0-9_:]+", e)}
    assert len(queried) > 20
    from jaxinfer.server.device_metrics import DeviceCollector

    # NVML gauges exist only where nvidia-ml-py is installed AND finds a driver and GPU (the
    # collector's own test); everything else must be exported here.
    have_nvml = DeviceCollector()._nvml is not None
    expected = {m for m in queried if have_nvml or not m.startswith("jaxinfer:gpu_")}
    assert expected - names_in(metrics_text) == set()


def test_one_json_log_line_per_finished_request_with_timing():
    from jaxinfer.server.json_logging import JsonFormatter

    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("jaxinfer.server")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with RunningServer(FakeEngine()) as s:
            r = requests.post(s.base_url + "/v1/completions", headers={"X-Request-Id": "abc-123"},
                              json={"model": s.model, "prompt": "the cat sat", "max_tokens": 3})
            assert r.headers["X-Request-Id"] == "abc-123"
    finally:
        logger.removeHandler(handler)
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    finished = [e for e in lines if e["message"] == "request finished"]
    assert len(finished) == 1
    entry = finished[0]
    assert entry["request_id"] == "abc-123" and entry["finish_reason"] == "length"
    assert (entry["prompt_tokens"], entry["completion_tokens"]) == (len(FakeEngine().tokenizer.encode("the cat sat")), 3)
    assert all(entry[k] >= 0 for k in ("queue_s", "prefill_s", "decode_s", "e2e_s"))
    assert any(e["message"] == "http request" and e["request_id"] == "abc-123" and e["status"] == 200 for e in lines)


def test_traces_with_in_memory_exporter():
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with RunningServer(FakeEngine(), tracer_provider=provider) as s:
        traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        for stream in (False, True):
            r = requests.post(s.base_url + "/v1/chat/completions", headers={"traceparent": traceparent},
                              json={"model": s.model, "messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 4, "stream": stream})
            assert r.status_code == 200 and r.text
    spans = exporter.get_finished_spans()
    assert len(spans) == 2
    for span in spans:
        assert span.name == "POST /v1/chat/completions"
        assert format(span.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
        assert span.attributes["gen_ai.usage.output_tokens"] == 4
        assert span.attributes["gen_ai.response.finish_reasons"] == ("length",)
        assert span.attributes["gen_ai.latency.time_to_first_token"] >= 0
