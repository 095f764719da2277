"""The bytes table without a model run gives compare's byte columns."""

import jax.numpy as jnp
import pytest

from benchmarks.cache_bytes import byte_rows, markdown
from kvjax.cache_protocol import allocate_model_cache, model_cache_nbytes
from kvjax.method_spec import parse_method_spec
from tests.kvjax.tiny_decoder import tiny_decoder


def test_rows_are_the_bytes_of_the_allocated_caches():
  decoder, _ = tiny_decoder()
  specs = ["full", "kivi:group_size=16,residual=16", "snapkv:budget=8,window=4"]
  rows = byte_rows(decoder, specs, context=48, new_tokens=16)
  for spec, row in zip(specs, rows, strict=True):
    for new, column in ((0, "cache_bytes"), (16, "cache_bytes_at_end")):
      caches = allocate_model_cache(
        parse_method_spec(spec),
        decoder.cache_shape,
        batch=1,
        prompt_len=48,
        max_new_tokens=new,
        dtype=jnp.bfloat16,
      )
      assert row[column] == model_cache_nbytes(caches)
  assert rows[0]["compression_ratio"] == 1.0 and rows[0]["bits_per_element"] == pytest.approx(
    16.0, rel=1e-2
  )  # + lengths
  # 48 tokens = 3 blocks of 16: all but the last block quantized, the last in the window.
  assert rows[1]["compression_ratio"] > 1.0
  table = markdown(rows, "header")
  assert table.count("\n| ") == 1 + len(specs) and "| full | " in table
