"""The peer: Hugging Face transformers on the same GPU, same shapes, random bf16 weights.

    python3 benchmarks/hf_peer.py --shape llama-3.1-8b --out DIR [--workloads latency,batch]

- ``latency``: one request, 128-token prompt, 256 new tokens, ``generate`` with a static
  cache (greedy): milliseconds per output token.
- ``batch``: ``generate_batch`` (transformers' continuous batching) on 128 requests of
  256 prompt tokens and 256 new tokens: output tokens per second.

Runs in the torch environment (``python3`` on the GPU machine), in its own process, so the
two frameworks never share the GPU's memory. Writes DIR/hf_peer.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import SHAPES  # noqa: E402


def build_model(shape: str, device: str):
    config_dict = dict(SHAPES[shape])
    model_type = config_dict.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **config_dict)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model, config


def latency(model, config, device, prompt_len=128, new_tokens=256, repeats=3) -> dict:
    ids = torch.randint(0, config.vocab_size, (1, prompt_len), device=device)
    gen = transformers.GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
        eos_token_id=None, pad_token_id=0,
    )
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            prefill = model(ids)  # time the prompt alone to take it out of the per-token figure
        _sync(device)
        prefill_s = time.perf_counter() - start
        del prefill
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, generation_config=gen)
        _sync(device)
        total = time.perf_counter() - start
        assert out.shape[1] == prompt_len + new_tokens, out.shape
        times.append((total - prefill_s) / (new_tokens - 1))
    tpot = sorted(times[1:])[len(times[1:]) // 2]
    return {"tpot_ms": tpot * 1e3, "all_tpot_ms": [t * 1e3 for t in times[1:]]}


def generate_batch(model, config, device, num_requests=128, prompt_len=256, new_tokens=256, seed=0) -> dict:
    torch.manual_seed(seed)
    inputs = [torch.randint(0, config.vocab_size, (prompt_len,)).tolist() for _ in range(num_requests)]
    gen = transformers.GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0,
    )
    # No inference_mode here: generate_batch runs its own thread, and tensors made in
    # inference mode cannot be updated in place outside it.
    model.generate_batch(inputs=inputs[:4], generation_config=gen)  # warm-up
    _sync(device)
    start = time.perf_counter()
    results = model.generate_batch(inputs=inputs, generation_config=gen)
    _sync(device)
    elapsed = time.perf_counter() - start
    num_out = sum(len(r.generated_tokens) for r in results.values())
    return {
        "num_requests": num_requests, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "seconds": elapsed, "output_tokens": num_out, "output_tokens_per_s": num_out / elapsed,
    }


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--workloads", default="latency,batch")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = {
        "command": "python3 " + shlex.join(sys.argv), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "shape": args.shape,
    }
    print(json.dumps(info), flush=True)
    model, config = build_model(args.shape, device)
    results = {"info": info}
    workloads = args.workloads.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    if "latency" in workloads:
        results["latency"] = latency(model, config, device)
        print("hf latency:", results["latency"], flush=True)
        (args.out / "hf_peer.json").write_text(json.dumps(results, indent=2))
    if "batch" in workloads:
        try:
            results["generate_batch"] = generate_batch(model, config, device, num_requests=args.num_requests)
        except Exception as error:  # reported, not hidden: the peer's API moves between releases
            results["generate_batch"] = {"error": f"{type(error).__name__}: {error}"}
        print("hf generate_batch:", results["generate_batch"], flush=True)
    (args.out / "hf_peer.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
