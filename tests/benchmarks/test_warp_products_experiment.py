"""The accounting of benchmarks/warp_products_experiment.py and the sm_90 occupancy rule it and
mosaic_static_cost.py share (no nvcc, no GPU)."""

import pathlib

import pytest

from tests.benchmarks.benchmark_modules import BENCHMARKS as _BENCHMARKS
from tests.benchmarks.benchmark_modules import load_benchmark as _load

experiment = _load("warp_products_experiment")
occupancy = _load("sm90_occupancy")


def test_per_program_tokens_spreads_the_refill_over_the_four_warps():
  # a 522-instruction loop whose refill arm is 115, two tiles per warp
  counts = experiment.per_program_tokens(522, 407, tiles=2)
  assert counts["copies_arm"] == 115
  assert counts["mean"] == pytest.approx((407 + 115 / 4) / 2)
  assert (counts["issuing_warp"], counts["other_warps"]) == (261.0, 203.5)
  one_tile = experiment.per_program_tokens(361, 257, tiles=1)
  assert one_tile["mean"] == pytest.approx(257 + 104 / 4)


def test_per_program_tokens_refuses_a_shorter_loop_with_the_copies():
  with pytest.raises(ValueError, match="shorter than without"):
    experiment.per_program_tokens(300, 310, tiles=1)


@pytest.mark.parametrize(
  "variant,message",
  [
    ({"TILE": 2}, "'TILE' is not a setting of the experiment; allowed: TILES"),
    ({"TILES": 3}, r"TILES=3 is not supported; allowed: \(1, 2\)"),
    ({"COPIES": 0}, "'COPIES' is not a setting"),  # the script sets it itself, for the arm
  ],
)
def test_check_variant_names_the_setting_and_the_allowed_values(variant, message):
  with pytest.raises(ValueError, match=message):
    experiment.check_variant(variant)


def test_default_variants_are_valid_and_set_no_copies():
  for variant in experiment.VARIANTS:
    experiment.check_variant(variant)
    assert "COPIES" not in variant


def test_every_define_has_a_default_in_the_source():
  source = pathlib.Path(experiment.SOURCE).read_text()
  for name in (*experiment.DEFINES, "COPIES"):
    assert f"#ifndef {name}\n#define {name} " in source


@pytest.mark.parametrize(
  "registers,shared_bytes,warpgroups,programs",
  [
    (110, 56320, 1, 4),  # C with matrix loads (v43): registers allow 4 (112 granted)
    (121, 40550, 1, 4),  # the experiment at two tiles: 128 granted, 4 by registers
    (129, 20000, 1, 3),  # one register over 128: 136 granted, 3
    (96, 225280 // 5, 5, 1),  # v42's five warpgroups a program: one program of 5
    (64, 60000, 1, 3),  # shared memory binds: 233472 // 61024
    (32, 1000, 1, 16),  # warp slots bind: 64 warps / 4
  ],
)
def test_programs_per_sm(registers, shared_bytes, warpgroups, programs):
  assert occupancy.programs_per_sm(registers, shared_bytes, warpgroups) == programs


def test_planar_codes_match_the_cache_packing():
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.bit_packing import pack_codes

  codes = np.random.default_rng(1).integers(0, 4, (3, 5, 128))
  words = np.asarray(pack_codes(jnp.asarray(codes), 2))
  assert words.shape == (3, 5, experiment.WORDS_PER_TOKEN)
  np.testing.assert_array_equal(experiment.planar_codes(words), codes)


def test_bf16_bits_round_to_nearest_even():
  import numpy as np

  values = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -2.5, 2**-130], np.float32)
  bits = experiment.bf16_bits(values)
  np.testing.assert_array_equal(bits[:4], [0x3F80, 0x3F80, 0x3F82, 0xC020])
  assert experiment.bf16_values(bits)[4] == np.float32(2**-130)  # a bf16 subnormal, exact


@pytest.mark.parametrize(
  "tokens,splits,tiles,expected",
  [(32768, 32, 2, 1024), (32768, 33, 2, 1024), (2048, 2, 2, 1024), (2048, 3, 1, 704)],
)
def test_split_tokens_are_whole_blocks(tokens, splits, tiles, expected):
  assert experiment.split_tokens(tokens, splits, tiles) == expected


def test_kernel_inputs_follow_the_experiments_struct():
  import re

  source = pathlib.Path(experiment.SOURCE).read_text()
  struct = source[
    source.index("struct Inputs {") : source.index("};", source.index("struct Inputs {"))
  ]
  members = re.findall(r"(\w+);", struct)
  assert members == [name for name, _ in experiment.KernelInputs._fields_]
  assert experiment.KernelInputs.__dict__["tokens"].offset == 88
  assert len(bytes(experiment.KernelInputs())) == 96


def test_model_outputs_are_attention_over_the_dequantized_cache():
  """The numpy model the GPU check compares with: scores q . (k_scale code) + bias - reference
  in base 2, out = sum_t 2^score v_scale code_v with each channel's value-group scale, left
  times 2^(64 + bit - 133) per channel, as the experiment leaves it; sums of p and of p v_min per
  value group; each split over its own tokens, none past a row's length. Within the bf16
  roundings of Q' and P'."""
  import numpy as np

  rows, tokens, splits, tiles = 3, 512, 2, 2
  arrays = experiment.random_arrays(rows, tokens, splits, seed=3)
  out, sums = experiment.model_outputs(arrays, splits, tiles)
  keys = experiment.planar_codes(arrays["key_words"])
  values = experiment.planar_codes(arrays["value_words"])
  k_scale = experiment.bf16_values(arrays["k_scale"]).astype(np.float64)
  v_scale = experiment.bf16_values(arrays["v_scale"]).astype(np.float64)
  v_min = experiment.bf16_values(arrays["v_min"]).astype(np.float64)
  per_split = experiment.split_tokens(tokens, splits, tiles)
  exponent = experiment.code_exponents()
  channel_group = np.arange(experiment.HEAD_DIM) // experiment.GROUP
  for r in range(rows):
    for s in range(splits):
      t = np.arange(s * per_split, min((s + 1) * per_split, arrays["lengths"][r]))
      group = t // experiment.GROUP
      logits = np.einsum(
        "gc,tc->gt", arrays["queries"][r].astype(np.float64), k_scale[r][group] * keys[r, t]
      )
      logits += arrays["key_bias"][r][group].T - arrays["reference"][r, s][:, None]
      p = np.exp2(logits)
      dequantized = v_scale[r][channel_group][:, t].T * values[r, t]  # [tokens, 128]
      expected = p @ dequantized * 2.0 ** (64 + exponent - 133.0)
      np.testing.assert_allclose(out[r, s], expected, rtol=0, atol=3e-2 * np.abs(expected).max())
      np.testing.assert_allclose(sums[r, s, :, 0], p.sum(axis=1), rtol=3e-2)
      np.testing.assert_allclose(
        sums[r, s, :, 1:], p @ v_min[r][:, t].T, rtol=0, atol=3e-2 * p.sum()
      )
  assert arrays["lengths"][-1] == tokens - 100  # the short row's tail is outside every split


class _FakeDriver:
  """`cuda_driver.Driver`'s calls over numpy buffers; a launch computes `model_outputs` from what
  the kernel's struct points at (optionally with an error added), a timed run takes 1 ms."""

  def __init__(self, error=0.0):
    self.buffers, self.error, self.launches = {}, error, []

  def name(self):
    return "fake"

  def load_function(self, cubin, name):
    assert cubin.startswith(b"cubin") and name == "warp_products"
    return name

  def alloc(self, nbytes):
    pointer = 4096 * (len(self.buffers) + 1)
    # the timed shapes' arrays (up to 268 MB) are never read back: no memory behind them
    self.buffers[pointer] = bytearray(nbytes) if nbytes < 2**24 else None
    return pointer

  def free(self, pointer):
    del self.buffers[pointer]

  def fill32(self, pointer, value, count):
    import numpy as np

    if self.buffers[pointer] is not None:
      np.frombuffer(self.buffers[pointer], np.uint32)[:count] = value

  def upload(self, pointer, array):
    self.buffers[pointer][: array.nbytes] = array.tobytes()

  def download(self, array, pointer):
    array.view("u1").reshape(-1)[:] = memoryview(self.buffers[pointer])[: array.nbytes]

  def copy(self, destination, source, nbytes):
    self.buffers[destination][:nbytes] = self.buffers[source][:nbytes]

  def launch(self, function, grid, block, parameters):
    import numpy as np

    self.launches.append((grid, block))
    rows, splits = grid[0], grid[1]
    assert block == (128, 1, 1) and splits == parameters.splits
    if parameters.tokens > 4096:  # the timing's constant inputs: no model, as on the GPU
      return
    shapes = experiment.array_shapes(rows, parameters.tokens, splits)
    arrays = {
      name: np.frombuffer(self.buffers[getattr(parameters, name)], dtype)[
        : int(np.prod(shape))
      ].reshape(shape)
      for name, (dtype, shape) in shapes.items()
    }
    out, sums = experiment.model_outputs(arrays, splits, tiles=2)
    arrays["out"][...] = out * (1 + self.error)
    arrays["sums"][...] = sums

  def synchronize(self):
    pass

  def milliseconds(self, work, repeat):
    for _ in range(min(repeat, 2)):
      work()
    return float(repeat)


@pytest.fixture
def built(tmp_path, monkeypatch):
  """A built directory of one TILES=2 cubin (its bytes a stand-in) and a copy rate of 4000 GB/s;
  returns (the directory, its manifest)."""
  import json

  (tmp_path / "variant0.cubin").write_bytes(b"cubin of TILES=2")
  manifest = {
    "source_sha256": experiment.source_digest(),
    "cubins": [{"variant": {"TILES": 2}, "cubin": "variant0.cubin"}],
  }
  (tmp_path / "manifest.json").write_text(json.dumps(manifest))
  monkeypatch.setattr(experiment, "copy_rate", lambda driver: 4000.0)
  return tmp_path, manifest


def test_run_on_gpu_checks_times_and_reports_against_the_copy_rate(built):
  driver = _FakeDriver()
  [row] = experiment.run_on_gpu(str(built[0]), driver=driver)
  assert row["out_error"] == 0 and row["sums_error"] < 1e-6 and not row["nan"]
  assert row["check_passed"]
  assert row["us"] == pytest.approx(1e3)  # 1 ms per launch from the fake's events
  assert row["bytes"] == experiment.bytes_read(64, 32768, 32)
  assert sorted(row["contexts"]) == [8192, 32768, 131072]
  assert row["contexts"][131072]["bytes"] == experiment.bytes_read(64, 131072, 128)
  assert row["percent_of_copy"] == pytest.approx(100 * row["bytes"] / 1e-3 / 1e9 / 4000)
  assert driver.launches[0] == ((4, 2, 1), (128, 1, 1))  # the check's small shape first
  for splits in (8, 32, 128):  # the timed contexts, in splits of 1024 tokens
    assert ((64, splits, 1), (128, 1, 1)) in driver.launches
  assert not driver.buffers  # everything freed


def test_run_on_gpu_reports_a_wrong_kernel_and_refuses_stale_cubins(built):
  import json

  tmp_path, manifest = built
  [row] = experiment.run_on_gpu(str(tmp_path), driver=_FakeDriver(error=0.25))
  assert row["out_error"] == pytest.approx(0.25, rel=1e-3) and not row["check_passed"]
  manifest["source_sha256"] = "0" * 64
  (tmp_path / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(ValueError, match="built from another source; rebuild them"):
    experiment.run_on_gpu(str(tmp_path), driver=_FakeDriver())


def test_copy_rate_counts_bytes_read_and_written():
  rate = experiment.copy_rate(_FakeDriver(), nbytes=1 << 12, iters=4, repeats=1)
  # the fake's events give 1 ms per copy: 2 x 4 KB per ms
  assert rate == pytest.approx(2 * 4096 / 1e-3 / 1e9)


def test_the_committed_cubins_were_built_from_this_source():
  """benchmarks/warp_products_cubins (what `gpu_session.sh` runs on the GPU machine, which may
  have no nvcc) must be rebuilt (`--build`) whenever the experiment's source changes."""
  import json

  directory = _BENCHMARKS / "warp_products_cubins"
  manifest = json.loads((directory / "manifest.json").read_text())
  assert manifest["source_sha256"] == experiment.source_digest()
  for entry in manifest["cubins"]:
    experiment.check_variant(entry["variant"])
    assert (directory / entry["cubin"]).read_bytes()[:4] == b"\x7fELF"


emulation = _load("warp_products_emulation")


@pytest.mark.parametrize("tiles", [1, 2])
def test_lane_by_lane_emulation_gives_the_model(tiles):
  """The experiment's loop run lane by lane (its registers, the PTX fragment layouts of
  mma.m16n8k16, movmatrix and ldmatrix.trans) equals what the model says it computes, the
  short row's tail included. Seven mutations of the transcription (a swapped byte-permute
  selector, the epilogue's channel of a row, the bias of the wrong row, the matrix loads' token
  rows, the value group of a slot, the slot a row reads, the B operand of an m-tile) each put
  the output or the sums off by 9-101%."""
  import numpy as np

  arrays = experiment.random_arrays(2, 512, 2, seed=5)
  out, sums = experiment.model_outputs(arrays, 2, tiles)
  emulated_out, emulated_sums = emulation.emulate_outputs(arrays, 2, tiles)
  np.testing.assert_allclose(emulated_out, out, rtol=0, atol=1e-6 * np.abs(out).max())
  # f32 sums in another order; the v_min sums cancel, so bounded against the largest sum
  np.testing.assert_allclose(emulated_sums, sums, rtol=0, atol=1e-6 * np.abs(sums).max())


def test_ldmatrix_model_reads_the_rows_each_lane_addresses():
  """The emulation's `ldmatrix_x4_trans` is v43's model of the instruction over the rows the
  lanes address: any row and any 8-element column start per lane."""
  import numpy as np

  from pallas_kernels.value_operand_matrix_loads import transposed_matrix_registers

  rng = np.random.default_rng(2)
  half_words = rng.integers(0, 2**16, (40, 16)).astype(np.uint16)
  rows, columns = rng.permutation(40)[:32], rng.integers(0, 9, 32)
  addressed = np.stack([half_words[r, c : c + 8] for r, c in zip(rows, columns)])
  np.testing.assert_array_equal(
    emulation.ldmatrix_x4_trans(half_words, rows, columns),
    transposed_matrix_registers(addressed, 0),
  )
  # lanes addressing a [32, 16] block's rows in order at one column: v43's first_column
  for first_column in (0, 8):
    np.testing.assert_array_equal(
      emulation.ldmatrix_x4_trans(half_words[:32], np.arange(32), np.full(32, first_column)),
      transposed_matrix_registers(half_words[:32], first_column),
    )


def test_mma_model_multiplies_the_matrices_its_fragments_hold():
  import numpy as np

  rng = np.random.default_rng(4)
  a_matrix = rng.integers(-8, 8, (16, 16)).astype(np.float32)
  b_matrix = rng.integers(-8, 8, (16, 8)).astype(np.float32)
  g, t = emulation.GROUP_ID, emulation.THREAD_IN_GROUP
  a = np.stack(
    [
      emulation.pack_bf16_pair(
        a_matrix[g + 8 * (j % 2), 2 * t + 8 * (j // 2)],
        a_matrix[g + 8 * (j % 2), 2 * t + 8 * (j // 2) + 1],
      )
      for j in range(4)
    ],
    axis=1,
  )
  b = np.stack(
    [
      emulation.pack_bf16_pair(b_matrix[2 * t + 8 * j, g], b_matrix[2 * t + 8 * j + 1, g])
      for j in (0, 1)
    ],
    axis=1,
  )
  d = emulation.mma_m16n8k16(a, b, np.ones((32, 4), np.float32))
  product = a_matrix @ b_matrix + 1
  for j in range(4):
    np.testing.assert_array_equal(d[:, j], product[g + 8 * (j // 2), 2 * t + j % 2])


def test_movmatrix_twice_is_the_identity_and_byte_perm_selects_halves():
  import numpy as np

  registers = np.random.default_rng(6).integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32)
  once = emulation.movmatrix_trans(registers)
  assert not np.array_equal(once, registers)
  np.testing.assert_array_equal(emulation.movmatrix_trans(once), registers)
  a, b = np.array([0x11112222], np.uint32), np.array([0x33334444], np.uint32)
  assert emulation.byte_perm(a, b, 0x5410)[0] == 0x44442222  # the low halves
  assert emulation.byte_perm(a, b, 0x7632)[0] == 0x33331111  # the high halves
