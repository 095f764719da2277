"""Contexts spread over devices by rows. The tests that need two devices run in a process of
their own with two host CPU devices (XLA's device count is fixed when jax starts), started by
the last test here; in a process that already has two devices they run directly."""

import importlib
import os
import pathlib
import runpy
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.compressed_context import (
  compress_context,
  context_template,
  continue_context,
  repeat_context,
  share_context,
)
from kvjax.context_checkpoint import restore_context, save_context
from kvjax.generate import generate
from kvjax.method_spec import parse_method_spec
from kvjax.row_sharding import check_row_sharding, row_shardings
from tests.kvjax.test_chunked_prefill import assert_trees_equal
from tests.kvjax.test_compressed_context import RAGGED_QUESTIONS, assert_same_arrays
from tests.kvjax.test_method_matrix import PROMPTS
from tests.kvjax.tiny_decoder import tiny_decoder

SPECS = [
  "kivi:bits=4,group_size=16,residual=16",
  "snapkv:budget=16,window=4+kivi:bits=4,group_size=16,residual=16",
]
OWN_MODEL_EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "own_model_protocol.py"
ROOM = 5 + 4 - 1  # the longest question and every answer token but the last
two_devices = pytest.mark.skipif(jax.device_count() < 2, reason="needs two devices")


def _rows(count=2):
  mesh = Mesh(np.array(jax.devices()[:count]), ("data",))
  return NamedSharding(mesh, PartitionSpec("data"))


def _batch_axis_of(leaf):
  spec = tuple(leaf.sharding.spec)
  return spec.index("data") if "data" in spec else None


# Each layout of the layer caches (rows at axis 0 unrolled, axis 1 stacked for the scan) once,
# with each method: the two-device process runs these one after another.
@two_devices
@pytest.mark.parametrize("spec, layer_loop", [(SPECS[0], "unroll"), (SPECS[1], "scan")])
def test_a_context_compressed_by_rows_keeps_each_row_on_its_device(spec, layer_loop):
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  method = parse_method_spec(spec)
  on_one = compress_context(decoder, params, PROMPTS, cache_method=method, room=ROOM)
  spread = compress_context(
    decoder, params, PROMPTS, cache_method=method, room=ROOM, row_sharding=_rows()
  )
  # Codes and lengths bit for bit; floats within f32 rounding or one ulp of a narrower dtype. Each
  # device's program computes one row where the one-device program computes two, and XLA's CPU
  # matmuls may sum in another order for another shape. Seen on an AVX-512 Xeon: next-token
  # logits 2.4e-6 apart (jax 0.12 and 0.11.2), and with jax 0.11.2 two of 1024 bf16 window keys
  # one ulp apart. On an AMD EPYC all leaves were equal.
  assert_trees_equal(spread, on_one, float_atol=1e-5, float_rtol=1e-5, float_ulps=1)
  batch_axes = set()
  for leaf in jax.tree.leaves(spread):
    axis = _batch_axis_of(leaf)
    batch_axes.add(axis)
    if axis is None:
      assert leaf.sharding.is_fully_replicated
      continue
    assert leaf.shape[axis] == 2
    for shard in leaf.addressable_shards:  # device i holds row i, and nothing else
      row = shard.device.id
      np.testing.assert_array_equal(
        np.asarray(shard.data), np.take(np.asarray(leaf), [row], axis=axis)
      )
  # Layer caches keep rows at axis 0; caches stacked for the scan at axis 1.
  assert batch_axes >= ({0, 1} if layer_loop == "scan" else {0})

  tokens, count = continue_context(decoder, params, spread, RAGGED_QUESTIONS, max_new_tokens=4)
  expected = continue_context(decoder, params, on_one, RAGGED_QUESTIONS, max_new_tokens=4)
  np.testing.assert_array_equal(tokens, expected[0])
  np.testing.assert_array_equal(count, expected[1])


SHORT_PROMPTS = [list(range(1, 9)), list(range(2, 8))]


@two_devices
@pytest.mark.parametrize(
  "spec, prompts, room",
  [(SPECS[1], PROMPTS, ROOM), (SPECS[0], SHORT_PROMPTS, 0)],
  ids=["snapkv+kivi", "kivi-with-an-empty-segment"],  # shorter than the window, no room
)
def test_a_context_saved_by_rows_is_restored_by_rows_or_onto_one_device(
  spec, prompts, room, tmp_path
):
  decoder, params = tiny_decoder(layer_loop="scan")
  method = parse_method_spec(spec)
  spread = compress_context(
    decoder, params, prompts, cache_method=method, room=room, row_sharding=_rows()
  )
  save_context(tmp_path / "context", spread)
  longest = max(map(len, prompts))
  shape = dict(batch=2, prompt_len=longest, cache_method=method, room=room)
  template = context_template(decoder, params, **shape, row_sharding=_rows())
  for leaf, like in zip(jax.tree.leaves(template), jax.tree.leaves(spread)):
    assert leaf.sharding == like.sharding

  restored = restore_context(tmp_path / "context", template)
  assert_same_arrays(restored, spread)
  for leaf, like in zip(jax.tree.leaves(restored), jax.tree.leaves(spread)):
    assert leaf.sharding == like.sharding

  on_one = restore_context(tmp_path / "context", context_template(decoder, params, **shape))
  assert_same_arrays(on_one, spread)
  assert all(leaf.sharding.device_set == {jax.devices()[0]} for leaf in jax.tree.leaves(on_one))


@two_devices
def test_a_context_spread_by_rows_on_a_tpu_is_restored_by_rows_elsewhere(
  laid_out_for_a_tpu, tmp_path
):
  """A GEAR context compressed by rows where the compiled TPU kernel reads it (its segment in
  whole tiles of rows, its outliers in whole lane tiles: made so here), restored by rows into a
  template made elsewhere: re-laid, each row on its device, answering as compressed here."""
  decoder, params = tiny_decoder(layer_loop="scan")
  method = parse_method_spec("gear:bits=2,group_size=16,block=16,rank=2")
  compress = lambda: compress_context(
    decoder, params, PROMPTS, cache_method=method, room=ROOM, row_sharding=_rows()
  )
  laid_out_for_a_tpu()
  on_tpu = compress()
  laid_out_for_a_tpu.undo()
  here = compress()
  save_context(tmp_path / "context", on_tpu)
  shape = dict(batch=2, prompt_len=max(map(len, PROMPTS)), cache_method=method, room=ROOM)
  template = context_template(decoder, params, **shape, row_sharding=_rows())
  assert jax.tree.structure(on_tpu) != jax.tree.structure(template)  # the codec's slots differ
  restored = restore_context(tmp_path / "context", template)
  assert_same_arrays(restored, here)
  for leaf, like in zip(jax.tree.leaves(restored), jax.tree.leaves(here)):
    assert leaf.sharding == like.sharding
  ask = lambda ctx: continue_context(decoder, params, ctx, RAGGED_QUESTIONS, max_new_tokens=3)
  np.testing.assert_array_equal(ask(restored)[0], ask(here)[0])


@two_devices
@pytest.mark.parametrize("layer_loop", ["scan"])
def test_generate_by_rows_is_generate_on_one_device(layer_loop):
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  run = dict(max_new_tokens=5, cache_method=parse_method_spec(SPECS[1]))
  on_one = generate(decoder, params, PROMPTS, **run)
  spread = generate(decoder, params, PROMPTS, **run, row_sharding=_rows())
  np.testing.assert_array_equal(spread.tokens, on_one.tokens)
  np.testing.assert_array_equal(spread.num_generated, on_one.num_generated)
  assert spread.cache_bytes == on_one.cache_bytes
  with pytest.raises(ValueError, match=r"batch=3 rows cannot be split evenly"):
    generate(decoder, params, PROMPTS + [[1, 2]], **run, row_sharding=_rows())


@two_devices
@pytest.mark.parametrize("spec", ["full", "h2o_decode:budget=16"])
def test_generate_by_rows_with_a_decoder_that_ignores_positions(spec):
  """The bundled model's RoPE carries the rows' split from the positions to the caches; a user's
  decoder need not, and generate must still compile its decode for the prefill's placements."""
  toy = runpy.run_path(str(OWN_MODEL_EXAMPLE), run_name="own_model_protocol")
  decoder, params = toy["ToyDecoder"](), toy["toy_params"]()
  prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 6, [9, 10, 11]]
  run = dict(max_new_tokens=4, cache_method=parse_method_spec(spec), cache_dtype=jnp.float32)
  on_one = generate(decoder, params, prompts, **run)
  spread = generate(decoder, params, prompts, **run, row_sharding=_rows())
  np.testing.assert_array_equal(spread.tokens, on_one.tokens)


@two_devices
@pytest.mark.parametrize("prompt_len, max_new_tokens", [(8, 4), (15, 40)])
def test_generate_by_rows_with_prompts_shorter_than_the_kivi_window(prompt_len, max_new_tokens):
  """Before its first flush a KIVI segment holds nothing the prompts reached; the prefill must
  still leave it split by rows (not replicated, not split otherwise than the decode takes)."""
  decoder, params = tiny_decoder()
  prompts = [list(range(1, prompt_len + 1)), list(range(2, prompt_len + 2))]
  run = dict(max_new_tokens=max_new_tokens, cache_method=parse_method_spec(SPECS[0]))
  on_one = generate(decoder, params, prompts, **run)
  spread = generate(decoder, params, prompts, **run, row_sharding=_rows())
  np.testing.assert_array_equal(spread.tokens, on_one.tokens)
  # kvjax.generate the module (the package exports the function under that name).
  prefill_compiled, _ = importlib.import_module("kvjax.generate")._COMPILED.most_recent()
  _, caches = prefill_compiled.output_shardings
  for sharding in jax.tree.leaves(caches):
    assert "data" in tuple(sharding.spec), sharding  # every cache array has rows


@two_devices
def test_generate_follows_the_params_to_another_device():
  # generate memoises its compiled programs; a program compiled for params on one device
  # must not be reused for params on another.
  decoder, params = tiny_decoder()
  first, second = jax.devices()[:2]
  on_first = generate(decoder, jax.device_put(params, first), PROMPTS, max_new_tokens=4)
  on_second = generate(decoder, jax.device_put(params, second), PROMPTS, max_new_tokens=4)
  np.testing.assert_array_equal(on_second.tokens, on_first.tokens)


@two_devices
@pytest.mark.parametrize("layer_loop", ["unroll"])
def test_a_repeated_context_spread_by_rows_answers_its_questions_on_their_devices(layer_loop):
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  method = parse_method_spec(SPECS[1])
  context = compress_context(decoder, params, PROMPTS[:1], cache_method=method, room=ROOM)
  on_one = repeat_context(context, 2)
  spread = repeat_context(context, 2, row_sharding=_rows())
  assert_same_arrays(spread, on_one)
  for leaf in jax.tree.leaves(spread):
    axis = _batch_axis_of(leaf)
    assert axis is not None and leaf.shape[axis] == 2
    assert {shard.data.shape[axis] for shard in leaf.addressable_shards} == {1}
  tokens, count = continue_context(decoder, params, spread, RAGGED_QUESTIONS, max_new_tokens=4)
  expected = continue_context(decoder, params, on_one, RAGGED_QUESTIONS, max_new_tokens=4)
  np.testing.assert_array_equal(tokens, expected[0])
  np.testing.assert_array_equal(count, expected[1])
  with pytest.raises(ValueError, match=r"batch=3 rows cannot be split evenly"):
    repeat_context(context, 3, row_sharding=_rows())


@two_devices
@pytest.mark.parametrize("context_rows, layer_loop", [(1, "scan"), (2, "unroll")])
def test_a_shared_context_spread_by_rows_answers_as_on_one_device(context_rows, layer_loop):
  """Each row's own cache on its device; the context split with its copies when its rows
  divide over the devices, else (one document) held whole on each."""
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  method = parse_method_spec(SPECS[0])
  context = compress_context(decoder, params, PROMPTS[:context_rows], cache_method=method, room=0)
  questions = [[5, 9, 11, 4, 8], [7], [2, 2, 3], [1, 4]]
  share = lambda **sharding: share_context(
    decoder, context, len(questions) // context_rows, room=ROOM, **sharding
  )
  on_one, spread = share(), share(row_sharding=_rows())
  assert_same_arrays(spread, on_one)
  for run, spread_run in zip(on_one.caches, spread.caches, strict=True):
    stacked = hasattr(run, "stacked")
    layer, spread_layer = (run.stacked, spread_run.stacked) if stacked else (run, spread_run)
    for leaf in jax.tree.leaves(spread_layer.own):  # two of the four rows on each device
      assert {shard.data.shape[int(stacked)] for shard in leaf.addressable_shards} == {2}
    for leaf in jax.tree.leaves(spread_layer.context):
      rows_held = {shard.data.shape[int(stacked)] for shard in leaf.addressable_shards}
      assert rows_held == {1}, (context_rows, leaf.shape)  # its own row, or the only one
      assert leaf.sharding.is_fully_replicated == (context_rows == 1)
  for feed_chunk in (None, 3):
    run = lambda shared, feed_chunk=feed_chunk: continue_context(
      decoder, params, shared, questions, max_new_tokens=4, feed_chunk=feed_chunk
    )
    (tokens, count), (expected, expected_count) = run(spread), run(on_one)
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_array_equal(count, expected_count)
  if context_rows == 1:
    with pytest.raises(ValueError, match=r"batch=3 rows cannot be split evenly"):
      share_context(decoder, context, 3, room=ROOM, row_sharding=_rows())


@two_devices
def test_bad_row_shardings_are_refused_before_anything_runs():
  decoder, params = tiny_decoder()
  method = parse_method_spec(SPECS[0])
  mesh = _rows().mesh
  bad = [
    (jax.sharding.SingleDeviceSharding(jax.devices()[0]), "must be a jax.sharding.NamedSharding"),
    (NamedSharding(mesh, PartitionSpec()), r"spec must name the mesh axes of the batch axis"),
    (NamedSharding(mesh, PartitionSpec(None)), r"spec must name the mesh axes of the batch axis"),
    (NamedSharding(mesh, PartitionSpec("data", None)), r"batch axis alone"),
    (
      NamedSharding(mesh, PartitionSpec(PartitionSpec.UNCONSTRAINED)),
      r"must name mesh axes \(data\) for the batch axis; \[UNCONSTRAINED\] are not",
    ),
    (
      NamedSharding(jax.make_mesh((2,), ("data",)), PartitionSpec("data")),
      r"mesh axes \['data'\] are not of type Auto .* axis_types=",
    ),
  ]
  for sharding, message in bad:
    with pytest.raises(ValueError, match=message):
      compress_context(
        decoder, params, PROMPTS, cache_method=method, room=ROOM, row_sharding=sharding
      )
  with pytest.raises(ValueError, match=r"batch=3 rows cannot be split evenly over .* 2 devices"):
    context_template(
      decoder,
      params,
      batch=3,
      prompt_len=40,
      cache_method=method,
      room=ROOM,
      row_sharding=_rows(),
    )


def test_each_leaf_is_split_at_the_axis_that_follows_the_batch():
  rows = _rows(count=1)

  def shapes(batch):
    return {
      "rows_first": jax.ShapeDtypeStruct((batch, 3), jnp.float32),
      "stacked": jax.ShapeDtypeStruct((4, batch, 3), jnp.int8),
      "no_rows": jax.ShapeDtypeStruct((5,), jnp.int32),
    }

  shardings = row_shardings(shapes(2), shapes(3), rows)
  assert shardings["rows_first"].spec == PartitionSpec("data")
  assert shardings["stacked"].spec == PartitionSpec(None, "data")
  assert shardings["no_rows"].spec == PartitionSpec()
  with pytest.raises(ValueError, match=r"\['both'\]: shapes \(2, 2\) and \(3, 3\)"):
    both = {"both": jax.ShapeDtypeStruct((2, 2), jnp.float32)}
    row_shardings(both, {"both": jax.ShapeDtypeStruct((3, 3), jnp.float32)}, rows)
  check_row_sharding(rows, 7)  # one device takes any number of rows
  explicit = NamedSharding(jax.make_mesh((1,), ("data",)), PartitionSpec("data"))
  with pytest.raises(ValueError, match=r"mesh axes \['data'\] are not of type Auto"):
    check_row_sharding(explicit, 2)


@pytest.mark.skipif(jax.device_count() >= 2, reason="the tests above ran here")
def test_the_two_device_tests_pass_on_two_host_devices():
  repository = pathlib.Path(__file__).parents[2]
  # The two-device process starts from the caller's XLA_FLAGS (kept by tests/conftest.py) and
  # takes the caller's compile setting. With conftest's fast-compile flags, the split and whole
  # programs once differed in the last bit of a float (4.8e-7, AMD EPYC): floats are compared
  # within rounding since (`assert_trees_equal`). The fast flags took this test from 154 s to
  # 98-106 s in the full suite (2026-11-27; it passed on jax 0.12.0.1 and 0.11.2).
  flags = os.environ.get("KVJAX_TESTS_CALLER_XLA_FLAGS", "")
  flags = f"{flags} --xla_force_host_platform_device_count=2".strip()
  settings = {
    "XLA_FLAGS": flags,
    "KVJAX_TESTS_CALLER_XLA_FLAGS": flags,
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": str(repository),
  }
  run = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", __file__],
    cwd=repository,
    env=dict(os.environ, **settings),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
  # Every test of this file but this one ran (none skipped) in the two-device process.
  assert "16 passed, 1 skipped" in run.stdout, run.stdout[-1000:]
