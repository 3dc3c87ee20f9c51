"""The CPU step buckets: a 1-row bucket for float32/int8 models, none for bfloat16 (runner.default_buckets)."""

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
