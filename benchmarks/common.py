"""Shared pieces of the GPU benchmarks: the run's header, the ceilings, model shapes, results files.

Every benchmark prints the command, the hardware and the jax version, measures the
ceilings it reports ratios against in the same run, and writes JSON + markdown.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import SHAPES  # noqa: E402,F401  (re-exported)


class Log:
    """Prints each line at once and keeps them for the results file; with ``elapsed``, each
    printed line starts with the seconds since the log was made (the kept lines do not)."""

    def __init__(self, elapsed: bool = False):
        self.lines: list[str] = []
        self.elapsed = elapsed
        self.start = time.time()

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(f"[{time.time() - self.start:6.1f}s] {line}" if self.elapsed else line, flush=True)
        self.lines.append(line)


def header(log: Log) -> dict:
    """Command, hardware and software of this run (printed and returned)."""
    device = jax.devices()[0]
    info = {
        "command": "python3 " + shlex.join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": getattr(device, "device_kind", str(device)),
        "num_devices": jax.device_count(),
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    if os.environ.get("XLA_FLAGS"):  # a run under other compiler options must say so in its results
        info["xla_flags"] = os.environ["XLA_FLAGS"].strip()
    from jaxinfer.decode_gemv import DECODE_MATMUL_ENV

    if os.environ.get(DECODE_MATMUL_ENV):  # the opt-in decode matmul
        info["decode_matmul"] = os.environ[DECODE_MATMUL_ENV]
    for key, value in info.items():
        log(f"{key}: {value}")
    return info


def time_in_loop(body, carry, *args, min_seconds: float = 0.05, unroll: int | None = None,
                 timed_runs: int = 3) -> float:
    """Seconds per iteration of ``carry = body(carry, *args)``, run many times inside one jit.

    A ``fori_loop`` on the GPU syncs its predicate with the host every iteration (~10-20 µs):
    fine for a multi-millisecond body; for short ones pass ``unroll`` to chain that many
    calls in one straight-line program instead, timed ``timed_runs`` times after a warm-up
    (the median; a CPU smoke run of an interpreted kernel passes 1: its numbers mean nothing).
    """
    if unroll:

        @jax.jit
        def chain(carry, *args):
            for _ in range(unroll):
                carry = body(carry, *args)
            return carry

        jax.block_until_ready(chain(carry, *args))
        times = []
        for _ in range(timed_runs):
            start = time.perf_counter()
            jax.block_until_ready(chain(carry, *args))
            times.append(time.perf_counter() - start)
        return float(np.median(times)) / unroll

    @jax.jit
    def run(n, carry, *args):
        return jax.lax.fori_loop(0, n, lambda i, c: body(c, *args), carry)

    jax.block_until_ready(run(1, carry, *args))
    n = 1
    while True:
        start = time.perf_counter()
        jax.block_until_ready(run(n, carry, *args))
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / n
        n *= 4


def measure_ceilings(log: Log, read_gib: float | None = None) -> dict:
    """HBM read ceiling (a jitted read-only reduction) and the bf16 matmul rate (8192^3).

    On a CPU (the smoke runs, whose numbers mean nothing): a 16 MiB read and a 256^3 matmul, each
    timed once; 0.25 GiB and 512^3 timed three times took 3-14 s of every smoke test that measured them.
    """
    is_cpu = jax.default_backend() == "cpu"
    timed_runs = 1 if is_cpu else 3
    if read_gib is None:
        read_gib = 1 / 64 if is_cpu else 8.0
    n_elems = int(read_gib * 2**30 / 2)
    x = jax.jit(lambda: jnp.ones((n_elems,), jnp.bfloat16))()
    t = time_in_loop(lambda c, x: c + jnp.sum(x + c.astype(x.dtype), dtype=jnp.float32) * 1e-30, jnp.float32(0), x,
                     unroll=16, timed_runs=timed_runs)
    read_tbs = x.size * 2 / t / 1e12
    del x
    n = 256 if is_cpu else 8192
    a = jax.jit(lambda: jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16))()
    b = jax.jit(lambda: jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16) / math.sqrt(n))()
    t = time_in_loop(lambda a, b: (a @ b).astype(jnp.bfloat16), a, b, unroll=16, timed_runs=timed_runs)
    matmul_tflops = 2 * n**3 / t / 1e12
    log(f"ceiling: HBM read {read_tbs:.2f} TB/s ({read_gib:g} GiB bf16 sum); bf16 matmul {matmul_tflops:.0f} TFLOP/s ({n}^3)")
    return {"hbm_read_tbs": read_tbs, "matmul_tflops": matmul_tflops}


def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer over the whole vocabulary (random weights come with none).

    Token ``i`` is the word ``t{i}``; prompts are sent as token ids, so only decoding uses it.
    """
    import tokenizers

    from jaxinfer.tokenizer import Tokenizer

    vocab = {f"t{i}": i for i in range(vocab_size)}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(tokenizer=raw)


def random_model(shape: str, dtype=jnp.bfloat16, seed: int = 0, mesh=None, quantization: str | None = None):
    """A ``LoadedModel`` of random weights with the named architecture, made on the device.

    Weights that fit on one device are made there, and ``sharding.placement.shard_model``
    pads and places them later. Only when they do not (a 70B model on 80-141 GB GPUs), or
    when the device does not report its memory (CPU), and ``mesh``'s tp size divides the head
    counts, each device makes just its own shards: on the H200s XLA took minutes to compile
    that sharded random init even for 8B, so it is the path of last resort. ``quantization``
    ("fp8", "int8"): the projections are drawn, then quantized per channel (``jaxinfer.params``).
    """
    from jaxinfer.loaded_model import LoadedModel
    from jaxinfer.config import ModelConfig
    from jaxinfer.params import init_random

    config = ModelConfig.from_hf({**SHAPES[shape], **({"quantization_config": {"quant_method": "jaxinfer",
                                                                                 "weights": quantization}}
                                                        if quantization else {})})
    shardings = None
    if mesh is not None:
        from sharding.heads import head_layout
        from sharding.mesh import TP
        from sharding.rules import weight_shardings

        identity = head_layout(config.num_q_heads, config.num_kv_heads, mesh.shape[TP]).is_identity
        if identity and not fits_one_device(config, jnp.dtype(dtype).itemsize):
            shardings = weight_shardings(config, mesh)
    weights = init_random(config, jax.random.key(seed), dtype, out_shardings=shardings)
    return LoadedModel(config=config, weights=weights, tokenizer=synthetic_tokenizer(config.vocab_size),
                       source=Path(f"random:{shape}"))


def calibrated_on_random_tokens(model, log, num_prompts: int = 4, num_tokens: int = 512, seed: int = 0):
    """``model`` (fp8, random weights) with static activation scales calibrated on random-token prompts."""
    from jaxinfer.activation_calibration import calibrate_activation_scales
    from jaxinfer.activation_scales import with_static_input_scales

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, model.config.vocab_size, num_tokens).tolist() for _ in range(num_prompts)]
    start = time.perf_counter()
    model = with_static_input_scales(model, calibrate_activation_scales(model, prompts))
    log(f"static activation scales: calibrated on {num_prompts} random-token prompts of {num_tokens} tokens "
        f"(random weights have no checkpoint scales) in {time.perf_counter() - start:.1f} s")
    return model


def jaxpr_equations(jaxpr):
    """Every equation of a jaxpr, nested ones (jit, scan, while, cond, custom_jvp) included."""
    import jax.extend

    for e in jaxpr.eqns:
        yield e
        for param in e.params.values():
            for inner in (param if isinstance(param, (tuple, list)) else (param,)):
                inner = getattr(inner, "jaxpr", inner)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from jaxpr_equations(inner)


def count_fp8_dots(equations) -> int:
    """How many of ``equations`` are FP8 x FP8 dots (W8A8 projections)."""
    return sum(e.primitive.name == "dot_general" and all(str(v.aval.dtype) == "float8_e4m3fn" for v in e.invars)
               for e in equations)


def decode_weight_bytes(weights) -> int:
    """Bytes of every weight a decode step reads, at their stored width (fp8 payloads + scales count as
    they are): all leaves but the input embedding, of which a step gathers a row per token. A tied
    lm_head is the embedding itself, read whole, so it stays in."""
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(weights))
    return total - (weights.embed.nbytes if weights.lm_head is not None else 0)


def fits_one_device(config, itemsize: int, fraction: float = 0.6) -> bool:
    """Whether the weights fit in ``fraction`` of device 0's memory (False when it is not reported)."""
    from jaxinfer.memory import weight_bytes

    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return bool(limit) and weight_bytes(config, itemsize) <= fraction * limit


def random_prompts(rng: np.random.Generator, lengths, vocab_size: int) -> list[list[int]]:
    return [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lengths]


def write_results(out_dir: Path, name: str, results: dict, markdown: str, log: Log) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=2, default=float))
    (out_dir / f"{name}.md").write_text(markdown)
    (out_dir / f"{name}.log").write_text("\n".join(log.lines) + "\n")
    log(f"wrote {out_dir / name}.{{json,md,log}}")


def env_flag(name: str, default: str = "") -> str:
    return os.environ.get(name, default)
