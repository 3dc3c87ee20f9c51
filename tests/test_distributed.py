"""Multi-host serving on one machine: two processes over a loopback coordinator, CPU collectives
through gloo, tensor parallelism across the two processes' devices. Greedy tokens must equal
those of one process without sharding.

The test runs this file as a script, once per process (``python tests/test_distributed.py ID PORT OUT``).
"""

import json
import os
import socket
import subprocess
import sys
import pathlib

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9] * 7, [100], list(range(200, 240))]
MAX_TOKENS = 10
FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "tiny-llama3"
LLM_OPTIONS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_pages=32, page_size=16,
                   use_tqdm=False, max_wait_s=0.0, warm_up=False)


def greedy_tokens(llm):
    from jaxinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def worker(process_id: int, port: int, out_path: str) -> None:
    from jaxinfer import distributed

    distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from jaxinfer import LLM
    from jaxinfer.checkpoint import load_model

    llm = LLM(loaded=load_model(FIXTURE, dtype="float32"), tensor_parallel_size=2, **LLM_OPTIONS)
    if not distributed.is_leader():
        distributed.follow(llm.engine)
        return
    distributed.lead(llm.engine)
    tokens = greedy_tokens(llm)
    distributed.stop_followers(llm.engine)
    pathlib.Path(out_path).write_text(json.dumps(tokens))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_the_tokens_of_one(tmp_path):
    from jaxinfer import LLM
    from jaxinfer.checkpoint import load_model

    expected = greedy_tokens(LLM(loaded=load_model(FIXTURE, dtype="float32"), **LLM_OPTIONS))
    port, out = _free_port(), tmp_path / "tokens.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    workers = [
        subprocess.Popen([sys.executable, __file__, str(i), str(port), str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    logs = [w.communicate(timeout=400)[0] for w in workers]
    for w, log in zip(workers, logs):
        assert w.returncode == 0, log[-4000:]
    assert json.loads(out.read_text()) == expected


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
