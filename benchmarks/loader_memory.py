"""Host memory and time of loading a Hugging Face checkpoint: ``jaxinfer.checkpoint.load_model``.

Writes a checkpoint of random bf16 weights with a benchmark shape (Llama-3.1-8B by default) the
way Hugging Face shards one (``model-0000i-of-0000n.safetensors`` of at most ``--shard-gb``, an
index, config.json, a word-level tokenizer.json), then, once per ``--tree`` and run, loads it in
a fresh subprocess with ``load_model(dir, dtype="bfloat16")`` and reports:

- ``peak_rss_gib``: the process's peak resident memory (``VmHWM``; ``ru_maxrss`` agrees), which
  counts pages of memory-mapped files as well as the process's own allocations;
- ``peak_anon_gib`` / ``peak_file_gib``: the peaks of those two parts, sampled every few ms
  (a loader that maps the files shows its file pages here; they are reclaimable, its copies not);
- each peak also less the process's memory just before the load (jax and the backend loaded);
- ``load_s``: wall time of ``load_model`` until every weight is on the device.

The loading child imports nothing but ``jaxinfer.checkpoint.load_model``, from the tree ``--tree``
puts first on ``sys.path``, so the same script measures an older checkout for a before/after
comparison. The checkpoint is written by this script alone (HF names and ``[out, in]`` shapes,
the format's own), not by either tree's code.

    python3 benchmarks/loader_memory.py --out /tmp/lm --tree . --tree /path/to/old/checkout
    python3 benchmarks/loader_memory.py --out /tmp/lm --shape tiny          # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
RESULT_PREFIX = "LOADER_MEMORY_RESULT "


def hf_llama_tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a Llama checkpoint, in Hugging Face's order and ``[out, in]`` shapes."""
    e, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config.get("head_dim", e // config["num_attention_heads"])
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    tensors = [("model.embed_tokens.weight", (v, e))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors += [
            (p + "input_layernorm.weight", (e,)),
            (p + "self_attn.q_proj.weight", (q, e)),
            (p + "self_attn.k_proj.weight", (kv, e)),
            (p + "self_attn.v_proj.weight", (kv, e)),
            (p + "self_attn.o_proj.weight", (e, q)),
            (p + "post_attention_layernorm.weight", (e,)),
            (p + "mlp.gate_proj.weight", (f, e)),
            (p + "mlp.up_proj.weight", (f, e)),
            (p + "mlp.down_proj.weight", (e, f)),
        ]
    tensors.append(("model.norm.weight", (e,)))
    if not config.get("tie_word_embeddings", False):
        tensors.append(("lm_head.weight", (v, e)))
    return tensors


def write_random_bf16(f, rng, num_elements: int, chunk: int = 1 << 25) -> None:
    """Little-endian bf16 values of random sign and mantissa, magnitudes in [2^-7, 2^-5): finite,
    cheap to make, written a chunk at a time."""

    for start in range(0, num_elements, chunk):
        bits = rng.integers(0, 1 << 16, size=min(chunk, num_elements - start), dtype="<u2")
        bits &= 0x80FF  # sign, the exponent's lowest bit, the mantissa
        bits |= 0x3C00  # exponent 120 or 121
        f.write(bits)


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], rng) -> None:
    """One bf16 safetensors file, written a tensor at a time (8-byte length, JSON header, raw data)."""
    header, offset = {}, 0
    for name, shape in tensors:
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for _, shape in tensors:
            write_random_bf16(f, rng, math.prod(shape))


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the whole vocabulary (token ``i`` is ``t{i}``): what the loader asks for."""
    import tokenizers

    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    raw.save(str(out / "tokenizer.json"))


def write_checkpoint(out: Path, config: dict, shard_bytes: int, seed: int = 0) -> int:
    """A Hugging Face-style sharded bf16 checkpoint of random weights in ``out``; returns its weight bytes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    shards, current, current_bytes = [], [], 0
    for name, shape in hf_llama_tensors(config):
        size = 2 * math.prod(shape)
        if current and current_bytes + size > shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append((name, shape))
        current_bytes += size
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / file, shard, rng)
        for name, shape in shard:
            weight_map[name] = file
            total += 2 * math.prod(shape)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=2))
    write_tokenizer(out, config["vocab_size"])
    return total


def memory_kib() -> dict[str, int]:
    """This process's current and peak memory from /proc/self/status, in KiB."""
    wanted = {"VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"}
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in wanted:
                values[key] = int(rest.split()[0])
    return values


class PeakSampler:
    """Samples RssAnon and RssFile in a thread: the kernel keeps a peak of their sum only (VmHWM)."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        now = memory_kib()
        for key in self.peak:
            self.peak[key] = max(self.peak[key], now.get(key, 0))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


def load_and_measure(checkpoint: Path, tree: Path, dtype: str) -> dict:
    """The child: load ``checkpoint`` with ``tree``'s ``load_model`` and measure it (run in a fresh process)."""
    sys.path.insert(0, str(tree))
    import jax

    import jaxinfer
    from jaxinfer.checkpoint import load_model

    device = jax.devices()[0]  # the backend starts here, not inside the timed load
    before = memory_kib()
    with PeakSampler() as sampler:
        start = time.perf_counter()
        model = load_model(checkpoint, dtype=dtype)
        leaves = jax.tree.leaves(model.weights)
        jax.block_until_ready(leaves)
        load_s = time.perf_counter() - start
    after = memory_kib()
    maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "tree": str(tree),
        "jaxinfer_file": jaxinfer.__file__,
        "device": getattr(device, "device_kind", str(device)),
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "dtype": dtype,
        "weight_dtypes": sorted({str(x.dtype) for x in leaves}),
        "weight_gib": sum(x.nbytes for x in leaves) / GIB,
        "load_s": load_s,
        "peak_rss_gib": after["VmHWM"] / 2**20,
        "ru_maxrss_gib": maxrss_kib / 2**20,
        "peak_anon_gib": sampler.peak["RssAnon"] / 2**20,
        "peak_file_gib": sampler.peak["RssFile"] / 2**20,
        "rss_before_load_gib": before["VmRSS"] / 2**20,
        "anon_before_load_gib": before.get("RssAnon", 0) / 2**20,
        "peak_rss_over_before_gib": (after["VmHWM"] - before["VmRSS"]) / 2**20,
        "peak_anon_over_before_gib": (sampler.peak["RssAnon"] - before.get("RssAnon", 0)) / 2**20,
        "rss_after_load_gib": after["VmRSS"] / 2**20,
    }


def run_child(checkpoint: Path, tree: Path, dtype: str, timeout_s: float) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--load", str(checkpoint), "--tree", str(tree),
               "--dtype", dtype]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"loading with tree {tree} failed (exit {done.returncode}):\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def summary_line(shape: str, run: dict) -> str:
    return (f"{shape} {run['dtype']} tree={run['tree']}: load {run['load_s']:.1f} s, "
            f"peak RSS {run['peak_rss_gib']:.2f} GiB (+{run['peak_rss_over_before_gib']:.2f} over the "
            f"{run['rss_before_load_gib']:.2f} GiB before loading), peak anon {run['peak_anon_gib']:.2f} GiB, "
            f"peak file-backed {run['peak_file_gib']:.2f} GiB; weights {run['weight_gib']:.2f} GiB "
            f"{'/'.join(run['weight_dtypes'])} on {run['device']}")


def markdown(results: dict) -> str:
    rows = ["| tree | run | load s | peak RSS GiB | over pre-load GiB | peak anon GiB | peak file GiB |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for run in results["runs"]:
        rows.append(f"| `{run['tree']}` | {run['run']} | {run['load_s']:.1f} | {run['peak_rss_gib']:.2f} | "
                    f"{run['peak_rss_over_before_gib']:.2f} | {run['peak_anon_gib']:.2f} | {run['peak_file_gib']:.2f} |")
    return (f"# Loader host memory: {results['shape']} ({results['num_layers']} layers), "
            f"{results['checkpoint_gib']:.2f} GiB of bf16 weights "
            f"in {results['num_files']} files\n\n`{results['command']}`\n\n" + "\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", help="a Llama shape of benchmarks/model_shapes.py")
    parser.add_argument("--num-layers", type=int, help="fewer layers than the shape has (a quicker run)")
    parser.add_argument("--tree", type=Path, action="append",
                        help="a checkout whose jaxinfer loads the checkpoint (repeatable; default: this one)")
    parser.add_argument("--runs", type=int, default=1, help="fresh processes per tree")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, help="where loader_memory.{json,md,log} go")
    parser.add_argument("--checkpoint", type=Path,
                        help="write the checkpoint here and keep it (reused if it has an index); default: a temp dir")
    parser.add_argument("--shard-gb", type=float, default=5.0, help="largest file, like HF's 5 GB shards")
    parser.add_argument("--timeout-s", type=float, default=540.0, help="per loading process")
    parser.add_argument("--load", type=Path, help=argparse.SUPPRESS)  # the child's mode
    args = parser.parse_args()

    if args.load is not None:
        print(RESULT_PREFIX + json.dumps(load_and_measure(args.load, args.tree[0], args.dtype)), flush=True)
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from model_shapes import SHAPES

    if SHAPES[args.shape]["model_type"] != "llama":
        parser.error(f"--shape {args.shape}: the checkpoint writer knows Llama's tensors only")
    config = dict(SHAPES[args.shape])
    if args.num_layers is not None:
        config["num_hidden_layers"] = args.num_layers
    trees = [tree.resolve() for tree in (args.tree or [ROOT])]
    lines = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory(prefix="loader-memory-") as tmp:
        checkpoint = args.checkpoint or Path(tmp) / "checkpoint"
        start = time.perf_counter()
        if (checkpoint / "model.safetensors.index.json").exists():
            index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
            total = index["metadata"]["total_size"]
            log(f"reusing the checkpoint in {checkpoint}")
        else:
            total = write_checkpoint(checkpoint, config, int(args.shard_gb * 1e9))
            log(f"wrote {total / GIB:.2f} GiB of random bf16 weights ({args.shape}) to {checkpoint} "
                f"in {time.perf_counter() - start:.1f} s")
        num_files = len(list(checkpoint.glob("*.safetensors")))
        runs = []
        for tree in trees:
            for run in range(args.runs):
                result = {**run_child(checkpoint, tree, args.dtype, args.timeout_s), "run": run}
                runs.append(result)
                log(summary_line(args.shape, result))
    results = {"command": "python3 " + " ".join(sys.argv), "shape": args.shape,
               "num_layers": config["num_hidden_layers"], "checkpoint_gib": total / GIB,
               "num_files": num_files, "runs": runs}
    print(json.dumps(results), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "loader_memory.json").write_text(json.dumps(results, indent=2))
        (args.out / "loader_memory.md").write_text(markdown(results))
        (args.out / "loader_memory.log").write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out / 'loader_memory'}.{{json,md,log}}", flush=True)


if __name__ == "__main__":
    main()
