"""kvjax's loops refuse to append past a cache's capacity instead of losing tokens in jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_room import check_room, rows_room
from kvjax.generate import decode, prefill
from kvjax.method_spec import parse_method_spec
from kvjax.sampling import SamplingConfig
from kvjax.teacher_forcing import teacher_force
from tests.kvjax.layer_loop_params import each_in_one_layer_loop
from tests.kvjax.tiny_decoder import tiny_decoder

TOKENS = np.random.default_rng(0).integers(1, 64, (2, 40)).astype(np.int32)
LENGTHS = np.array([40, 29], np.int32)
BOUNDED = [
  "full",
  "kivi:bits=2,group_size=16,residual=16",
  "gear:bits=2,group_size=16,block=16,rank=2",
  "snapkv:budget=16,window=4",
]


def _prefilled(spec, max_new_tokens, layer_loop="unroll"):
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  logits, caches = prefill(
    decoder,
    params,
    TOKENS,
    LENGTHS,
    cache_method=parse_method_spec(spec),
    max_new_tokens=max_new_tokens,
    cache_dtype=jnp.float32,
  )
  return decoder, params, logits, caches


@pytest.mark.parametrize(
  "spec, layer_loop",
  each_in_one_layer_loop(zip(BOUNDED, ["scan", "unroll", "scan", "unroll"], strict=True)),
)
def test_bounded_caches_report_their_room_and_loops_refuse_more(spec, layer_loop):
  decoder, params, logits, caches = _prefilled(spec, 3, layer_loop)
  room = rows_room(caches)
  assert room is not None and np.all(room >= 3)
  too_many = int(room.min()) + 1
  with pytest.raises(ValueError, match=rf"teacher_force: appends {too_many} tokens per row"):
    teacher_force(decoder, params, logits, caches, LENGTHS, np.ones((2, too_many), np.int32))
  with pytest.raises(ValueError, match=rf"max_new_tokens >= {too_many}"):
    decode(
      decoder,
      params,
      logits,
      caches,
      LENGTHS,
      jax.random.key(0),
      max_new_tokens=too_many + 1,
      sampling=SamplingConfig(),
      stop_token_ids=(),
      pad_token_id=0,
    )
  # Exactly the room is fine, and the room shrinks by what was appended.
  _, _, after = teacher_force(decoder, params, logits, caches, LENGTHS, np.ones((2, 3), np.int32))
  np.testing.assert_array_equal(rows_room(after), room - 3)


def test_evicting_caches_have_no_limit():
  decoder, params, logits, caches = _prefilled("streaming:budget=16,sinks=2", 0)
  assert rows_room(caches) is None
  logprobs, _, _ = teacher_force(
    decoder, params, logits, caches, LENGTHS, np.ones((2, 40), np.int32)
  )
  assert np.all(np.isfinite(logprobs))


def test_traced_caches_are_not_checked():
  """Inside a caller's jit the lengths are unknown: the check steps aside (documented)."""
  _, _, _, caches = _prefilled("full", 0)
  assert jax.jit(lambda c: jnp.int32(0) if rows_room(c) is None else jnp.int32(1))(caches) == 0


@pytest.mark.parametrize("new_tokens", [-1, 2.5, True])
def test_check_room_refuses_a_count_that_is_not_one(new_tokens):
  _, _, _, caches = _prefilled("full", 4)
  with pytest.raises(ValueError, match=f"my_loop: new_tokens={new_tokens!r} must be an int >= 0"):
    check_room(caches, new_tokens, caller="my_loop")
