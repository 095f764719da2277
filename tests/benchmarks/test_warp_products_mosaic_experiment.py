"""benchmarks/warp_products_mosaic_experiment.py without a GPU: the kernel lowers for sm_90, and
its inputs and the adding-up of its raw outputs agree with the CUDA experiment's model."""

import jax
import numpy as np
import pytest

from tests.benchmarks.benchmark_modules import load_benchmark

mosaic = load_benchmark("warp_products_mosaic_experiment")
experiment = load_benchmark("warp_products_experiment")
emulation = load_benchmark("warp_products_emulation")


@pytest.mark.parametrize(
  "key_product,statistics,tiles",
  [
    ("per_warp", "by_lane", 1),
    ("per_warp", "selects", 1),
    ("stacked", "by_lane", 1),
    ("stacked", "selects", 1),
    ("per_warp", "by_lane", 2),
  ],
)
def test_the_kernel_lowers_for_sm90(key_product, statistics, tiles):
  """The whole loop (TMA ring; the key product per warp by inline mma.sync, or by plgpu.mma on
  MMA_LHS codes against both groups' staged Q'; the softmax as array code; the statistics by lane
  or by selects; the per-warp value product's inline movmatrix / ldmatrix / mma.sync) through
  Mosaic GPU's layout inference and lowering."""
  kernel, shapes = mosaic.experiment_kernel(4, 256, 2, key_product, statistics, tiles)
  text = jax.jit(kernel).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize(
  "settings,message",
  [
    (dict(key_product="wgmma"), "key_product='wgmma' is not supported; allowed:"),
    (dict(statistics="pairs"), "statistics='pairs' is not supported; allowed:"),
    (dict(tiles=4), r"tiles=4 is not supported; allowed: \(1, 2\)"),
    (dict(tiles=2, key_product="stacked"), "tiles=2 needs key_product='per_warp'"),
  ],
)
def test_the_kernel_refuses_unknown_settings(settings, message):
  with pytest.raises(ValueError, match=message):
    mosaic.experiment_kernel(4, 256, 2, **settings)


def lane_partials(arrays, splits, tiles):
  """(partial [R, S, 512, 8], totals [R, S, 3, 8]) as the kernel holds them before its epilogue,
  from the lane-by-lane states of the same design: accumulator row 64 p + 16 w + g + 8 h, column
  2 t + c is lane (g, t) of warp w's m-tile p (the other slot's columns get noise: the epilogue
  must drop them); a column's sums are those of the lanes that hold it."""
  rows = arrays["key_words"].shape[0]
  rng = np.random.default_rng(9)
  partial = rng.normal(size=(rows, splits, 512, 8)).astype(np.float32)
  totals = np.zeros((rows, splits, 3, 8), np.float32)
  g, t = emulation.GROUP_ID, emulation.THREAD_IN_GROUP
  for r in range(rows):
    for s in range(splits):
      for w, state in enumerate(emulation.warp_states(arrays, r, s, splits, tiles)):
        for p in range(8):
          for i in range(4):
            row = 64 * p + 16 * w + g + 8 * (i // 2)
            mine = (g % 2) == (t // 2)  # the accumulator row's slot is its half-word's parity
            partial[r, s, row[mine], 2 * t[mine] + i % 2] = state["output"][p][mine, i]
        for c in range(2):
          np.add.at(totals[r, s, 0], 2 * t + c, state["sums"][:, c])
          for b in range(2):
            np.add.at(totals[r, s, 1 + b], 2 * t + c, state["min_sums"][:, b, c])
  return partial, totals


@pytest.mark.parametrize("tiles", [1, 2])
def test_finish_takes_the_kernels_outputs_to_the_models(tiles):
  """The out the epilogue writes (channel-major; its sum over warps is
  `test_warp_products_mosaic_inline`'s) and the per-column totals as the lanes hold them."""
  arrays = experiment.random_arrays(2, 512, 2, seed=11)
  model_out, model_sums = experiment.model_outputs(arrays, 2, tiles)
  _, totals = lane_partials(arrays, 2, tiles)
  out, sums = mosaic.finish(np.swapaxes(model_out, 2, 3).astype(np.float32), totals)
  np.testing.assert_array_equal(
    out, np.swapaxes(np.swapaxes(model_out, 2, 3).astype(np.float32), 2, 3)
  )
  np.testing.assert_allclose(sums, model_sums, rtol=0, atol=1e-6 * np.abs(model_sums).max())


def test_prepare_puts_the_queries_in_the_key_operands_word_order():
  from pallas_kernels.subnormal_codes import code_exponent
  from pallas_kernels.word_operand_order import word_order_channels

  arrays = experiment.random_arrays(2, 256, 2, seed=12)
  lengths, queries, *_, key_bias, _, _, _, reference = mosaic.prepare(arrays, 2)
  assert queries.shape == (2, 128, 8) and queries.dtype == np.uint16
  channels = word_order_channels(128, 2)
  for position in (0, 5, 77, 127):
    channel = channels[position]
    expected = arrays["queries"][:, :, channel] * 2.0 ** (69 - code_exponent(channel, 128, 2))
    np.testing.assert_array_equal(
      experiment.bf16_values(queries[:, position]),
      experiment.bf16_values(experiment.bf16_bits(np.tile(expected, (1, 2)))),
    )
  np.testing.assert_array_equal(key_bias[..., 4:], arrays["key_bias"])  # rows 4-7 repeat 0-3
  np.testing.assert_array_equal(reference[..., :4], arrays["reference"])
  np.testing.assert_array_equal(lengths, arrays["lengths"])
