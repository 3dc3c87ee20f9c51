"""build_engine: the one way an engine is built, whoever asks for it.

``LLM`` (offline), ``jaxinfer serve`` (``jaxinfer.server.serve.build_engine``, on every process of
a multi-host run: the leader then attaches ``jaxinfer.distributed.lead``) and data-parallel
replicas all come through here:

1. on one device, an int8 model on XLA:CPU gets an int8 lm_head (``jaxinfer.cpu_int8_lm_head``);
   for ``tp * dp > 1``, lay the model out on a ``[dp, tp]`` mesh, one copy per replica, its
   heads padded for ``tp`` (``sharding.placement.shard_model``);
2. resolve the config once (``EngineConfig.resolve``: platform defaults, ``max_model_len``, the
   page pool sized from the memory the weights left), after every replica's weights are in place
   and before any KV cache is allocated, so every replica gets the same pool;
3. build one ``Engine`` per replica; several go behind a ``DataParallelEngine`` router.
"""

from __future__ import annotations

import logging

from jaxinfer.cpu_int8_lm_head import with_int8_lm_head
from jaxinfer.data_parallel import DataParallelEngine
from jaxinfer.engine import Engine
from jaxinfer.engine_config import EngineConfig
from jaxinfer.kv_cache_dtype import storage_dtype
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.memory import pages_for

logger = logging.getLogger(__name__)


def build_engine(model: LoadedModel, config: EngineConfig | None = None, *, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, warm_up: bool = True,
                 use_tqdm: bool = True) -> Engine | DataParallelEngine:
    """An engine for ``model`` on ``tensor_parallel_size * data_parallel_size`` devices.

    ``config``: what the caller asked for (``None``: every platform default). ``warm_up``:
    compile every step shape now; the server passes ``False`` and calls ``engine.warmup()``
    itself, so ``/health`` can say ``warming`` meanwhile (and so a multi-host leader can
    attach its step channel first).
    """
    config = config or EngineConfig()
    if tensor_parallel_size * data_parallel_size == 1:
        model = with_int8_lm_head(model)  # int8 on XLA:CPU: the lm_head too (jaxinfer.cpu_int8_lm_head)
    meshes, models = [None], [model]
    if tensor_parallel_size * data_parallel_size > 1:
        from sharding.mesh import make_mesh, replica_meshes
        from sharding.placement import shard_model

        meshes = replica_meshes(make_mesh(tensor_parallel_size, data_parallel_size))
        models = [shard_model(model, mesh) for mesh in meshes]
    config = config.resolve(models[0], mesh=meshes[0])
    engines = [Engine(m, config, warm_up=warm_up, use_tqdm=use_tqdm, mesh=mesh) for m, mesh in zip(models, meshes)]
    usable_pages = config.num_pages - 1  # page 0 is scratch
    logger.info(
        "engine ready: %d replica(s), each %d pages x %d tokens = %d tokens of KV cache in %s "
        "(kv_cache_dtype=%s; %d requests of %d tokens at once), up to %d sequences and %d tokens a step; weights %s",
        len(engines), usable_pages, config.page_size, usable_pages * config.page_size,
        storage_dtype(config.kv_cache_dtype, model.weights.embed.dtype).name, config.kv_cache_dtype,
        usable_pages // pages_for(config.max_model_len, config.page_size), config.max_model_len,
        config.max_num_seqs, config.max_num_batched_tokens,
        (f"quantized {config.quantization}" + (" (static activation scales)" if config.activation_scales == "static"
                                               else "")) if config.quantization else f"in {model.weights.embed.dtype}",
    )
    return engines[0] if len(engines) == 1 else DataParallelEngine(engines)
