"""The shared matrix every cache method runs through (kvpress style), on a tiny random model.

Each registered method must: run under `generate` (jit + while_loop) for a batch of prompts of
different lengths, each row generating what it generates alone, with the prompt in one piece
and in chunks (or refuse chunks clearly); report
bytes that are exactly its arrays' bytes and (when it compresses) fewer than the full cache's;
score a continuation through its cache with a KL to the full cache under the configuration's
bound (lossless ones near 0, lossy ones above 0).
"""

import dataclasses
import importlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import (
  allocate_model_cache,
  model_cache_nbytes,
  model_cache_shapes,
  tree_nbytes,
)
from kvjax.cache_room import rows_room
from kvjax.chunked_prefill import CHUNKED_PREFILL_METHODS, chunked_prefill_refusal
from kvjax.compressed_context import compress_context, repeat_context, share_context
from kvjax.eval.cache_size import cache_bytes_after_context
from kvjax.eval.continuation import score_continuation
from kvjax.generate import generate, prefill
from kvjax.method_registry import METHODS
from kvjax.method_spec import parse_method_spec
from kvjax.teacher_forcing import teacher_force
from tests.kvjax.tiny_decoder import tiny_decoder

QUANT = "group_size=16,residual=16"
GEAR = "group_size=16,block=16,rank=2"
# spec -> upper bound on the KL to the full cache. Lossy bounds are about twice what was
# measured (2026-11-25); on this random model a cache of 2 tokens (streaming:budget=2,sinks=1)
# is at 0.81, one of 4 at 0.67. Every configuration above 1e-6 must also differ from the full
# cache (KL > 1e-6): a method that silently kept everything would fail.
MATRIX = {
  "full": {"full": 1e-6},
  "kivi": {f"kivi:bits=8,{QUANT}": 1e-3, f"kivi:bits=2,{QUANT}": 0.25},  # 1.2e-5, 0.123
  # 1.1e-3, 0.066: GEAR-2's low-rank term brings it under KIVI-2
  "gear": {f"gear:bits=4,{GEAR},outliers=0.02": 5e-3, f"gear:bits=2,{GEAR},outliers=0": 0.12},
  # 0.255; budget 64 keeps all 29 context tokens
  "snapkv": {"snapkv:budget=16,window=4,kernel=3": 0.5, "snapkv:budget=64,window=4": 1e-6},
  "h2o": {"h2o:budget=16,window=4": 0.45},  # 0.230
  # 0.303; budget=64 covers the 29-token context and its 11 forced tokens: nothing is evicted.
  "h2o_decode": {"h2o_decode:budget=16,window=4": 0.55, "h2o_decode:budget=64": 1e-6},
  "pyramidkv": {
    "pyramidkv:budget=16,window=4,kernel=3": 0.3,  # 0.149
    f"pyramidkv:budget=16,window=4+kivi:bits=4,{QUANT}": 0.35,  # 0.167
  },
  "streaming": {"streaming:budget=16,sinks=2": 0.5},  # 0.260
  "razor": {
    "razor:budget=12,sinks=2,profile={profile}": 0.37,  # 0.184
    # 0.092: the compensation token halves the KL of the same budget
    "razor:budget=12,sinks=2,compensation=weighted,profile={profile}": 0.18,
  },
  # 0.424, 0.429 (all heads streaming: 0.478); every head full is the full cache
  # (test_duo_attention).
  "duo": {
    "duo:sinks=2,recent=8,profile={gates}": 0.85,
    f"duo:sinks=2,recent=8,profile={{gates}}+kivi:bits=4,{QUANT}": 0.85,
  },
}
PROMPTS = [
  list(np.random.default_rng(0).integers(1, 64, 40)),
  list(np.random.default_rng(1).integers(1, 64, 29)),
]
CASES = [(name, spec, bound) for name, specs in MATRIX.items() for spec, bound in specs.items()]
# One configuration per method, the one that takes the most of its code (GEAR's outliers, the
# compositions with KIVI): the tests that generate run these by default and the others under
# `-m slow`, since each configuration compiles its own prefill and decode programs.
EVERY_METHOD_ONCE = {
  "full",
  f"kivi:bits=2,{QUANT}",
  f"gear:bits=4,{GEAR},outliers=0.02",
  "snapkv:budget=16,window=4,kernel=3",
  "h2o:budget=16,window=4",
  "h2o_decode:budget=16,window=4",
  f"pyramidkv:budget=16,window=4+kivi:bits=4,{QUANT}",
  "streaming:budget=16,sinks=2",
  "razor:budget=12,sinks=2,profile={profile}",
  f"duo:sinks=2,recent=8,profile={{gates}}+kivi:bits=4,{QUANT}",
}


def case_id(spec: str) -> str:
  return spec.replace(",profile={profile}", "").replace(",profile={gates}", "")


def matrix_params(*, every_method_once: bool = False) -> list:
  """CASES as pytest params; with `every_method_once`, those not in EVERY_METHOD_ONCE are
  marked slow."""
  return [
    pytest.param(
      *case,
      id=case_id(case[1]),
      marks=[pytest.mark.slow] if every_method_once and case[1] not in EVERY_METHOD_ONCE else [],
    )
    for case in CASES
  ]


@pytest.fixture(scope="module")
def full_scores():
  decoder, params = tiny_decoder()
  windows = np.array([p[:29] + p[:11] for p in PROMPTS], np.int32)
  return windows, score_continuation(
    decoder, params, parse_method_spec("full"), windows, context_len=29, cache_dtype=jnp.float32
  )


def test_every_registered_method_is_in_the_matrix():
  assert set(MATRIX) == set(METHODS)


def test_the_default_run_takes_every_method_once():
  names = [name for name, spec, _ in CASES if spec in EVERY_METHOD_ONCE]
  assert sorted(names) == sorted(METHODS)  # no method twice, none missing, no stale spec


@pytest.mark.parametrize("name, spec, kl_bound", matrix_params())
def test_method(name, spec, kl_bound, profile_path, gates_path, full_scores):
  decoder, params = tiny_decoder()
  method = parse_method_spec(spec.format(profile=profile_path, gates=gates_path))
  assert type(method).method_name == name

  tokens, lengths = np.zeros((2, 40), np.int32), np.array([40, 29], np.int32)
  for row, prompt in enumerate(PROMPTS):
    tokens[row, : len(prompt)] = prompt
  logits, caches = prefill(
    decoder,
    params,
    tokens,
    lengths,
    cache_method=method,
    max_new_tokens=0,
    cache_dtype=jnp.bfloat16,
  )
  # A bounded cache reports its room, and the loops refuse to append past it.
  room = rows_room(caches)
  if room is not None:
    assert np.all(room >= 0)
    with pytest.raises(ValueError, match="teacher_force: appends"):
      teacher_force(
        decoder, params, logits, caches, lengths, np.ones((2, int(room.min()) + 1), np.int32)
      )
  assert model_cache_nbytes(caches) == tree_nbytes(caches)  # reported bytes are the arrays' bytes
  # Bytes read off the allocation's shapes alone are the bytes the prefilled caches hold.
  assert model_cache_nbytes(caches) == cache_bytes_after_context(
    decoder,
    params,
    method,
    context_len=tokens.shape[1],
    cache_dtype=jnp.bfloat16,
    batch=tokens.shape[0],
  )
  method_bytes = cache_bytes_after_context(
    decoder, params, method, context_len=40, cache_dtype=jnp.bfloat16
  )
  full_bytes = cache_bytes_after_context(
    decoder, params, parse_method_spec("full"), context_len=40, cache_dtype=jnp.bfloat16
  )
  if name == "full":
    assert method_bytes == full_bytes
  elif "budget=64" not in spec:
    assert method_bytes < full_bytes

  windows, reference = full_scores
  scores = score_continuation(
    decoder, params, method, windows, context_len=29, cache_dtype=jnp.float32
  )
  kl = scores.kl_from(reference)
  assert np.isfinite(kl) and kl >= -1e-6
  assert kl <= kl_bound, f"{spec}: KL {kl} to the full cache exceeds {kl_bound}"
  if kl_bound > 1e-6:
    assert kl > 1e-6, f"{spec}: a lossy configuration scores like the full cache (KL {kl})"
  assert np.all(np.isfinite(scores.logprobs))


@pytest.mark.parametrize("name, spec, kl_bound", matrix_params(every_method_once=True))
def test_method_in_chunks(name, spec, kl_bound, profile_path, gates_path):
  """A method generates from the prompt in one piece; it either prefills in chunks too (same
  cache bytes; a lossless configuration the same tokens) or refuses before anything runs,
  naming prefill_chunk."""
  decoder, params = tiny_decoder()
  method = parse_method_spec(spec.format(profile=profile_path, gates=gates_path))
  run = lambda chunk: generate(
    decoder,
    params,
    PROMPTS,
    max_new_tokens=5,
    cache_method=method,
    cache_dtype=jnp.float32,
    prefill_chunk=chunk,
  )
  caches = model_cache_shapes(
    method, decoder.cache_shape, batch=2, prompt_len=40, max_new_tokens=5, dtype=jnp.float32
  )
  one_piece = run(None)
  assert one_piece.tokens.shape == (2, 5)
  assert np.all((one_piece.tokens >= 0) & (one_piece.tokens < 64))
  refusal = chunked_prefill_refusal(decoder, caches)
  if refusal is not None:
    assert name not in CHUNKED_PREFILL_METHODS or "+" in spec
    with pytest.raises(ValueError, match="prefill_chunk=8: cache method"):
      run(8)
    return
  assert name in CHUNKED_PREFILL_METHODS
  chunked = run(8)
  assert chunked.tokens.shape == (2, 5) and np.all((chunked.tokens >= 0) & (chunked.tokens < 64))
  assert chunked.cache_bytes == one_piece.cache_bytes
  if kl_bound <= 1e-6:
    assert chunked.token_lists() == one_piece.token_lists()


@pytest.mark.parametrize("name, spec, kl_bound", matrix_params(every_method_once=True))
def test_rows_of_a_batch_generate_what_they_generate_alone(
  name, spec, kl_bound, profile_path, gates_path
):
  """Rows of different lengths share a batch, padded to the longest: no method may let one row's
  tokens (or its padding) change what another row keeps, evicts or generates."""
  decoder, params = tiny_decoder()
  method = parse_method_spec(spec.format(profile=profile_path, gates=gates_path))
  run = lambda prompts: (
    generate(
      decoder, params, prompts, max_new_tokens=5, cache_method=method, cache_dtype=jnp.float32
    ).tokens
  )
  alone = np.concatenate([run([prompt]) for prompt in PROMPTS])
  np.testing.assert_array_equal(run(PROMPTS), alone)


@pytest.mark.parametrize("name, spec, kl_bound", matrix_params(every_method_once=True))
def test_generate_decodes_in_the_prefill_caches_memory(
  name, spec, kl_bound, profile_path, gates_path
):
  """generate donates the caches its prefill made to the decode loop: every byte of them is
  reused for the loop's caches (peak memory one cache, not two), and jax uses every donated
  buffer (it warns about any it cannot)."""
  decoder, params = tiny_decoder()
  method = parse_method_spec(spec.format(profile=profile_path, gates=gates_path))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    # PROMPTS are ragged: width-derived budgets say so, which is not what this test is about.
    warnings.filterwarnings("ignore", message=".*budgets follow the batch's padded prompt width")
    result = generate(
      decoder, params, PROMPTS, max_new_tokens=5, cache_method=method, cache_dtype=jnp.float32
    )
  # The pair generate just ran is the most recently used one.
  _, decode_compiled = importlib.import_module("kvjax.generate")._COMPILED.most_recent()
  assert decode_compiled.memory_analysis().alias_size_in_bytes == result.cache_bytes


@pytest.mark.parametrize("name, spec, kl_bound", matrix_params())
def test_a_sliding_window_model_is_served_only_within_its_window(
  name, spec, kl_bound, profile_path, gates_path
):
  """Past the window every method but `full` (its ring buffer) would attend to tokens the model
  does not: old kept tokens, sinks, heavy hitters, however small the budget."""
  decoder, _ = tiny_decoder()
  shape = dataclasses.replace(decoder.cache_shape, sliding_window=16)
  method = parse_method_spec(spec.format(profile=profile_path, gates=gates_path))
  allocate = lambda prompt_len: model_cache_shapes(
    method, shape, batch=1, prompt_len=prompt_len, max_new_tokens=4, dtype=jnp.float32
  )
  allocate(12)  # 12 + 4 tokens: within the window, every method serves it
  if name == "full":
    allocate(40)
    return
  with pytest.raises(ValueError, match=r"sliding[ _]window.*16.*44"):
    allocate(40)


@pytest.mark.parametrize("name, spec, kl_bound", matrix_params())
def test_a_prompt_wider_than_allocated_is_refused_or_held_as_if_allocated_for_it(
  name, spec, kl_bound, profile_path, gates_path
):
  """A cache allocated for a 12-token prompt and 6 new tokens, handed 14 tokens, either refuses
  them by name or holds exactly what one allocated for 14 and 4 holds (the same room in all):
  never what the 12-token allocation sized (a selection's budget capped at 12, slots fewer than
  the budget) without saying so. Caches whose sizes do not depend on the prompt take it (they
  keep no static width to recompile for)."""
  decoder, _ = tiny_decoder(layer_loop="unroll")
  shape = decoder.cache_shape
  method = parse_method_spec(spec.format(profile=profile_path, gates=gates_path))
  allocate = lambda prompt_len, new: allocate_model_cache(
    method, shape, batch=1, prompt_len=prompt_len, max_new_tokens=new, dtype=jnp.float32
  )
  group = shape.num_query_heads // shape.num_kv_heads
  keys = jax.random.normal(jax.random.key(0), (1, shape.num_kv_heads, 14, shape.head_dim))
  queries = jax.random.normal(jax.random.key(1), (1, shape.num_kv_heads, group, 14, shape.head_dim))
  lengths = jnp.array([14], jnp.int32)
  refused = 0
  for narrow, wide in zip(allocate(12, 6), allocate(14, 4), strict=True):
    try:
      ingested = narrow.ingest(keys, keys, queries, lengths)
    except ValueError as refusal:
      assert re.search(r"14 tokens.*prompt_len=12", str(refusal)), refusal
      refused += 1
      continue
    expected = wide.ingest(keys, keys, queries, lengths)
    for got, want in zip(jax.tree.leaves(ingested), jax.tree.leaves(expected), strict=True):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
  # Selection budgets of 16 and razor's 12 are capped at a 12-token prompt, and h2o_decode's 64
  # slots at 18 tokens: those refuse. Streaming's and h2o_decode's 16 slots, duo's 10 and the
  # storage caches' 18 do not depend on the prompt's width.
  sized_by_prompt = name in ("snapkv", "h2o", "pyramidkv", "razor") or "budget=64" in spec
  assert bool(refused) == sized_by_prompt, (name, refused)


@pytest.mark.parametrize("name, spec, kl_bound", matrix_params())
def test_every_cache_array_keeps_the_batch_on_axis_0(
  name, spec, kl_bound, profile_path, gates_path
):
  """The cache protocol's layout rule, which kvjax.repeat_context relies on: only axis 0 of a
  layer cache's arrays grows with the batch."""
  decoder, _ = tiny_decoder(layer_loop="unroll")
  method = parse_method_spec(spec.format(profile=profile_path, gates=gates_path))
  shapes = lambda batch: model_cache_shapes(
    method, decoder.cache_shape, batch=batch, prompt_len=40, max_new_tokens=5, dtype=jnp.float32
  )
  for one, three in zip(jax.tree.leaves(shapes(1)), jax.tree.leaves(shapes(3)), strict=True):
    assert one.shape[0] == 1 and three.shape == (3,) + one.shape[1:], (one.shape, three.shape)


@pytest.mark.parametrize("name, spec, kl_bound", matrix_params(every_method_once=True))
def test_method_shared_by_several_rows(name, spec, kl_bound, profile_path, gates_path):
  """A context held once for three rows per prompt (share_context) scores continuations as
  the same context copied per row with each row's tokens kept beside it; where decoding only
  appends to a full-precision storage, as the copied context itself. Or it is refused by
  name."""
  decoder, params = tiny_decoder(layer_loop="scan")
  method = parse_method_spec(spec.format(profile=profile_path, gates=gates_path))
  context = compress_context(
    decoder, params, PROMPTS, cache_method=method, room=0, cache_dtype=jnp.float32
  )
  share = lambda context, copies: share_context(
    decoder, context, copies, room=5, cache_dtype=jnp.float32
  )
  if name == "h2o_decode":
    with pytest.raises(ValueError, match="evicts by the attention of each decode step"):
      share(context, 3)
    return
  forced = np.random.default_rng(3).integers(1, 64, (6, 5)).astype(np.int32)
  score = lambda context: np.asarray(
    teacher_force(decoder, params, context.next_logits, context.caches, context.lengths, forced)[0]
  )
  shared = score(share(context, 3))
  assert np.all(np.isfinite(shared))
  # The three copies' queries folded into one read of the context, against three copies.
  np.testing.assert_allclose(
    shared, score(share(repeat_context(context, 3), 1)), rtol=1e-5, atol=1e-5
  )
  if name in ("full", "snapkv", "h2o", "razor") or (name == "pyramidkv" and "+" not in spec):
    roomy = compress_context(
      decoder, params, PROMPTS, cache_method=method, room=5, cache_dtype=jnp.float32
    )
    np.testing.assert_allclose(shared, score(repeat_context(roomy, 3)), rtol=1e-5, atol=1e-5)
