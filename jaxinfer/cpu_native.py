"""Native CPU kernels for XLA:CPU, built from ``jaxinfer/csrc/*.cc`` on first use and called
through the XLA FFI (``jax.ffi.ffi_call``), so they run inside jitted programs like any other op.

One shared library holds every kernel of ``csrc/`` (``KERNELS``: FFI target name -> the C
symbol of its handler). It is compiled with the system C++ compiler (``-O3 -march=native``)
into ``$JAXINFER_CACHE_DIR`` (default ``~/.cache/jaxinfer``), keyed by the sources, the flags,
the jaxlib version and the CPU (model and feature flags), and its targets are registered with
XLA:CPU. :func:`unavailable_reason` says why not when no compiler is found or the build fails;
callers then keep XLA's own path (``jaxinfer.cpu_int8_matmul``, ``jaxinfer.cpu_paged_attention``).
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

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = (SOURCE_DIR / "int8_matmul_cpu.cc", SOURCE_DIR / "paged_attention_cpu.cc")
# FFI target name -> the handler's C symbol.
KERNELS = {
    "jaxinfer_int8_matmul_cpu": "JaxinferInt8MatmulCpu",
    "jaxinfer_paged_attention_cpu": "JaxinferPagedAttentionCpu",
}
# 512-bit vectors where the CPU has them (GCC defaults to 256). Reassociation lets the compiler
# keep several partial sums in a dot. Not -ffast-math: GCC then links crtfastmath.o, which sets
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
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES) + " ".join(COMPILE_FLAGS).encode()
                         + jax.lib.__version__.encode() + os.uname().machine.encode()
                         + _cpu_fingerprint()).hexdigest()[:16]
    return cache_dir() / f"jaxinfer_cpu_kernels-{key}.so"


@functools.cache
def _build_and_register() -> str | None:
    """Compile (once per cache key) and register every FFI target; None on success, else why not
    (logged once: the callers then take XLA's slower paths)."""
    reason = _build_and_register_once()
    if reason is not None:
        logger.warning("the native CPU kernels are unavailable (%s); XLA's paths are used", reason)
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
        command = [compiler, *COMPILE_FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            return f"{' '.join(command)} failed: {done.stderr[-2000:]}"
        partial.chmod(0o755)  # the temporary file was private to its creator
        partial.replace(library)
    handle = ctypes.cdll.LoadLibrary(str(library))
    for target, symbol in KERNELS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, symbol)), platform="cpu")
    return None


def unavailable_reason() -> str | None:
    """Why the native kernels cannot be used here, or None when they can."""
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not cpu"
    return _build_and_register()


def is_available() -> bool:
    return unavailable_reason() is None


def require() -> None:
    """Build and register the kernels, or raise saying why they cannot be."""
    reason = _build_and_register()
    if reason is not None:
        raise RuntimeError(f"the native CPU kernels are unavailable: {reason}")
