"""Device meshes: a ``("dp", "tp")`` grid of devices.

``tp`` (tensor parallelism) splits every layer's heads, FFN columns and vocabulary across its
devices; ``dp`` (data parallelism) holds whole replicas of the model, each serving its own
requests (see ``docs/SHARDING.md``). The devices of one ``tp`` group are adjacent in
``jax.devices()`` order, which on a GPU host or TPU slice keeps them on the fastest links.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

DP = "dp"
TP = "tp"
AXES = (DP, TP)


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A ``[dp, tp]`` mesh over the first ``dp * tp`` of ``devices`` (default: every device of every process)."""
    if tensor_parallel_size < 1 or data_parallel_size < 1:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} and data_parallel_size={data_parallel_size} must be >= 1"
        )
    devices = list(jax.devices() if devices is None else devices)
    needed = tensor_parallel_size * data_parallel_size
    if needed > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} needs "
            f"{needed} devices; {len(devices)} are visible"
        )
    grid = np.array(devices[:needed], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, AXES)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ``[1, tp]`` mesh per data-parallel replica of ``mesh``."""
    return [Mesh(mesh.devices[i : i + 1], mesh.axis_names) for i in range(mesh.shape[DP])]


def tp_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape.get(TP, 1)
