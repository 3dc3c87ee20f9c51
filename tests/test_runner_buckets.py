"""The CPU step buckets: a 1-row bucket for float32/int8 models, none for bfloat16 (runner.default_buckets)."""

import threading
import types

from jaxinfer.runner import default_buckets


def test_cpu_batch_one_gets_a_one_row_bucket():
    buckets = default_buckets(64, 2048, 8, "cpu")
    assert buckets.num_tokens[:3] == (1, 4, 16) and buckets.num_seqs[:3] == (1, 4, 16)
    assert buckets.pick(1, 1, 1)[:2] == (1, 1)
    assert buckets.pick(2, 2, 1)[:2] == (4, 4)


def test_bfloat16_cpu_buckets_start_at_four_rows():
    # XLA:CPU's 1-row bfloat16 dot was ~4x slower than its 4-row one (cpu_default_model.md).
    buckets = default_buckets(64, 2048, 8, "cpu", one_row_bucket=False)
    assert buckets.num_tokens[0] == 4 and buckets.num_seqs[0] == 4
    assert buckets.pick(1, 1, 1)[:2] == (4, 4)


def test_one_token_budget_keeps_a_single_bucket_either_way():
    for one_row in (True, False):
        buckets = default_buckets(1, 1, 8, "cpu", one_row_bucket=one_row)
        assert buckets.num_tokens == (1,) and buckets.num_seqs == (1,)


def test_accelerator_buckets_ignore_the_one_row_choice():
    assert default_buckets(64, 2048, 8, "gpu") == default_buckets(64, 2048, 8, "gpu", one_row_bucket=False)


def test_warm_up_compiles_the_largest_programs_first(monkeypatch):
    # Compile time grows with a bucket's rows (H200, 8B fp8: 9 s at 256 tokens, 35 s at 8192); queued
    # behind the small ones, the largest started late and set when the compile pool finished.
    from jaxinfer.checkpoint import load_model
    from jaxinfer.runner import ModelRunner
    from tests.conftest import FIXTURES

    runner = ModelRunner(load_model(FIXTURES / "tiny-llama3", "float32"), num_pages=64, page_size=16,
                         max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256)
    order = []
    lowered = types.SimpleNamespace(compile=lambda: None)
    monkeypatch.setattr(runner, "_lower",
                        lambda inputs: order.append(("forward", len(inputs.batch.token_ids))) or lowered)
    monkeypatch.setattr(runner, "_lower_sampler",
                        lambda inputs: order.append(("sampler", len(inputs.batch.logits_indices))) or lowered)
    monkeypatch.setattr(runner, "execute", lambda inputs: None)
    runner.warm_up(use_tqdm=False, num_threads=1)
    forwards = [rows for kind, rows in order if kind == "forward"]
    samplers = [rows for kind, rows in order if kind == "sampler"]
    assert forwards == sorted(forwards, reverse=True) and len(set(forwards)) == len(runner.buckets.all()) > 2
    assert samplers == sorted(samplers, reverse=True) and len(set(samplers)) > 2
    assert order[:len(forwards)] == [("forward", rows) for rows in forwards]  # the samplers are short: last


def test_warm_up_lowers_in_the_calling_thread_and_compiles_in_the_pool(monkeypatch):
    # Lowering holds the GIL: done in the pool, the largest program's lowering took turns with
    # every other thread's before its compilation could start.
    from jaxinfer.checkpoint import load_model
    from jaxinfer.runner import ModelRunner
    from tests.conftest import FIXTURES

    runner = ModelRunner(load_model(FIXTURES / "tiny-llama3", "float32"), num_pages=64, page_size=16,
                         max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256)
    lowering_threads, compiling_threads = set(), set()

    def lower(inputs):
        lowering_threads.add(threading.get_ident())
        return types.SimpleNamespace(compile=lambda: compiling_threads.add(threading.get_ident()))

    monkeypatch.setattr(runner, "_lower", lower)
    monkeypatch.setattr(runner, "_lower_sampler", lower)
    monkeypatch.setattr(runner, "execute", lambda inputs: None)
    runner.warm_up(use_tqdm=False, num_threads=2)
    assert lowering_threads == {threading.get_ident()}
    assert compiling_threads and threading.get_ident() not in compiling_threads
    times = runner.warmup_compile_times
    assert len(times.programs) == runner.num_programs
    largest = max(runner.buckets.all())
    assert times.programs[0].name == "forward {}x{}x{}".format(*largest)
    assert sum(1 for p in times.programs if p.name.startswith("sampler ")) == runner.num_programs - len(
        runner.buckets.all())
    assert times.lowering_seconds == sum(p.lowering_seconds for p in times.programs)



def test_warm_up_compiles_the_shared_kernels_before_the_steps_need_them(monkeypatch):
    # The fresh-prefill windows that several large steps compile (jaxinfer.attention.shared_kernel_programs):
    # compiled early, each step finds them in jaxlib's kernel cache instead of compiling them in turn.
    import jaxinfer.runner
    from jaxinfer.checkpoint import load_model
    from jaxinfer.runner import ModelRunner
    from tests.conftest import FIXTURES

    runner = ModelRunner(load_model(FIXTURES / "tiny-llama3", "float32"), num_pages=64, page_size=16,
                         max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256)
    order, asked = [], []
    lowered = types.SimpleNamespace(compile=lambda: None)

    def kernels(impl, config, step_shapes):
        asked.append(sorted(step_shapes, reverse=True))
        return [(f"kernel {n}", lambda n=n: order.append(f"kernel {n}") or lowered) for n in (2, 1)]

    monkeypatch.setattr(jaxinfer.runner, "shared_kernel_programs", kernels)
    monkeypatch.setattr(runner, "_lower", lambda inputs: order.append("forward") or lowered)
    monkeypatch.setattr(runner, "_lower_sampler", lambda inputs: order.append("sampler") or lowered)
    monkeypatch.setattr(runner, "execute", lambda inputs: None)
    runner.warm_up(use_tqdm=False, num_threads=2)
    assert asked == [sorted(((t, b) for t, b, _ in runner.buckets.all()), reverse=True)]
    # The largest step first (it compiles longest, and needs its kernels only near its end), then the kernels.
    assert order[:4] == ["forward", "kernel 2", "kernel 1", "forward"]
    times = runner.warmup_compile_times
    assert [p.name for p in times.programs[1:3]] == ["kernel 2", "kernel 1"]
    assert times.programs[0].name == "forward {}x{}x{}".format(*max(runner.buckets.all()))
    assert times.kernel_seconds == sum(p.lowering_seconds + p.compile_seconds for p in times.programs[1:3])


def test_a_shared_kernel_that_fails_only_costs_its_head_start(monkeypatch, caplog):
    # The steps compile their kernels themselves: a shared kernel that cannot be lowered or compiled
    # must not stop the engine from starting.
    import jaxinfer.runner
    from jaxinfer.checkpoint import load_model
    from jaxinfer.runner import ModelRunner
    from tests.conftest import FIXTURES

    runner = ModelRunner(load_model(FIXTURES / "tiny-llama3", "float32"), num_pages=64, page_size=16,
                         max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256)

    def cannot_lower():
        raise RuntimeError("no Mosaic GPU here")

    def cannot_compile():
        return types.SimpleNamespace(compile=lambda: (_ for _ in ()).throw(RuntimeError("ptxas failed")))

    monkeypatch.setattr(jaxinfer.runner, "shared_kernel_programs", lambda *args: [
        ("kernel fresh-prefill window 1x2048", cannot_lower), ("kernel fresh-prefill window 1x1024", cannot_compile)])
    monkeypatch.setattr(runner, "execute", lambda inputs: None)
    with caplog.at_level("WARNING", logger="jaxinfer.runner"):
        runner.warm_up(use_tqdm=False, num_threads=2)
    assert runner.warmup_done and runner.forward_compilations.num_after_warmup == 0
    assert "window 1x2048 did not lower (no Mosaic GPU here)" in caplog.text
    assert "window 1x1024 did not compile (ptxas failed)" in caplog.text
