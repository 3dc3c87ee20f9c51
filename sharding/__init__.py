"""Device meshes and the rules mapping the model's logical axis names to mesh axes.

- ``sharding.mesh``: ``make_mesh(tensor_parallel_size, data_parallel_size)``, axes ``("dp", "tp")``.
- ``sharding.rules``: the logical-axis table, ``weight_shardings``, ``cache_sharding``, and
  ``shard_over_heads`` (attention kernels under ``shard_map``).
- ``sharding.heads``: query/KV head padding for tp sizes that do not divide the head counts.
- ``sharding.placement``: ``shard_model`` (pad + place a loaded model on a mesh).
- ``sharding.overlap``: communication/computation overlap options.

``docs/SHARDING.md`` explains the choices.
"""
