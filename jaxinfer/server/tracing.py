"""OpenTelemetry traces, when configured: one span per HTTP request with its timing breakdown.

OpenTelemetry is optional: without an endpoint (``--otlp-traces-endpoint`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or without the packages, every call here is a no-op.
Attribute names follow the OpenTelemetry GenAI conventions where one exists.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("jaxinfer.server")


class _NoSpan:
    def set_attribute(self, key, value) -> None:
        pass

    def set_status_error(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass


class _Span:
    def __init__(self, span):
        self._span = span

    def set_attribute(self, key, value) -> None:
        if value is not None:
            self._span.set_attribute(key, value)

    def set_status_error(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        self._span.end()


class Tracer:
    """Starts request spans on a tracer provider, or does nothing without one."""

    def __init__(self, tracer_provider=None):
        self._tracer = tracer_provider.get_tracer("jaxinfer.server") if tracer_provider is not None else None

    def start_span(self, name: str, attributes: dict, traceparent: str | None = None):
        if self._tracer is None:
            return _NoSpan()
        context = None
        if traceparent:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            context = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
        from opentelemetry.trace import SpanKind

        span = self._tracer.start_span(name, context=context, kind=SpanKind.SERVER,
                                       attributes={k: v for k, v in attributes.items() if v is not None})
        return _Span(span)


def record_timing(span, timing) -> None:
    """Copy a finished request's RequestTiming onto its span."""
    span.set_attribute("gen_ai.usage.input_tokens", timing.num_prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", timing.num_generation_tokens)
    span.set_attribute("gen_ai.response.finish_reasons", [timing.finish_reason])
    span.set_attribute("gen_ai.latency.time_in_queue", timing.queue_time)
    span.set_attribute("gen_ai.latency.time_to_first_token", timing.ttft)
    span.set_attribute("gen_ai.latency.time_in_model_prefill", timing.prefill_time)
    span.set_attribute("gen_ai.latency.time_in_model_decode", timing.decode_time)
    span.set_attribute("gen_ai.latency.e2e", timing.e2e_time)


def otlp_tracer_provider(endpoint: str, service_name: str = "jaxinfer"):
    """A provider exporting to an OTLP/HTTP endpoint, or None when OpenTelemetry is not installed."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        logger.warning("an OTLP traces endpoint is set but opentelemetry-sdk and "
                       "opentelemetry-exporter-otlp-proto-http are not installed; tracing is off "
                       "(pip install 'jaxinfer[tracing]')")
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider

