"""The real server (``jaxinfer.server``) over an engine with random weights of a named shape.

    python3 benchmarks/serve_random.py --shape llama-3.1-8b --port 8000 [any `jaxinfer serve` flag]

Random weights come with no tokenizer, so the engine gets a synthetic word-level one and
clients send prompts as token ids. Everything else (HTTP, admission, engine loop, metrics)
is the production path. Used by ``serve_benchmark.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import SHAPES, random_model  # noqa: E402

from jaxinfer.engine import Engine  # noqa: E402
from jaxinfer.memory import num_pages_for_device, pages_for  # noqa: E402
from jaxinfer.server.serve import add_serve_arguments, engine_config_from_args, run_server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_serve_arguments(parser)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    args = parser.parse_args()
    args.model = f"random-{args.shape}"

    def engine_factory(args):
        import jax

        model = random_model(args.shape)
        # The shared defaults, but for this benchmark's own: a 4096-token context, a 2048-token
        # budget, and 4 GiB kept back from the pool (as engine_throughput.py).
        config = engine_config_from_args(args).for_platform()
        max_model_len = args.max_model_len or 4096
        num_pages = args.num_pages or num_pages_for_device(
            model.config, page_size=config.page_size, bytes_per_element=model.weights.embed.dtype.itemsize,
            memory_utilization=config.memory_utilization, reserve_bytes=4 << 30,
        )
        if jax.default_backend() == "cpu":
            num_pages = max(num_pages, 4 * pages_for(max_model_len, config.page_size) + 1)
        config = dataclasses.replace(
            config, max_model_len=max_model_len, max_num_batched_tokens=args.max_num_batched_tokens or 2048,
            num_pages=num_pages,
        )
        return Engine(model, config, warm_up=False, use_tqdm=False)

    return run_server(args, engine_factory=engine_factory)


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # as engine_throughput.py: same programs
    sys.exit(main())
