"""Device meshes and the rules mapping the model's logical axis names to mesh axes.

A layer below ``jaxinfer``: it imports from ``jaxinfer`` only the model's declared types
(``config``, ``params``, ``kv_cache``, ``loaded_model``), as ``tests/test_layering.py`` checks.

- ``sharding.mesh``: ``make_mesh(tensor_parallel_size, data_parallel_size)``, axes ``("dp", "tp")``.
- ``sharding.rules``: the logical-axis table, ``weight_shardings``, ``cache_sharding``, and
  ``shard_over_heads`` (attention kernels under ``shard_map``).
- ``sharding.heads``: query/KV head padding for tp sizes that do not divide the head counts.
- ``sharding.placement``: ``shard_model`` (pad + place a loaded model on a mesh).
- ``sharding.collective_matmul``: the ring reduce-scatter matmul (measured by a benchmark, not yet
  used by the model). The per-phase XLA options live beside the runner, in ``jaxinfer.compile_options``.

``docs/SHARDING.md`` explains the choices.
"""
