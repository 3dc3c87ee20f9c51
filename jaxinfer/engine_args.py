"""The command-line flags of an engine, shared by ``jaxinfer generate`` and ``jaxinfer serve``.

One flag per ``EngineConfig`` field (``overlap`` aside: a Python object), each defaulting to
``None``, which is the platform default tabled in ``jaxinfer.engine_config``: a flag left out
means what the same argument left out of ``LLM(...)`` means.
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxinfer.admission import ADMISSION_POLICIES
from jaxinfer.attention import IMPLEMENTATIONS
from jaxinfer.engine_config import PLATFORM_DEFAULTS, EngineConfig
from jaxinfer.kv_cache_dtype import KV_CACHE_DTYPES, SUPPORTED_FP8_DEVICES
from jaxinfer.quantization import QUANTIZATIONS
from jaxinfer.quantized_checkpoint import ACTIVATION_SCALES

# The fields a flag sets, named as the flags' destinations.
ENGINE_FLAGS = tuple(field.name for field in dataclasses.fields(EngineConfig) if field.name != "overlap")


def _by_platform(field: str) -> str:
    cpu, gpu, tpu = (getattr(PLATFORM_DEFAULTS[p], field) for p in ("cpu", "gpu", "tpu"))
    return f"default {gpu} on GPU and TPU, {cpu} on CPU" if gpu == tpu != cpu else f"default {gpu}"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "engine", "a flag left out takes the platform default, the same as LLM(...) (jaxinfer.engine_config)"
    )
    a = group.add_argument
    a("--max-model-len", type=int, default=None, help="longest prompt + output in tokens (default: the model's context)")
    a("--max-num-seqs", type=int, default=None,
      help=f"most sequences in one engine step ({_by_platform('max_num_seqs')}; at most max-num-batched-tokens)")
    a("--max-num-batched-tokens", type=int, default=None,
      help=f"token budget of one engine step ({_by_platform('max_num_batched_tokens')}; at least max-num-seqs)")
    a("--page-size", type=int, default=None, help=f"tokens per KV page ({_by_platform('page_size')})")
    a("--num-pages", type=int, default=None,
      help="KV pages (default: sized from the device memory left after the weights; 1 GiB of KV on CPU)")
    a("--memory-utilization", type=float, default=None,
      help=f"fraction of device memory for weights + KV cache when sizing the page pool "
           f"({_by_platform('memory_utilization')})")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
      help="share the KV pages of common prompt prefixes between requests (default: on)")
    a("--max-wait-s", type=float, default=None,
      help=f"with nothing running, seconds to wait for more arrivals before the first step "
           f"({_by_platform('max_wait_s')})")
    a("--scheduling-admission", choices=ADMISSION_POLICIES, default=None,
      help="reserve: admit a request only when the free KV pages also cover the expected growth of the "
           "running ones (few preemptions; the default); greedy: whenever its prompt fits")
    a("--attention-impl", choices=IMPLEMENTATIONS, default=None,
      help="attention kernel (default auto: Pallas on GPU/TPU, the plain-JAX reference on CPU)")
    a("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
      help="prepare the next step on the host while the device runs this one (default: on)")
    a("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
      help=f"KV page storage: auto (the model's dtype, the default) or fp8 (e4m3 with per-layer scales: twice "
           f"the tokens of bf16; on {SUPPORTED_FP8_DEVICES})")
    a("--speculative-config", default=None, metavar="JSON",
      help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
           '"prompt_lookup_max": 4}\' (default: off; docs/SPECULATIVE.md)')
    a("--quantization", choices=sorted(QUANTIZATIONS), default=None,
      help="quantize the projections' weights at load, per output channel: fp8 (e4m3; GPUs sm_89+, TPU v7+, "
           "CPU emulated) or int8 (weight-only, every platform); default: as the checkpoint stores them "
           "(docs/QUANTIZATION.md)")
    a("--activation-scales", choices=ACTIVATION_SCALES, default=None,
      help="how FP8 W8A8 scales activations: dynamic (per token) or static (per tensor, fused into the "
           "producer; needs a checkpoint with input scales, compressed-tensors FP8 or a calibrated jaxinfer "
           "convert); default: the checkpoint's")
    a("--tensor-parallel-size", type=int, default=1, help="devices each model replica is split over")
    a("--data-parallel-size", type=int, default=1, help="model replicas, each with its own scheduler")


def engine_options_from_args(args: argparse.Namespace) -> dict[str, object]:
    """The ``EngineConfig`` fields (and ``LLM`` arguments of the same names) the flags set; ``None``: default."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS}
