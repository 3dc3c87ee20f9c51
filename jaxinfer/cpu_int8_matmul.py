"""A native weight-only int8 matmul for XLA:CPU, built from ``csrc/int8_matmul_cpu.cc`` on first use.

XLA:CPU has no int8 weight-only dot: ``dot(x, w_int8.astype(f32))`` runs as a loop fusion that
writes the whole weight out in float32 and a float32 dot that reads the copy back, so an int8
weight costs more memory traffic than the float32 one it replaces (measured 2-5x slower than
float32 for SmolLM2-135M's projections, ``benchmarks/cpu_int8_matmul.py``); ``int8 x int8``
dots are widened to int32 the same way, and the YNNPACK library fusion (a compiler option) does
not take single-row dots. This kernel widens one weight row at a time into an L1-resident
buffer, so the weight is read once, as int8, and splits the output rows over XLA's intra-op
thread pool. It is called through the XLA FFI (``jax.ffi.ffi_call``), so it runs inside the
jitted step like any other op.

The shared library is compiled with the system C++ compiler (``-O3 -march=native``) into
``$JAXINFER_CACHE_DIR`` (default ``~/.cache/jaxinfer``), keyed by the source, the flags and the
jaxlib version. :func:`is_available` is False when no compiler is found or the build fails
(the reason is in :func:`unavailable_reason`); callers then keep XLA's path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_matmul_cpu.cc"
TARGET_NAME = "jaxinfer_int8_matmul_cpu"
SYMBOL = "JaxinferInt8MatmulCpu"
# 512-bit vectors where the CPU has them (GCC defaults to 256). Reassociation lets the compiler
# keep several partial sums in the dot. Not -ffast-math: GCC then links crtfastmath.o, which sets
# flush-to-zero / denormals-are-zero in the process's floating-point state when the library
# loads, changing every float computation after it (hypothesis caught it: it refuses to draw
# floats once subnormals read as zero).
COMPILE_FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
                 "-fno-signed-zeros", "-fassociative-math", "-std=c++20", "-shared", "-fPIC")


def cache_dir() -> Path:
    return Path(os.environ.get("JAXINFER_CACHE_DIR", Path.home() / ".cache" / "jaxinfer"))


def _cpu_fingerprint() -> bytes:
    """The CPU's model and feature flags: a library built with -march=native on one CPU may use
    instructions another lacks (a home directory shared between machines), so each gets its own."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(wanted)).encode()  # one of each line: cores repeat them


def _library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(COMPILE_FLAGS).encode() + jax.lib.__version__.encode()
                         + os.uname().machine.encode() + _cpu_fingerprint()).hexdigest()[:16]
    return cache_dir() / f"int8_matmul_cpu-{key}.so"


@functools.cache
def _build_and_register() -> str | None:
    """Compile (once per cache key) and register the FFI target; None on success, else why not
    (logged once: int8 weights then take XLA's slower path)."""
    reason = _build_and_register_once()
    if reason is not None:
        logger.warning("the native int8 CPU matmul is unavailable (%s); int8 weights use XLA's path", reason)
    return reason


def _build_and_register_once() -> str | None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return "no C++ compiler on PATH"
    library = _library_path()
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        # Build to a temporary name and rename: another process may be building the same file.
        with tempfile.NamedTemporaryFile(dir=library.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        command = [compiler, *COMPILE_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            return f"{' '.join(command)} failed: {done.stderr[-2000:]}"
        partial.chmod(0o755)  # the temporary file was private to its creator
        partial.replace(library)
    handler = getattr(ctypes.cdll.LoadLibrary(str(library)), SYMBOL)
    jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(handler), platform="cpu")
    return None


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used here, or None when it can."""
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not cpu"
    return _build_and_register()


def is_available() -> bool:
    return unavailable_reason() is None


def int8_matmul_cpu(x: jax.Array, payload: jax.Array, scale: jax.Array, max_threads: int = 64) -> jax.Array:
    """x [M, K] (any float dtype; computed in float32) times the int8 payload [N, K] with scales
    [N] -> [M, N] float32, on at most ``max_threads`` threads of XLA's intra-op pool. Call only
    where :func:`is_available` is True."""
    if payload.dtype != jnp.int8 or x.ndim != 2 or payload.ndim != 2 or x.shape[1] != payload.shape[1]:
        raise ValueError(f"int8_matmul_cpu: x [M, K] float and payload [N, K] int8 expected, got "
                         f"x {x.shape} {x.dtype}, payload {payload.shape} {payload.dtype}")
    reason = _build_and_register()
    if reason is not None:
        raise RuntimeError(f"int8_matmul_cpu is unavailable: {reason}")
    out = jax.ShapeDtypeStruct((x.shape[0], payload.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET_NAME, out)(x.astype(jnp.float32), payload, scale.astype(jnp.float32),
                                                  max_threads=max_threads)
