"""Mosaic GPU kernels named by their content, so one kernel compiles once per process.

jaxlib compiles a Mosaic GPU kernel when XLA instantiates its custom call and keeps it in a
process-wide cache keyed by the kernel's hash, a SHA-256 of the serialized kernel module
(``jax.experimental.mosaic.gpu.core``). In jax 0.11.2 that module carries an attribute,
``mosaic_gpu.dump_basename``, stamped at lowering from a process-wide counter
(``jaxlib/mosaic/gpu/dump.cc``: ``"<name>_<count>"``), meant only to name dump files. So two
lowerings of the same kernel hash differently, and the cache never hits between programs: the
engine's 2048-, 4096- and 8192-token forward programs each compiled their own copies of the
same fresh-prefill windows (15 compiles of 9 kernels; between ~0.6 and ~5 s each on the H200
by two indirect estimates, ``benchmarks/results/session15_h200.md``), and a warm start's programs
could miss the persistent compilation cache whenever lowering order moved the counter.

``install()`` stamps the attribute first, from the module's own bytes, so the count is never
used: equal kernels get equal names and hashes, different kernels different ones (dumps, when
``MOSAIC_GPU_DUMP_TO`` is set, stay one file per distinct kernel). Idempotent; a no-op where
jaxlib has no Mosaic GPU dialect or no such function.
"""

from __future__ import annotations

import hashlib
import threading

_DUMP_BASENAME = "mosaic_gpu.dump_basename"  # jaxlib/mosaic/gpu/dump.cc's kDumpBasenameAttr
_lock = threading.Lock()


def content_name(module) -> str:
    """``<module name>_<16 hex digits of SHA-256 over the module's bytecode>``."""
    from jax._src.lib.mlir import ir

    operation = module.operation
    digest = hashlib.sha256(operation.get_asm(binary=True)).hexdigest()[:16]
    attributes = operation.attributes
    name = ir.StringAttr(attributes["sym_name"]).value if "sym_name" in attributes else "mosaic_gpu_module"
    return f"{name}_{digest}"


def install() -> bool:
    """Name every Mosaic GPU kernel lowered from now on by its content; True if in effect."""
    try:
        from jax._src.lib import mosaic_gpu_dialect as dialect
    except ImportError:  # a jaxlib without Mosaic GPU: no such kernels to name
        return False
    with _lock:
        original = getattr(dialect, "get_or_set_dump_options", None)
        if original is None:
            return False
        if getattr(original, "_jaxinfer_content_named", False):
            return True

        def get_or_set_dump_options(module):
            from jax._src.lib.mlir import ir

            attributes = module.operation.attributes
            if _DUMP_BASENAME not in attributes:
                attributes[_DUMP_BASENAME] = ir.StringAttr.get(content_name(module), module.context)
            return original(module)

        get_or_set_dump_options._jaxinfer_content_named = True
        dialect.get_or_set_dump_options = get_or_set_dump_options
        return True
