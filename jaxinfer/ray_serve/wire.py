"""What crosses the Ray boundary between the ingress and an engine replica, one value per item.

An engine replica's ``generate``/``score`` stream starts with the admission verdict, then the
call's :data:`~jaxinfer.engine_client.StreamItem` s::

    Admitted() | Unavailable(...)            # ServiceUnavailable is raised by generate(): 503 now
    Output(RequestOutput, timing) | Refusal(...) | Fault(...)   # ... until every request ended

The engine's errors are not pickled as they are: an exception pickles as ``type(*args)``, which
loses ``RequestError``'s keyword-only ``field``/``limit`` and ``ServiceUnavailable``'s
``retry_after_s``. Each is carried as its type and fields, and rebuilt on the other side.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.engine_client import EngineFault, ServiceUnavailable, StreamItem
from jaxinfer.errors import RequestError
from jaxinfer.outputs import RequestOutput
from jaxinfer.server.request_timing import RequestTiming


@dataclasses.dataclass
class Admitted:
    """The replica took the call's requests; their outputs follow."""


@dataclasses.dataclass
class Unavailable:
    """The replica cannot take the requests now (queue full, draining, not ready, dead)."""

    error_type: type[ServiceUnavailable]
    message: str
    retry_after_s: float

    @classmethod
    def from_error(cls, e: ServiceUnavailable) -> Unavailable:
        return cls(type(e), str(e), e.retry_after_s)

    def to_error(self) -> ServiceUnavailable:
        return self.error_type(self.message, self.retry_after_s)


@dataclasses.dataclass
class Output:
    output: RequestOutput
    timing: RequestTiming | None  # the replica's timing of a finished request (traces read it)


@dataclasses.dataclass
class Refusal:
    """The engine refused one request: a :class:`~jaxinfer.errors.RequestError`, by its fields."""

    error_type: type[RequestError]
    message: str
    field: str
    limit: object


@dataclasses.dataclass
class Fault:
    message: str


WireItem = Output | Refusal | Fault


def encode(item: StreamItem, timings: dict) -> WireItem:
    """``item`` from an engine's OutputStream, with its timing once ``timings`` holds it."""
    if isinstance(item, RequestError):
        return Refusal(type(item), item.message, item.field, item.limit)
    if isinstance(item, EngineFault):
        return Fault(str(item))
    return Output(item, timings.get(item.request_id) if item.finished else None)


def decode(wire: WireItem) -> tuple[StreamItem, RequestTiming | None]:
    """The stream item ``wire`` stands for, and the timing of a finished request (else None)."""
    if isinstance(wire, Refusal):
        return wire.error_type(wire.message, field=wire.field, limit=wire.limit), None
    if isinstance(wire, Fault):
        return EngineFault(wire.message), None
    return wire.output, wire.timing
