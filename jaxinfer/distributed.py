"""Multi-host serving: one engine, every process running the same jitted steps.

Untested on real multi-host hardware; tested on CPU with two processes on one machine
(``tests/test_distributed.py``). The recipe for TPU VMs and GPU nodes is in docs/SHARDING.md.

How a step travels:

1. Every process calls :func:`initialize` (``jax.distributed.initialize``), then builds the
   same ``LLM``/engine with ``tensor_parallel_size`` covering devices of every process: the
   weights and the KV cache are laid out across all of them (``sharding.placement.place``
   builds each process's shards from its own copy of the checkpoint).
2. Process 0 (the *leader*) runs the HTTP server, the scheduler and the page allocator, as on
   one host. :func:`lead` has its runner hand every step's host inputs, before the step runs,
   to a :class:`StepChannel` (``ModelRunner.observe_inputs``), which sends them.
3. The other processes (*followers*) run :func:`follow`: receive a step's inputs, run the
   same jitted step, repeat until the leader sends "stop". Their KV caches and sampled
   tokens stay identical to the leader's because they run the same programs on the same inputs.
4. Sampled tokens come out replicated, so the leader reads them from its own devices.

The channel is ``multihost_utils.broadcast_one_to_all``: a small header (the step's shapes)
and then the arrays, each one collective over every device. That is two small collectives
per step; a host-side channel (e.g. over the coordinator's key-value store) could replace it.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxinfer.input_batch import MAX_BANNED, StepInputs
from jaxinfer.runner import SAMPLER_PATHS, ModelRunner

logger = logging.getLogger(__name__)

_SAMPLER_PATHS = tuple(SAMPLER_PATHS)
_STOP, _STEP = 1, 0  # the header's first value: what the message is


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """``jax.distributed.initialize``; CPU collectives go through gloo (they need one implementation)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    logger.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
                jax.local_device_count(), jax.device_count())


def is_leader() -> bool:
    return jax.process_index() == 0


class StepChannel:
    """Process 0 sends each step's ``StepInputs`` to every other process, which receives them
    into ``runner``'s empty inputs of the same bucket."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def send(self, inputs: StepInputs) -> None:
        if inputs.is_verify:
            # The followers' template has one sampling row per slot and no drafts.
            raise NotImplementedError("speculative decoding does not run across hosts yet: drop speculative_config")
        sampling = inputs.sampling
        header = [_STEP, _SAMPLER_PATHS.index(inputs.sampler_path), inputs.batch.num_tokens, inputs.batch.num_seqs,
                  inputs.batch.page_tables.shape[1], sampling.banned_ids.shape[1]]
        self._broadcast_header(header)
        multihost_utils.broadcast_one_to_all((inputs.batch, inputs.sampling, inputs.prev_rows))

    def stop(self) -> None:
        self._broadcast_header([_STOP] + [0] * 5)

    def receive(self) -> StepInputs | None:
        """The leader's next step, or ``None`` when it has stopped."""
        kind, path, num_tokens, num_seqs, pages, num_banned = self._broadcast_header([0] * 6)
        if kind == _STOP:
            return None
        template = self.runner.empty_inputs(num_tokens, num_seqs, pages, _SAMPLER_PATHS[path])
        if template.sampling.banned_ids.shape[1] != num_banned:
            raise RuntimeError(f"leader sent {num_banned} banned ids per row; this process expects {MAX_BANNED}")
        batch, sampling, prev_rows = multihost_utils.broadcast_one_to_all(
            (template.batch, template.sampling, template.prev_rows)
        )
        return StepInputs(batch, sampling, prev_rows, _SAMPLER_PATHS[path])

    @staticmethod
    def _broadcast_header(values: list[int]) -> list[int]:
        return [int(v) for v in multihost_utils.broadcast_one_to_all(np.asarray(values, np.int32))]


def _runner(engine) -> ModelRunner:
    if hasattr(engine, "engines"):
        raise ValueError("multi-host serving runs one replica (data_parallel_size=1) spread over every process")
    return engine.runner


def lead(engine) -> None:
    """On process 0: send every step of ``engine`` (built with ``warm_up=False``) to the followers."""
    runner = _runner(engine)
    if runner.warmup_done:
        raise RuntimeError("attach the step channel before warm-up: the followers must compile the same steps")
    runner.observe_inputs(StepChannel(runner).send)


def stop_followers(engine) -> None:
    """On process 0: tell the followers to return from :func:`follow` (nothing if :func:`lead` was not called)."""
    runner = _runner(engine)
    if runner.is_observed:
        runner.observe_inputs(None)
        StepChannel(runner).stop()


def follow(engine) -> int:
    """On every other process: run the leader's steps until it stops; returns the number of steps run."""
    runner = _runner(engine)
    channel = StepChannel(runner)
    num_steps = 0
    while (inputs := channel.receive()) is not None:
        runner.execute(inputs)
        num_steps += 1
    jax.block_until_ready(runner.cache)
    logger.info("leader stopped after %d steps", num_steps)
    return num_steps
