"""One set of engine defaults, one factory: LLM, the server's flags, the CLI and Engine agree."""

import argparse
import dataclasses
import inspect

import pytest

from jaxinfer import LLM, cli, memory
from jaxinfer.checkpoint import load_model
from jaxinfer.engine import Engine
from jaxinfer.engine_args import ENGINE_FLAGS, engine_options_from_args
from jaxinfer.engine_config import PLATFORM_DEFAULTS, EngineConfig, EngineConfigError
from jaxinfer.engine_factory import build_engine
from jaxinfer.server import serve

from .conftest import FIXTURES

TINY = FIXTURES / "tiny-llama3"


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY, dtype="float32")


def serve_args(*flags):
    parser = argparse.ArgumentParser()
    serve.add_serve_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.mark.parametrize("platform,seqs,tokens", [("cpu", 16, 256), ("gpu", 256, 8192), ("tpu", 256, 8192)])
def test_platform_defaults(platform, seqs, tokens):
    config = EngineConfig().for_platform(platform)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (seqs, tokens)
    assert (config.page_size, config.memory_utilization, config.max_wait_s) == (32, 0.9, 0.002)
    assert config.enable_prefix_caching and config.async_scheduling and config.attention_impl == "auto"
    # The model decides these two (resolve), not the platform.
    assert config.max_model_len is None and config.num_pages is None


def test_platform_names():
    assert EngineConfig().for_platform("cuda") == EngineConfig().for_platform("gpu")
    with pytest.raises(ValueError, match="'metal'"):
        EngineConfig().for_platform("metal")


def test_the_batch_and_the_budget_follow_each_other():
    # A default max_num_seqs never exceeds a given budget; a default budget never falls below a given max_num_seqs.
    assert EngineConfig(max_num_batched_tokens=8).for_platform("cpu").max_num_seqs == 8
    assert EngineConfig(max_num_seqs=512).for_platform("cpu").max_num_batched_tokens == 512
    assert EngineConfig(max_num_seqs=512).for_platform("gpu").max_num_batched_tokens == 8192


def test_overrides_win(tiny):
    given = EngineConfig(max_model_len=64, max_num_seqs=3, max_num_batched_tokens=24, page_size=8, num_pages=40,
                         memory_utilization=0.5, enable_prefix_caching=False, max_wait_s=0.25,
                         scheduling_admission="greedy", attention_impl="reference", async_scheduling=False, kv_cache_dtype="fp8")
    for platform in PLATFORM_DEFAULTS:
        assert given.for_platform(platform) == given
        assert given.resolve(tiny, platform=platform) == given


@pytest.mark.parametrize("options,field", [
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
    (dict(page_size=0), "page_size"),
    (dict(num_pages=-1), "num_pages"),
    (dict(max_num_seqs=2.5), "max_num_seqs"),
    (dict(memory_utilization=1.5), "memory_utilization"),
    (dict(max_wait_s=-1.0), "max_wait_s"),
    (dict(attention_impl="flash"), "attention_impl"),
    (dict(scheduling_admission="optimistic"), "scheduling_admission"),
])
def test_validation_names_the_field(options, field):
    with pytest.raises(EngineConfigError, match=field) as error:
        EngineConfig(**options)
    assert error.value.field == field


def test_batch_over_budget_message_names_both():
    with pytest.raises(EngineConfigError, match=r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=4)


def test_resolve_for_a_model(tiny):
    resolved = EngineConfig().resolve(tiny, platform="cpu")
    assert resolved.max_model_len == tiny.config.max_position_embeddings == 1024
    assert resolved == dataclasses.replace(EngineConfig().for_platform("cpu"), max_model_len=1024,
                                           num_pages=resolved.num_pages)
    # The pool is what memory.py sizes for the model (a fixed 1 GiB on a CPU).
    assert resolved.num_pages == memory.num_pages_for_device(
        tiny.config, page_size=32, bytes_per_element=4, memory_utilization=0.9
    )
    with pytest.raises(EngineConfigError, match="exceeds the model's context of 1024") as error:
        EngineConfig(max_model_len=2048).resolve(tiny)
    assert error.value.field == "max_model_len"
    # An explicit pool too small for one max_model_len request is refused, not silently enlarged.
    with pytest.raises(EngineConfigError, match="needs 5 pages") as error:
        EngineConfig(max_model_len=64, page_size=16, num_pages=4).resolve(tiny)
    assert error.value.field == "num_pages"


def test_a_measured_pool_holds_at_least_one_request(tiny, monkeypatch):
    monkeypatch.setattr("jaxinfer.engine_config.num_pages_for_device", lambda *args, **kwargs: 2)
    assert EngineConfig(max_model_len=1024, page_size=32).resolve(tiny).num_pages == 1024 // 32 + 1


def test_every_engine_flag_defaults_to_none_and_sets_its_field():
    assert ENGINE_FLAGS == tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "overlap")
    assert all(value is None for value in engine_options_from_args(serve_args()).values())
    args = serve_args("--max-model-len", "64", "--max-num-seqs", "3", "--max-num-batched-tokens", "24",
                      "--page-size", "8", "--num-pages", "40", "--memory-utilization", "0.5",
                      "--no-enable-prefix-caching", "--max-wait-s", "0.25", "--attention-impl", "reference",
                      "--no-async-scheduling", "--scheduling-admission", "greedy")
    assert serve.engine_config_from_args(args) == EngineConfig(
        max_model_len=64, max_num_seqs=3, max_num_batched_tokens=24, page_size=8, num_pages=40,
        memory_utilization=0.5, enable_prefix_caching=False, max_wait_s=0.25, attention_impl="reference",
        async_scheduling=False, scheduling_admission="greedy")


def test_generate_and_serve_read_the_same_flags():
    flags = ["--max-num-seqs", "4", "--page-size", "16", "--no-async-scheduling"]
    generate_args = cli.build_parser().parse_args(["generate", "--prompt", "hi", *flags])
    assert EngineConfig(**engine_options_from_args(generate_args)) == serve.engine_config_from_args(serve_args(*flags))
    # jaxinfer generate hands the same options to LLM, which takes every one by the field's name.
    assert set(ENGINE_FLAGS) <= set(inspect.signature(LLM).parameters)


def test_server_threads_come_from_the_resolved_batch():
    waiting = serve_args().max_waiting_requests
    assert serve.default_server_threads(serve_args()) == PLATFORM_DEFAULTS["cpu"].max_num_seqs + waiting + 16
    assert serve.default_server_threads(serve_args("--max-num-batched-tokens", "8")) == 8 + waiting + 16


def test_llm_server_factory_and_engine_build_the_same_engine(tiny):
    # num_pages is given so that four engines do not each allocate the CPU's 1 GiB default pool.
    llm = LLM(loaded=tiny, max_model_len=64, num_pages=24, warm_up=False, use_tqdm=False)
    served = serve.build_engine(serve_args("--model", str(TINY), "--dtype", "float32", "--max-model-len", "64",
                                           "--num-pages", "24"))
    built = build_engine(tiny, EngineConfig(max_model_len=64, num_pages=24), warm_up=False, use_tqdm=False)
    direct = Engine(tiny, EngineConfig(max_model_len=64, num_pages=24), warm_up=False, use_tqdm=False)
    expected = dataclasses.replace(EngineConfig().for_platform("cpu"), max_model_len=64, num_pages=24)
    assert llm.engine_config == served.config == built.config == direct.config == expected
    assert llm.model is llm.engine.model and llm.tokenizer is llm.engine.tokenizer
