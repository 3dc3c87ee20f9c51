"""The ``jaxinfer`` command line: generate, fetch, serve, serve-ray, estimate, convert, models."""

from __future__ import annotations

import argparse
import sys

from jaxinfer.engine_args import add_engine_arguments, engine_options_from_args
from jaxinfer.engine_config import PLATFORM_DEFAULTS
from jaxinfer.quantization import QUANTIZATIONS


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="built-in name, Hugging Face directory or .gguf file")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0, help="seeds the samples of prompts (default 0)")
    add_engine_arguments(p)


def _generate(args: argparse.Namespace) -> int:
    from jaxinfer import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
              data_parallel_size=args.data_parallel_size, **engine_options_from_args(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, stop=args.stop or None, seed=args.sample_seed,
    )
    prompts = args.prompt or [sys.stdin.read()]
    if args.chat:
        conversations = []
        for prompt in prompts:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            conversations.append(messages + [{"role": "user", "content": prompt}])
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        print(out.outputs[0].text if args.chat else (out.prompt or "") + out.outputs[0].text)
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from jaxinfer.model_registry import resolve_model

    print(resolve_model(args.model))
    return 0


def _estimate(args: argparse.Namespace) -> int:
    """KV-cache arithmetic for a model, from its config alone (no weights loaded)."""
    import dataclasses
    import json
    from pathlib import Path

    from jaxinfer.config import ModelConfig
    from jaxinfer.memory import estimate
    from jaxinfer.model_registry import resolve_model

    path = resolve_model(args.model)
    if path.suffix == ".gguf":
        from jaxinfer.gguf_loader import read_gguf

        hf = read_gguf(path).config
    else:
        hf = json.loads((Path(path) / "config.json").read_text())
    config = ModelConfig.from_hf(hf)
    if args.quantization is not None:
        # As loading would: a dense checkpoint quantized at load, or a quantized one in its own.
        from jaxinfer.quantization import QuantizationError

        if config.quantization not in (None, args.quantization):
            raise QuantizationError(f"{path} holds {config.quantization} weights; estimate it with "
                                    f"--quantization {config.quantization} or without the flag")
        config = dataclasses.replace(config, quantization=args.quantization)
    weight_bytes = {"float32": 4, "bfloat16": 2}[args.dtype]
    # "auto": the serving dtype's; the old --kv-dtype's names stay accepted.
    kv_bytes = {"auto": weight_bytes, "fp8": 1, "fp8_e4m3": 1, "float8": 1, "bfloat16": 2, "float32": 4}
    result = estimate(
        config, bytes_per_element=weight_bytes, memory_bytes=int(args.memory_gib * 2**30),
        request_len=args.request_len, memory_utilization=args.memory_utilization,
        kv_bytes_per_element=kv_bytes[args.kv_cache_dtype],
    )
    print(result)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from jaxinfer.checkpoint import load_model
    from jaxinfer.orbax_checkpoint import check_output_dir, save

    check_output_dir(args.output)  # before the load, which may take minutes
    if args.calibration_file and args.quantization != "fp8":
        raise SystemExit("--calibration-file calibrates static FP8 activation scales: it needs --quantization fp8")
    dtype = {"bf16": "bfloat16", "f32": "float32"}.get(args.dtype, args.dtype)
    # Quantized here, once: the checkpoint stores the payloads and scales, and restoring it skips quantizing.
    model = load_model(args.model, dtype, quantization=args.quantization)
    if args.calibration_file:
        from jaxinfer.activation_calibration import calibrate_activation_scales
        from jaxinfer.activation_scales import with_static_input_scales

        # Samples are the file's paragraphs (separated by blank lines); the scales are saved with the weights.
        texts = [t.strip() for t in Path(args.calibration_file).read_text().split("\n\n") if t.strip()]
        samples = [model.tokenizer.encode(t)[:model.config.max_position_embeddings] for t in texts]
        model = with_static_input_scales(model, calibrate_activation_scales(model, samples))
    print(save(model, args.output))
    return 0


def _models(args: argparse.Namespace) -> int:
    from jaxinfer.model_registry import builtin_models

    for name, description in builtin_models().items():
        print(f"{name}\t{description}")
    return 0


def _missing_server_dependency(error: ImportError) -> int:
    # flask, waitress and prometheus-client are core dependencies: missing one means a broken install.
    print(f"jaxinfer serve cannot import its server dependencies ({error}); "
          "reinstall jaxinfer (pip install --force-reinstall jaxinfer, or `pip install .` in the clone)", file=sys.stderr)
    return 2


def _missing_ray_dependency(error: ImportError) -> int:
    print(f"jaxinfer serve-ray needs the ray extra ({error}): pip install 'jaxinfer[ray]'", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="JAX inference engine for Llama-family models")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_model_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch); default: stdin")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default here)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--stop", action="append")
    g.add_argument("--sample-seed", type=int, default=None)
    g.set_defaults(func=_generate)

    f = sub.add_parser("fetch", help="download a built-in model into the cache and print its path")
    f.add_argument("--model", default="smollm2-135m-instruct")
    f.set_defaults(func=_fetch)

    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (same as python server.py)")
    try:  # flask and waitress are needed only here
        from jaxinfer.server.serve import add_serve_arguments, run_server

        add_serve_arguments(s)
        s.set_defaults(func=run_server)
    except ImportError as e:
        s.set_defaults(func=lambda args, e=e: _missing_server_dependency(e))

    r = sub.add_parser("serve-ray", help="serve through Ray Serve: autoscaled engine replicas, prefix-aware routing")
    try:  # ray[serve] and a2wsgi are needed only here
        from jaxinfer.ray_serve.serve_ray import add_serve_ray_arguments, run_serve_ray

        add_serve_ray_arguments(r)
        r.set_defaults(func=run_serve_ray)
    except ImportError as e:
        r.set_defaults(func=lambda args, e=e: _missing_ray_dependency(e))

    e = sub.add_parser("estimate", help="how many tokens / requests fit in the KV cache of a device")
    e.add_argument("--model", default="smollm2-135m-instruct", help="built-in name, HF directory (config.json) or .gguf")
    e.add_argument("--memory-gib", type=float, default=141.0, help="device memory (H200: 141)")
    e.add_argument("--memory-utilization", type=float, default=PLATFORM_DEFAULTS["gpu"].memory_utilization,
                   help="fraction of the device for weights + KV cache (default: the engine's on an accelerator)")
    e.add_argument("--request-len", type=int, default=2048, help="tokens per request (prompt + output)")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the serving dtype: the weights' and an auto KV cache's (default bfloat16)")
    e.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_cache_dtype", default="auto",
                   choices=["auto", "fp8", "fp8_e4m3", "bfloat16", "float32", "float8"],
                   help="KV page storage, as serve's --kv-cache-dtype: auto (the serving dtype) or fp8 "
                        "(1 byte); --kv-dtype is the old name, and float32/bfloat16/float8 its old values")
    e.add_argument("--quantization", default=None, choices=sorted(QUANTIZATIONS),
                   help="count the projections quantized, as serve's --quantization: 1-byte payloads plus "
                        "float32 per-channel scales (embedding, norms and lm_head stay in --dtype); default: "
                        "as the checkpoint stores them")
    e.set_defaults(func=_estimate)

    c = sub.add_parser("convert", help="convert a model once into an Orbax checkpoint (fast, sharded loading)")
    c.add_argument("--model", default="smollm2-135m-instruct", help="built-in name, Hugging Face directory or .gguf file")
    c.add_argument("--output", required=True, help="the checkpoint directory to write (must not exist or be empty)")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "f32", "bf16"],
                   help="dtype of the stored weights (float32, the default, keeps dequantized GGUF values exactly)")
    c.add_argument("--quantization", default=None, choices=sorted(QUANTIZATIONS),
                   help="store the projections quantized (fp8 e4m3 or int8, per-channel scales), as "
                        "serve --quantization would quantize them at load; embedding, norms and lm_head "
                        "stay in --dtype. Default: as the source stores them")
    c.add_argument("--calibration-file", default=None, metavar="TEXT",
                   help="with --quantization fp8: calibrate static activation scales on this text file's "
                        "paragraphs and store them (serve then runs W8A8 with them; docs/QUANTIZATION.md)")
    c.set_defaults(func=_convert)

    m = sub.add_parser("models", help="list the built-in model names")
    m.set_defaults(func=_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
