"""A kept token costs bytes, a dropped one none: cache bytes per layer and per head group."""

import jax
import jax.numpy as jnp
import pytest

from kvjax.cache_protocol import ModelCacheShape, allocate_model_cache, model_cache_nbytes
from kvjax.dense_cache import FullCache
from kvjax.eval.cache_size import cache_bytes_after_context
from kvjax.h2o import H2O
from kvjax.kivi_cache import Kivi
from kvjax.pyramidkv import PyramidKV
from kvjax.razor_attention import RazorAttention
from kvjax.retrieval_heads import echo_induction_scores
from kvjax.snapkv import SnapKV
from kvjax.streaming_llm import StreamingLLM
from tests.kvjax.test_razor_attention import make_profile
from tests.kvjax.test_snapkv import random_qkv
from tests.kvjax.tiny_decoder import tiny_decoder

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 4, 3, 2, 8
SHAPE = ModelCacheShape(
  num_layers=LAYERS, num_kv_heads=KV_HEADS, num_query_heads=KV_HEADS * GROUP, head_dim=HEAD_DIM
)
BATCH, PROMPT, NEW = 2, 64, 5
BF16 = 2  # bytes per cached element
LENGTHS_BYTES = BATCH * 4  # the int32 lengths every storage cache keeps per row


def dense_bytes(heads, tokens):
  """A full-precision storage of `tokens` slots for `heads` KV heads: K and V, plus lengths."""
  return 2 * BATCH * heads * tokens * HEAD_DIM * BF16 + LENGTHS_BYTES


def allocate(method):
  return allocate_model_cache(
    method, SHAPE, batch=BATCH, prompt_len=PROMPT, max_new_tokens=NEW, dtype=jnp.bfloat16
  )


def layer_bytes(method):
  return [cache.nbytes for cache in allocate(method)]


def test_full_cache_baseline():
  assert layer_bytes(FullCache()) == [dense_bytes(KV_HEADS, PROMPT + NEW)] * LAYERS


@pytest.mark.parametrize(
  "method", [SnapKV(budget=16, window=4), H2O(budget=16, window=4), SnapKV(ratio=0.25, window=4)]
)
def test_uniform_selection_stores_budget_plus_new_tokens_per_layer(method):
  assert layer_bytes(method) == [dense_bytes(KV_HEADS, 16 + NEW)] * LAYERS


def test_pyramidkv_layers_store_their_own_budgets():
  method = PyramidKV(budget=16, window=4)
  budgets = method.layer_budgets(LAYERS, PROMPT)
  assert budgets == (28, 20, 12, 4)  # min (16-4)//20 = 0, max 24, step 8, + window 4
  assert layer_bytes(method) == [dense_bytes(KV_HEADS, b + NEW) for b in budgets]


def test_streaming_stores_its_budget_and_nothing_more_even_while_decoding():
  assert layer_bytes(StreamingLLM(budget=16)) == [dense_bytes(KV_HEADS, 16)] * LAYERS


@pytest.mark.parametrize("compensation", ["mean", "weighted"])
def test_razor_head_groups_store_what_they_keep(compensation):
  # Layer 0: no retrieval head; layer 1: one; layer 2: two; layer 3: all three.
  profile = make_profile(SHAPE, [(1, 2), (2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
  method = RazorAttention(profile=profile, budget=12, compensation=compensation)
  caches = allocate(method)
  for layer, cache in enumerate(caches):
    retrieval_heads = len(profile.retrieval_heads_of_layer(layer))
    local_heads = KV_HEADS - retrieval_heads
    retrieval = dense_bytes(retrieval_heads, PROMPT + NEW) if retrieval_heads else 0
    if compensation == "mean":  # the compensation token is one of the 12 slots
      local = dense_bytes(local_heads, 12 + NEW) if local_heads else 0
    else:  # 11 slots + the compensation K/V beside them + the dropped count per row
      compensation = 2 * BATCH * local_heads * HEAD_DIM * BF16 + BATCH * 4
      local = dense_bytes(local_heads, 11 + NEW) + compensation if local_heads else 0
    assert (cache.retrieval.nbytes if cache.retrieval else 0) == retrieval
    assert cache.nbytes == retrieval + local
  # Every non-retrieval head is cheaper than a retrieval head by the tokens it dropped.
  assert caches[0].nbytes < caches[1].nbytes < caches[2].nbytes < caches[3].nbytes


def test_codec_storage_holds_the_kept_tokens_only():
  storage = Kivi(bits=4, group_size=8, residual=8)
  expected = storage.allocate_storage(
    batch=BATCH, kv_heads=KV_HEADS, capacity=16 + NEW, head_dim=HEAD_DIM, dtype=jnp.bfloat16
  )
  quantized = layer_bytes(SnapKV(budget=16, window=4, storage=storage))
  assert quantized == [expected.nbytes] * LAYERS
  assert quantized[0] < layer_bytes(SnapKV(budget=16, window=4))[0]


def test_compare_reads_the_same_bytes_from_shapes_alone(tmp_path):
  decoder, params = tiny_decoder()
  path = tmp_path / "tiny.json"
  make_profile(decoder.cache_shape, [(0, 1)]).save(path)
  bytes_after_context = lambda method: cache_bytes_after_context(
    decoder, params, method, context_len=32, cache_dtype=jnp.bfloat16
  )
  full = bytes_after_context(FullCache())
  for method in (
    SnapKV(budget=8, window=4),
    PyramidKV(budget=8, window=4),
    StreamingLLM(budget=8),
    RazorAttention(profile=str(path), budget=8),
  ):
    caches = allocate_model_cache(
      method, decoder.cache_shape, batch=1, prompt_len=32, max_new_tokens=0, dtype=jnp.bfloat16
    )
    assert bytes_after_context(method) == model_cache_nbytes(caches) < full


def _intermediate_shapes(jaxpr):
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      yield tuple(var.aval.shape)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _intermediate_shapes(inner)


@pytest.mark.parametrize("scorer", ["snapkv", "h2o", "retrieval_probe"])
def test_scoring_never_materialises_prompt_by_prompt(scorer):
  prompt = 40  # no other dimension is 40
  queries, keys, _ = random_qkv(seed=0, prompt=prompt)
  lengths = jnp.asarray([40, 27])
  shape = ModelCacheShape(num_layers=1, num_kv_heads=2, num_query_heads=6, head_dim=8)
  if scorer in ("snapkv", "h2o"):
    method = SnapKV(budget=16, window=4)
    if scorer == "h2o":
      method = H2O(budget=16, window=4, query_chunk=8)
    selector = method.selector(shape, prompt)
    fn = lambda q, k: selector.kept_indices(k, q, lengths)
  else:
    fn = lambda q, k: echo_induction_scores(
      q, k, lengths, block_len=13, prefix_len=1, sm_scale=0.3, query_chunk=8
    )
  jaxpr = jax.make_jaxpr(fn)(jnp.asarray(queries), jnp.asarray(keys)).jaxpr
  shapes = list(_intermediate_shapes(jaxpr))
  assert any(prompt in s for s in shapes)
  assert not [s for s in shapes if s.count(prompt) >= 2], "a prompt x prompt intermediate exists"
