"""Structured output (jaxinfer.structured_output): the device bitmask against llguidance's own
application, grammar checks and the compile cache, and the engine's constrained outputs on the
tiny fixture and on the default model, at temperature 1.0.
"""

import json
import re

import jax.numpy as jnp
import jsonschema
import llguidance
import llguidance.numpy as llguidance_numpy
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.checkpoint import load_model
from jaxinfer.errors import RequestError
from jaxinfer.sampling_params import StructuredOutputsParams
from jaxinfer.structured_output import (
    GrammarCompiler, allocate_bitmask, apply_token_bitmask, check_grammar, guidance_tokenizer,
)

from .conftest import FIXTURES

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                           "price": {"type": "number", "minimum": 0, "maximum": 100}},
            "required": ["sku", "price"], "additionalProperties": False}},
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
    "additionalProperties": False,
}
SCHEMAS = [PERSON, ORDER, {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
                           "required": ["answer"], "additionalProperties": False}]


@pytest.fixture(scope="module")
def tiny():
    return load_model(FIXTURES / "tiny-llama3", dtype="float32")


@pytest.fixture(scope="module")
def tiny_llm(tiny):
    with LLM(loaded=tiny, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_pages=96,
             page_size=16, use_tqdm=False, max_wait_s=0.0) as llm:
        yield llm


@pytest.fixture(scope="module")
def default_llm(default_model):
    # 64 sequences (the step budget): the 204 samples below decode 64 at a time, in a third of the
    # steps that 16 took (a CPU decode step reads every weight once, so its cost grows little with rows).
    with LLM(loaded=default_model, max_model_len=256, max_num_seqs=64, max_num_batched_tokens=64,
             use_tqdm=False, max_wait_s=0.0) as llm:
        yield llm


def constrained(temperature=1.0, max_tokens=48, **constraint):
    return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


def texts(outputs):
    return [o.outputs[0].text for o in outputs]


@pytest.mark.parametrize("vocab_size", [64, 100, 512, 1000])
def test_device_bitmask_equals_llguidance_reference(vocab_size):
    rng = np.random.default_rng(vocab_size)
    bitmask = rng.integers(-2**31, 2**31, size=(5, (vocab_size + 31) // 32), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1  # every id allowed
    bitmask[1] = 0  # none
    logits = rng.standard_normal((5, vocab_size)).astype(np.float32)
    reference = logits.copy()
    llguidance_numpy.apply_token_bitmask_inplace(reference, bitmask)
    device = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(np.isinf(device), np.isinf(reference))
    np.testing.assert_array_equal(device, reference)
    assert not np.isinf(device[0]).any() and np.isinf(device[1]).all()


def test_device_bitmask_of_a_real_grammar(tiny):
    """A matcher's mask, applied on the device, keeps exactly the tokens the matcher accepts."""
    tokenizer = guidance_tokenizer(tiny.tokenizer, tiny.config.vocab_size, tiny.tokenizer.eos_token_ids)
    matcher = llguidance.LLMatcher(tokenizer, check_grammar(StructuredOutputsParams(regex=r"(cat|dog)s? [0-9]+")))
    bitmask = allocate_bitmask(1, tiny.config.vocab_size)
    llguidance_numpy.fill_next_token_bitmask(matcher, bitmask)
    logits = np.zeros((1, tiny.config.vocab_size), np.float32)
    allowed = np.flatnonzero(np.isfinite(np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))[0]))
    accepted = [t for t in range(tiny.config.vocab_size) if matcher.validate_tokens([t]) == 1]
    assert allowed.tolist() == accepted
    assert {tiny.tokenizer.decode([t]) for t in allowed} <= {"c", "ca", "cat", "d", "do", "dog"}


def test_unsupported_schema_keyword_names_it():
    with pytest.raises(RequestError) as error:
        check_grammar(StructuredOutputsParams(json={"type": "object", "if": {"required": ["a"]}, "then": {}}))
    assert "'if'" in str(error.value) and error.value.field == "structured_outputs.json"
    with pytest.raises(RequestError, match="not valid JSON"):
        check_grammar(StructuredOutputsParams(json="{not json"))
    with pytest.raises(RequestError) as error:
        check_grammar(StructuredOutputsParams(grammar="start: missing_rule"))
    assert error.value.field == "structured_outputs.grammar"


def test_engine_refuses_an_unsupported_schema(tiny_llm):
    with pytest.raises(RequestError, match="'unevaluatedProperties'"):
        tiny_llm.engine.add_request("bad-schema", [1, 2], constrained(json={"type": "object", "unevaluatedProperties": False}))
    assert not tiny_llm.engine.has_unfinished_requests()
    with pytest.raises(RequestError) as error:
        tiny_llm.engine.validate([1, 2], SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+")))
    assert error.value.field == "min_tokens"


def test_grammar_cache_is_keyed_by_the_constraint(tiny):
    compiler = GrammarCompiler(lambda: guidance_tokenizer(tiny.tokenizer, tiny.config.vocab_size, [511]))
    first = compiler.submit(StructuredOutputsParams(json={"type": "object", "required": ["a"], "properties": {"a": {}}}))
    again = compiler.submit(StructuredOutputsParams(json='{"properties": {"a": {}}, "required": ["a"], "type": "object"}'))
    other = compiler.submit(StructuredOutputsParams(regex="a+"))
    assert again is first and other is not first
    assert (compiler.num_compiled, compiler.num_cache_hits) == (2, 1)
    assert first.result(timeout=30).is_error() is False
    compiler.shutdown()


def test_regex_and_choice_hold_at_temperature_one(tiny_llm):
    prompts = [[5 + i, 17, 42] for i in range(6)]
    outputs = tiny_llm.generate(prompts, constrained(regex=r"[a-z]{2,6}( [a-z]{2,6}){0,2}\."), use_tqdm=False)
    for output in outputs:
        assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){0,2}\.", output.outputs[0].text), output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop"
        assert output.outputs[0].token_ids[-1] in tiny_llm.engine.eos_ids  # the grammar ended it with EOS
    choices = ["alpha", "beta", "gamma delta"]
    outputs = tiny_llm.generate(prompts, constrained(choice=choices), use_tqdm=False)
    assert all(text in choices for text in texts(outputs))
    assert tiny_llm.engine.stats()["num_compilations_after_warmup"] == 0


def test_lark_grammar_and_json_object(tiny_llm):
    grammar = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    for text in texts(tiny_llm.generate([[3, 4, 5]] * 3, constrained(grammar=grammar, max_tokens=40), use_tqdm=False)):
        assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", text), text
    outputs = tiny_llm.generate([[7, 8]] * 3, constrained(json_object=True, max_tokens=64), use_tqdm=False)
    for output in outputs:
        assert "\n" not in output.outputs[0].text  # json.dumps's layout, no free whitespace to ramble in
        if output.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(output.outputs[0].text), dict)
        else:  # cut by max_tokens: a prefix of an object
            assert output.outputs[0].finish_reason == "length" and output.outputs[0].text.startswith("{")


def test_max_tokens_cuts_with_length_and_partial_text(tiny_llm):
    [output] = tiny_llm.generate([[1, 2, 3]], constrained(regex=r"[a-z]{20,30}", max_tokens=3), use_tqdm=False)
    assert output.outputs[0].finish_reason == "length"
    assert len(output.outputs[0].token_ids) == 3 and re.fullmatch(r"[a-z]+", output.outputs[0].text)


def test_a_complete_grammar_ends_the_sample_even_under_ignore_eos(tiny_llm):
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    for output in tiny_llm.generate([[9, 9]] * 3, params, use_tqdm=False):
        assert output.outputs[0].text in ("yes", "no") and output.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("path", ["basic", "full"])
def test_the_sampler_leaves_all_ones_rows_bit_for_bit(path):
    """Same logits, with and without a bitmask whose first rows allow everything: those rows'
    tokens and logprobs are identical to the bit; the constrained row samples only allowed ids."""
    from jaxinfer.runner import SAMPLER_PATHS
    from jaxinfer.sampling import SamplingTensors, sample

    rng = np.random.default_rng(0)
    vocab_size, num_rows = 300, 4
    logits = jnp.asarray(rng.standard_normal((num_rows, vocab_size)).astype(np.float32) * 3)
    tensors = SamplingTensors.neutral(num_rows, 0, 2, 2, (2, 3))
    tensors.temperature[:] = [0.0, 1.0, 0.8, 1.0]
    tensors.seed[:] = [1, 2, 3, 4]
    tensors.top_p[:] = 0.95
    bitmask = allocate_bitmask(num_rows, vocab_size)
    bitmask[3] = rng.integers(-2**31, 2**31, size=bitmask.shape[1], dtype=np.int64).astype(np.int32)
    flags = SAMPLER_PATHS[path]
    plain = sample(logits, tensors, flags)
    masked = sample(logits, tensors, flags, jnp.asarray(bitmask))
    for field in ("token_ids", "logprobs", "top_logprob_ids", "top_logprob_values"):
        np.testing.assert_array_equal(np.asarray(getattr(masked, field))[:3], np.asarray(getattr(plain, field))[:3])
    token = int(masked.token_ids[3])
    assert (bitmask[3, token // 32] >> (token % 32)) & 1


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.9, "logprobs": 2}], ids=["basic", "full"])
def test_unconstrained_rows_are_bit_for_bit_unaffected(tiny_llm, extra):
    """A batch mixing constrained and unconstrained requests samples the unconstrained ones
    exactly as a batch without the constrained ones does: "basic_masked" vs "basic" sampler
    paths, and "full_masked" vs "full" when a row needs the full sampler. (Same tokens; their
    logprobs may differ in the last bits, as for any change of batch bucket: the forward's
    shapes differ, which the sampler-level test above rules out as the mask's doing.)"""
    plain = [SamplingParams(temperature=t, seed=s, max_tokens=10, ignore_eos=True)
             for t, s in [(0.0, 0), (1.0, 1), (0.7, 2), (1.3, 3)]]
    plain[1] = SamplingParams(**{**plain[1].__dict__, **extra})
    prompts = [[11 + i, 23, 5 * i + 1] for i in range(len(plain))]
    alone = tiny_llm.generate(prompts, plain, use_tqdm=False)
    mixed_prompts = prompts + [[4, 4], [6, 6, 6]]
    mixed_params = plain + [constrained(regex=r"[a-z]{5,9}", max_tokens=10), constrained(choice=["on", "off"])]
    mixed = tiny_llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert tiny_llm.engine.stats()["num_compilations_after_warmup"] == 0


def test_json_schemas_validate_on_the_default_model(default_llm):
    """Two samples of each schema, in one batch: each parses and validates (or was cut by max_tokens)."""
    prompts, params = [], []
    for index, schema in enumerate(SCHEMAS):
        for sample in range(2):
            prompts.append(f"Reply with a JSON object following this schema: {json.dumps(schema)}\n")
            params.append(SamplingParams(temperature=1.0, max_tokens=80, seed=10 * index + sample,
                                         structured_outputs=StructuredOutputsParams(json=schema)))
    outputs = default_llm.generate(prompts, params, use_tqdm=False)
    validated = 0
    for output, param in zip(outputs, params):
        if output.outputs[0].finish_reason == "length":
            continue  # a long string cut by max_tokens: partial by design
        jsonschema.validate(json.loads(output.outputs[0].text), param.structured_outputs.json)
        validated += 1
    assert validated >= 4, [o.outputs[0].text for o in outputs]
    assert default_llm.engine.stats()["num_compilations_after_warmup"] == 0


def test_chat_with_a_schema(default_llm):
    schema = SCHEMAS[2]
    [output] = default_llm.chat([{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
                                constrained(json=schema, max_tokens=30), use_tqdm=False)
    jsonschema.validate(json.loads(output.outputs[0].text), schema)


@pytest.mark.slow
def test_two_hundred_schema_samples_all_validate(default_llm):
    # One call for all 204 requests, so the batch stays full until the last ones (six calls of 34
    # left each call's last wave nearly empty). The schema leads each prompt and the example number
    # that varies it ends it, so the prefix cache shares a schema's pages across its 68 prompts
    # (with the number first, every prompt was prefilled whole: two thirds of the tokens computed).
    schemas = [schema for schema in SCHEMAS * 2 for _ in range(34)]
    prompts = [f"A JSON object for the schema {json.dumps(schema)}, example {i % 34}:\n"
               for i, schema in enumerate(schemas)]
    params = [SamplingParams(temperature=1.0, max_tokens=200, seed=100 + i // 34, n=1,
                             structured_outputs=StructuredOutputsParams(json=schema)) for i, schema in enumerate(schemas)]
    outputs = default_llm.generate(prompts, params, use_tqdm=False)
    for output, schema in zip(outputs, schemas, strict=True):
        assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    assert len(outputs) >= 200


def test_padded_vocabulary_ids_are_never_allowed(tiny):
    """A model vocabulary larger than the tokenizer's (padded rows): no grammar allows those ids,
    even one that allows any text, and unconstrained rows of the same step allow everything."""
    from jaxinfer.sequence import Sequence
    from jaxinfer.structured_output import GrammarMatchers

    model_vocab = 1000  # the tiny tokenizer has 512 ids
    compiler = GrammarCompiler(lambda: guidance_tokenizer(tiny.tokenizer, model_vocab, [511]))
    matchers = GrammarMatchers(tiny.tokenizer.vocab_size, model_vocab, [511])
    constrained_seq, free_seq = Sequence(0, "a", [1]), Sequence(1, "b", [1])
    template = compiler.submit(StructuredOutputsParams(regex=r"(.|\n)*"))
    matchers.add(constrained_seq, template)
    template.result(timeout=30)
    assert [(s.seq_id, e) for s, e in matchers.take_ready()] == [(0, None)]
    bitmask = matchers.fill_bitmask([(constrained_seq, 2), (free_seq, 0)], 3)
    allowed = np.asarray(apply_token_bitmask(jnp.zeros((3, model_vocab)), jnp.asarray(bitmask))) == 0
    assert allowed[0].all() and allowed[1].all()  # rows without a grammar
    assert not allowed[2, 512:].any() and allowed[2, :512].sum() > 400
    compiler.shutdown()


def test_a_request_waiting_for_its_grammar_stalls_no_one_and_can_be_aborted(tiny_llm):
    """While a grammar compiles, the other requests' steps go on; once compiled, the request runs."""
    import concurrent.futures

    engine = tiny_llm.engine
    real_submit = engine.grammar_compiler.submit
    slow = concurrent.futures.Future()  # a compilation that has not finished
    engine.grammar_compiler.submit = lambda constraint: slow
    try:
        engine.add_request("waits", [3, 4], constrained(regex="[a-z]{3}", max_tokens=8))
        engine.add_request("aborted", [3, 5], constrained(regex="[a-z]{3}", max_tokens=8))
        engine.add_request("free", [5, 6], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finally:
        engine.grammar_compiler.submit = real_submit
    assert engine.abort("aborted")
    finished = {}
    for _ in range(50):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if "free" in finished:
            break
    assert len(finished["free"].outputs[0].token_ids) == 6
    assert finished["aborted"].outputs[0].finish_reason == "abort"
    assert "waits" not in finished and engine.stats()["num_waiting_for_grammar"] == 1
    slow.set_result(real_submit(StructuredOutputsParams(regex="[a-z]{3}")).result(timeout=30))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert re.fullmatch("[a-z]{3}", finished["waits"].outputs[0].text)
    assert engine.stats()["num_waiting_for_grammar"] == 0
