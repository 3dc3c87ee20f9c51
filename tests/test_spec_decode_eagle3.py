"""EAGLE-3 heads on CPU in float32: the checkpoint layouts, the head's drafts, the engine's outputs unchanged.

The fixtures are written here: a tiny 4-layer Llama target (random weights, the tiny-llama3
tokenizer) and tiny EAGLE-3 heads in both checkpoint layouts (``eagle3_checkpoint``), with
PyTorch's tensor names and ``[out, in]`` shapes. Random heads rarely draft what a random target
says, so the engine tests that need accepted runs keep the head running (its cache, its catch-up)
but verify an *oracle*'s drafts: the plain run's continuation, corrupted at fixed positions.
Separately, every draft the head made is compared with a dense, one-sequence reference of the
head computed from scratch over the same tokens, whatever runs were accepted before.
"""

import dataclasses
import functools
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import jax
import jax.numpy as jnp

from jaxinfer import LLM, SamplingParams
from jaxinfer.batch import build_step_batch
from jaxinfer.checkpoint import load_model
from jaxinfer.kv_cache import create_kv_cache
from jaxinfer.loaded_model import LoadedModel
from jaxinfer.model import (apply_rope, hidden_states, hidden_states_and_aux, mlp_block, output_projection, rms_norm,
                            rope_inverse_frequencies, rope_tables)
from jaxinfer.params import init_random
from jaxinfer.runner import ModelRunner
from jaxinfer.spec_decode import eagle3_proposer
from jaxinfer.spec_decode.config import SpeculativeConfigError
from jaxinfer.spec_decode.eagle3_checkpoint import load_eagle3_head

from .conftest import FIXTURES
from .test_page_allocator import check_allocator_invariants
from .test_spec_decode import run_to_completion

K = 3
OPTIONS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, num_pages=96, page_size=16,
               use_tqdm=False, max_wait_s=0.0)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
AUX_LAYERS = [1, 2, 3]
DRAFT_VOCAB = 200


@pytest.fixture(scope="module")
def target():
    """A 4-layer Llama (so that the aux layers are three distinct layers) with random weights."""
    tiny = load_model(FIXTURES / "tiny-llama3", dtype="float32")
    config = dataclasses.replace(tiny.config, num_layers=4)
    weights = init_random(config, jax.random.key(3), jnp.float32)
    return LoadedModel(config, weights, tiny.tokenizer, FIXTURES / "tiny-llama3")


def head_tensors(config, seed, *, layout, draft_vocab=DRAFT_VOCAB, num_aux=3, with_embed=False):
    """Random numpy tensors of a head for ``config`` (the target's sizes), named as ``layout`` stores them."""
    rng = np.random.default_rng(seed)
    e, f, d, hq, hkv, vocab = (config.hidden_size, config.intermediate_size, config.head_dim, config.num_q_heads,
                               config.num_kv_heads, config.vocab_size)

    def normal(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    layer = "midlayer." if layout == "eagle" else "layers.0."
    draft_ids = np.sort(rng.choice(vocab, draft_vocab, replace=False))
    tensors = {
        "fc.weight": normal(e, num_aux * e),
        f"{layer}hidden_norm.weight": (1 + 0.1 * rng.standard_normal(e)).astype(np.float32),
        f"{layer}input_layernorm.weight": (1 + 0.1 * rng.standard_normal(e)).astype(np.float32),
        f"{layer}post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(e)).astype(np.float32),
        f"{layer}self_attn.q_proj.weight": normal(hq * d, 2 * e),
        f"{layer}self_attn.k_proj.weight": normal(hkv * d, 2 * e),
        f"{layer}self_attn.v_proj.weight": normal(hkv * d, 2 * e),
        f"{layer}self_attn.o_proj.weight": normal(e, hq * d),
        f"{layer}mlp.gate_proj.weight": normal(f, e),
        f"{layer}mlp.up_proj.weight": normal(f, e),
        f"{layer}mlp.down_proj.weight": normal(e, f),
        "norm.weight": (1 + 0.1 * rng.standard_normal(e)).astype(np.float32),
        "lm_head.weight": normal(draft_vocab, e),
        "d2t": (draft_ids - np.arange(draft_vocab)).astype(np.int64),
        "t2d": np.isin(np.arange(vocab), draft_ids),
    }
    if layout == "speculators":
        tensors["fc.bias"] = (0.1 * rng.standard_normal(e)).astype(np.float32)
    if with_embed:
        tensors["embed_tokens.weight"] = normal(vocab, e)
    return tensors


def head_config(config, *, layout, draft_vocab=DRAFT_VOCAB, aux_layers=AUX_LAYERS, **overrides):
    layer = dict(model_type="llama", hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                 num_attention_heads=config.num_q_heads, num_key_value_heads=config.num_kv_heads,
                 head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                 max_position_embeddings=1024, vocab_size=config.vocab_size, num_hidden_layers=1)
    if layout == "eagle":  # SafeAILab's flat LlamaConfig
        out = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
        if aux_layers is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    else:  # speculators
        out = dict(speculators_model_type="eagle3", architectures=["Eagle3Speculator"], transformer_layer_config=layer,
                   draft_vocab_size=draft_vocab, norm_before_residual=True, target_hidden_size=config.hidden_size,
                   speculators_config={"algorithm": "eagle3", "proposal_methods": [
                       {"proposal_type": "greedy", "speculative_tokens": K}]})
        if aux_layers is not None:
            out["eagle_aux_hidden_state_layer_ids"] = aux_layers
    out.update(overrides)
    return out


def write_head(path, config, seed=0, *, layout="speculators", tensors=None, **config_overrides):
    path.mkdir(parents=True, exist_ok=True)
    tensors = head_tensors(config, seed, layout=layout) if tensors is None else tensors
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(head_config(config, layout=layout, **config_overrides)))
    return path


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, target):
    return write_head(tmp_path_factory.mktemp("eagle3") / "head", target.config, seed=1)


def eagle_llm(target, head_dir, **options):
    return LLM(loaded=target, speculative_config={"method": "eagle3", "model": str(head_dir),
                                                 "num_speculative_tokens": K}, **{**OPTIONS, **options})


@pytest.fixture(scope="module")
def plain(target):
    return LLM(loaded=target, **OPTIONS)


@pytest.fixture(scope="module")
def eagle(target, head_dir):
    # Few pages: several long sequences preempt each other (every test here runs under preemption).
    return eagle_llm(target, head_dir, num_pages=128 // 16 + 4, enable_prefix_caching=True,
                     scheduling_admission="greedy")


def prompts_of(count, seed, low=5, high=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 500, size=int(rng.integers(low, high))).tolist() for _ in range(count)]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_loader_reads_both_layouts_into_the_model_layout(tmp_path, target, layout):
    tensors = head_tensors(target.config, 5, layout=layout, with_embed=layout == "speculators")
    write_head(tmp_path, target.config, layout=layout, tensors=tensors)
    config, head = load_eagle3_head(tmp_path, target.config, jnp.float32)
    e, hq, d = target.config.hidden_size, target.config.num_q_heads, target.config.head_dim
    layer = "midlayer." if layout == "eagle" else "layers.0."
    assert config.aux_layer_ids == tuple(AUX_LAYERS) and config.draft_vocab_size == DRAFT_VOCAB
    assert config.norm_before_residual == (layout == "speculators")
    assert config.layer.num_layers == 1 and config.layer.vocab_size == DRAFT_VOCAB
    np.testing.assert_array_equal(head.fc, tensors["fc.weight"].T)
    np.testing.assert_array_equal(head.layer.q, tensors[f"{layer}self_attn.q_proj.weight"].T.reshape(2 * e, hq, d))
    np.testing.assert_array_equal(head.layer.o, tensors[f"{layer}self_attn.o_proj.weight"].T.reshape(hq, d, e))
    np.testing.assert_array_equal(head.layer.down, tensors[f"{layer}mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(head.layer.attn_norm, tensors[f"{layer}input_layernorm.weight"])
    np.testing.assert_array_equal(head.hidden_norm, tensors[f"{layer}hidden_norm.weight"])
    np.testing.assert_array_equal(head.lm_head, tensors["lm_head.weight"].T)
    # d2t holds offsets: draft id j is target id j + d2t[j], the ids t2d marks.
    np.testing.assert_array_equal(head.draft_to_target, np.flatnonzero(tensors["t2d"]))
    assert (head.fc_bias is None) == (layout == "eagle") and (head.embed is None) == (layout == "eagle")


def test_loader_defaults_to_vllms_aux_layers(tmp_path):
    tiny = load_model(FIXTURES / "tiny-llama3", dtype="float32")
    config = dataclasses.replace(tiny.config, num_layers=8)
    write_head(tmp_path, config, layout="eagle", aux_layers=None)
    assert load_eagle3_head(tmp_path, config, jnp.float32)[0].aux_layer_ids == (2, 4, 5)


@pytest.mark.parametrize("case, field", [
    ("missing_dir", "speculative_config.model"),
    ("no_safetensors", "speculative_config.model"),
    ("layer_out_of_range", "speculative_config.model.eagle_aux_hidden_state_layer_ids"),
    ("vocab_mismatch", "speculative_config.model.vocab_size"),
    ("hidden_mismatch", "speculative_config.model.target_hidden_size"),
    ("d2t_out_of_range", "speculative_config.model.d2t"),
    ("missing_tensor", "speculative_config.model.norm.weight"),
    ("wrong_shape", "speculative_config.model.fc.weight"),
])
def test_bad_heads_raise_errors_naming_the_field(tmp_path, target, case, field):
    path = tmp_path / "head"
    tensors = head_tensors(target.config, 0, layout="speculators")
    overrides = {}
    if case == "layer_out_of_range":
        overrides["aux_layers"] = [1, 2, 4]
    elif case == "vocab_mismatch":
        overrides["transformer_layer_config"] = {**head_config(target.config, layout="speculators")[
            "transformer_layer_config"], "vocab_size": 1000}
    elif case == "hidden_mismatch":
        overrides["target_hidden_size"] = 2 * target.config.hidden_size
    elif case == "d2t_out_of_range":
        tensors["d2t"][-1] += target.config.vocab_size
    elif case == "missing_tensor":
        del tensors["norm.weight"]
    elif case == "wrong_shape":
        tensors["fc.weight"] = tensors["fc.weight"][:, :-1].copy()
    if case != "missing_dir":
        write_head(path, target.config, tensors=tensors, **overrides)
    if case == "no_safetensors":
        (path / "model.safetensors").unlink()
    with pytest.raises(SpeculativeConfigError) as error:
        eagle_llm(target, path)
    assert error.value.field == field, error.value
    if case == "layer_out_of_range":
        assert error.value.limit == target.config.num_layers - 1


def test_config_needs_a_head(target):
    with pytest.raises(SpeculativeConfigError) as error:
        LLM(loaded=target, speculative_config={"method": "eagle3", "num_speculative_tokens": K}, **OPTIONS)
    assert error.value.field == "speculative_config.model"


def test_plain_steps_carry_no_aux_hidden_states(target):
    """Without a head the step program has exactly its usual outputs; with one it also fills aux_pages."""
    runners = {aux: ModelRunner(target, num_pages=8, page_size=16, max_model_len=64, max_num_seqs=2,
                                max_num_batched_tokens=16, aux_hidden_layers=aux) for aux in ((), (1, 2, 3))}
    shapes = {}
    for aux, runner in runners.items():
        fn, args, kwargs = runner._step_call(runner.empty_inputs(16, 2, 4))
        shapes[aux] = jax.eval_shape(fn, *args, **kwargs)[0]
    assert runners[()].aux_pages is None and len(shapes[()]) == 2
    assert shapes[(1, 2, 3)][2].shape == (8, 16, 3 * target.config.hidden_size)


def test_aux_hidden_states_are_the_residual_stream_entering_each_layer(target):
    """Layer i's feature is Hugging Face's ``hidden_states[i]``: the embeddings for i = 0, else the
    output of the first i layers (a model truncated there, before its final norm)."""
    tokens = prompts_of(1, seed=9)[0]
    config, weights = target.config, target.weights
    batch = jax.tree.map(jnp.asarray, build_step_batch([(tokens, 0, [1, 2, 3])], num_tokens=len(tokens), num_seqs=1,
                                                       pages_per_seq=3))
    _, aux, _ = hidden_states_and_aux(weights, create_kv_cache(config, 4, 16, jnp.float32), batch, config,
                                      "reference", (0, 3, 2))
    e = config.hidden_size
    np.testing.assert_array_equal(aux[:, :e], weights.embed[jnp.asarray(tokens)])
    ones = jnp.ones(e, jnp.float32)
    for j, layer in ((1, 3), (2, 2)):
        truncated_config = dataclasses.replace(config, num_layers=layer)
        truncated = dataclasses.replace(weights, layers=weights.layers[:layer], final_norm=ones)
        x, _ = hidden_states(truncated, create_kv_cache(truncated_config, 4, 16, jnp.float32), batch, truncated_config,
                             "reference")
        feature = aux[:, j * e:(j + 1) * e]
        np.testing.assert_allclose(rms_norm(feature, ones, config.rms_norm_eps), x, rtol=1e-5, atol=1e-5)


REFERENCE_ROWS = OPTIONS["max_model_len"]  # one padded shape: each jitted reference compiles once


@functools.partial(jax.jit, static_argnums=(2, 3))
def reference_features(weights, tokens, config, aux_layer_ids):
    """The target's features of ``tokens`` [R] (padded past the real ones), one contiguous forward."""
    rows = tokens.shape[0]
    batch = build_step_batch([([0] * rows, 0, list(range(1, 9)))], num_tokens=rows, num_seqs=1, pages_per_seq=8)
    batch = dataclasses.replace(jax.tree.map(jnp.asarray, batch), token_ids=tokens)
    cache = create_kv_cache(config, 9, 16, jnp.float32)
    return hidden_states_and_aux(weights, cache, batch, config, "reference", aux_layer_ids)[1]


@functools.partial(jax.jit, static_argnums=(4,))
def reference_head_pass(head, embed, tokens, hidden, config):
    """The head over rows 0..R-1 at positions 0..R-1, dense causal attention: (logits [R, Vd], prenorm [R, E])."""
    c, layer = config.layer, head.layer
    positions = jnp.arange(tokens.shape[0])
    normed_hidden = rms_norm(hidden, head.hidden_norm, c.rms_norm_eps)
    residual = normed_hidden if config.norm_before_residual else hidden
    x = jnp.concatenate([rms_norm(embed[tokens], layer.attn_norm, c.rms_norm_eps), normed_hidden], -1)
    rope = rope_tables(positions, rope_inverse_frequencies(c))
    q = apply_rope(jnp.einsum("te,ehd->thd", x, layer.q), rope)
    k = apply_rope(jnp.einsum("te,ehd->thd", x, layer.k), rope)
    v = jnp.einsum("te,ehd->thd", x, layer.v)
    group = c.num_q_heads // c.num_kv_heads
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    scores = jnp.einsum("thd,shd->hts", q, k, precision="highest") * c.head_dim**-0.5
    causal = positions[None, :] <= positions[:, None]
    weights = jax.nn.softmax(jnp.where(causal[None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("hts,shd->thd", weights, v, precision="highest")
    residual = residual + output_projection(out, layer.o)
    prenorm = residual + mlp_block(layer, residual, c)
    return rms_norm(prenorm, head.final_norm, c.rms_norm_eps) @ head.lm_head, prenorm


def reference_drafts(target, config, head, tokens, num_drafts):
    """The head's drafts after ``tokens``, from scratch: one contiguous forward of the target for
    its features, one dense causal pass of the head over every position, then its decode steps
    (each a pass again with one more row, whose hidden input is the row before's output)."""
    n = len(tokens)
    padded = jnp.zeros(REFERENCE_ROWS, jnp.int32).at[: n - 1].set(jnp.asarray(tokens[: n - 1]))
    aux = reference_features(target.weights, padded, target.config, config.aux_layer_ids)
    hidden = aux @ head.fc + (0 if head.fc_bias is None else head.fc_bias)  # [R, E]: row i from token i
    next_tokens = jnp.zeros(REFERENCE_ROWS, jnp.int32).at[: n - 1].set(jnp.asarray(tokens[1:]))
    embed = target.weights.embed if head.embed is None else head.embed
    drafts, row = [], n - 2
    for _ in range(num_drafts):
        logits, prenorm = reference_head_pass(head, embed, next_tokens, hidden, config)
        drafts.append(int(head.draft_to_target[jnp.argmax(logits[row])]))
        row += 1
        next_tokens = next_tokens.at[row].set(drafts[-1])
        hidden = hidden.at[row].set(prenorm[row - 1])
    return drafts


def record_head_drafts(monkeypatch, oracle=None):
    """Wrap the proposer: record (tokens, the head's drafts) of each round; with ``oracle`` (prompt,
    continuation pairs) verify the oracle's drafts instead, corrupted at fixed positions."""
    rounds = []
    real_propose = eagle3_proposer.Eagle3Proposer.propose

    def propose(self, seqs, rooms):
        drafts = real_propose(self, seqs, rooms)
        for seq, row in zip(seqs, drafts):
            if row:
                rounds.append((list(seq.token_ids), list(row)))
        if oracle is None:
            return drafts
        out = []
        for seq, room, row in zip(seqs, rooms, drafts):
            context = list(seq.token_ids)
            known = [c for p, c in oracle if context[: len(p)] == p]
            if not row or not known:
                out.append(row)
                continue
            done = len(context) - len(next(p for p, c in oracle if context[: len(p)] == p))
            want = known[0][done: done + room]
            out.append([(t + 1) % 500 if (len(context) * 2654435761 + i * 40503) >> 7 & 3 == 0 else t
                        for i, t in enumerate(want)])
        return out

    monkeypatch.setattr(eagle3_proposer.Eagle3Proposer, "propose", propose)
    return rounds


def check_head_drafts(target, llm, rounds):
    proposer = llm.engine.speculator.proposer
    assert rounds
    for tokens, drafts in rounds:
        assert drafts == reference_drafts(target, proposer.config, proposer.weights, tokens, len(drafts))[: len(drafts)]


def test_greedy_identical_batched_and_alone_and_drafts_match_a_dense_reference(target, plain, eagle, monkeypatch):
    prompts = prompts_of(5, seed=1)
    reference = token_ids(plain.generate(prompts, GREEDY, use_tqdm=False))
    rounds = record_head_drafts(monkeypatch)
    assert token_ids(eagle.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert token_ids(eagle.generate(prompts[:1], GREEDY, use_tqdm=False)) == reference[:1]
    stats = eagle.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["num_compilations_after_warmup"] == 0 and stats["num_pages_used"] == 0
    check_head_drafts(target, eagle, rounds)


def test_accepted_runs_roll_back_with_the_head_and_leak_no_pages(target, plain, eagle, monkeypatch):
    """An oracle's drafts give accepted runs of every length; the head still catches up on each
    (its drafts match the dense reference after them); preemption and prefix caching included."""
    shared = prompts_of(1, seed=2, low=40, high=41)[0]
    prompts = [shared + p for p in prompts_of(6, seed=3, low=2, high=20)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = token_ids(plain.generate(prompts, params, use_tqdm=False))
    rounds = record_head_drafts(monkeypatch, oracle=list(zip(prompts, reference)))
    engine = eagle.engine
    before = engine.stats()
    assert run_to_completion(engine, prompts, params, after_step=lambda: check_allocator_invariants(
        engine.allocator, engine.scheduler.running)) == reference
    stats = engine.stats()
    gained = {key: stats[key] - before[key] for key in ("num_preemptions", "prefix_cache_hits",
                                                        "spec_decode_num_accepted_tokens")}
    assert all(value > 0 for value in gained.values()), gained
    assert stats["num_pages_used"] == 0
    check_head_drafts(target, eagle, rounds)


def test_sequences_without_drafts_share_steps_with_the_head_exactly(plain, eagle):
    """A penalized request (never drafted for) and a short max_tokens in a batch with speculating ones."""
    prompts = prompts_of(3, seed=6)
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    reference = token_ids(plain.generate(prompts, params, use_tqdm=False))
    assert token_ids(eagle.generate(prompts, params, use_tqdm=False)) == reference
    assert eagle.engine.stats()["num_pages_used"] == 0


def test_seeded_random_sampling_is_reproducible_with_the_head(target, eagle, monkeypatch):
    """Random rows verify the head's point-mass drafts (``rejection.verify``, exact by the chi-square
    test of tests/test_spec_decode.py); here: seeds reproduce, and the head's state stays right."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    prompts = prompts_of(3, seed=4)
    rounds = record_head_drafts(monkeypatch)
    first = token_ids(eagle.generate(prompts, params, use_tqdm=False))
    assert token_ids(eagle.generate(prompts, params, use_tqdm=False)) == first
    assert eagle.engine.stats()["num_pages_used"] == 0
    check_head_drafts(target, eagle, rounds)


@pytest.mark.slow
def test_default_model_with_a_random_head_greedy_identical(default_model, tmp_path, monkeypatch):
    """SmolLM2-135M (30 layers, 9 query heads over 3 KV heads) with a random head in SafeAILab's
    layout and vLLM's default layers (2, 15, 27): output unchanged, drafts equal the dense reference."""
    write_head(tmp_path, default_model.config, seed=2, layout="eagle", aux_layers=None)
    messages = [{"role": "user", "content": "Name three rivers in Europe."}]
    params = SamplingParams(temperature=0, max_tokens=24)
    options = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, use_tqdm=False, max_wait_s=0.0)
    expected = LLM(loaded=default_model, **options).chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(loaded=default_model, speculative_config={"method": "eagle3", "model": str(tmp_path),
                                                        "num_speculative_tokens": K}, **options)
    assert llm.engine.speculator.proposer.config.aux_layer_ids == (2, 15, 27)
    rounds = record_head_drafts(monkeypatch)
    got = llm.chat([messages, messages], params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [expected] * 2
    check_head_drafts(default_model, llm, rounds[::4])
