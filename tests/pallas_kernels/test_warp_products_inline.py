"""The per-warp products' inline code (`pallas_kernels.warp_key_product`, `warp_value_product`:
the "warp" Mosaic GPU kernel's, first written for benchmarks/warp_products_mosaic_experiment.py)
run on numpy arrays over the warpgroup's 128 threads (`inline_code_emulation`), its PTX
instructions by the lane-by-lane models of `warp_products_emulation` and its registers placed by
Mosaic GPU's own tilings of the layouts it declares: each function's result against plain matrix
products, and so is the jnp counterpart interpret mode runs instead (`*_emulated`)."""

import numpy as np
import pytest

from pallas_kernels import value_operand_matrix_loads, warp_key_product, warp_value_product
from tests.benchmarks.benchmark_modules import load_benchmark
from tests.pallas_kernels.inline_code_emulation import (
  CapturedArray,
  as_uint,
  emulate_inline_code,
  register_placements,
  transposed_matrix_loads,
)

experiment = load_benchmark("warp_products_experiment")
emulation = load_benchmark("warp_products_emulation")


class _Array:
  """A FragmentedArray's stand-in with numpy registers: 16-bit pairs as uint32 over 128 threads,
  f32 pairs as float32 [128, 2]."""

  def __init__(self, registers, shape=None):
    self.registers, self.shape = registers, shape


def _registers(layout, matrix: np.ndarray) -> _Array:
  """`matrix` (uint16 bf16 bits, or float32) as `layout`'s registers."""
  placements = register_placements(layout, matrix.shape)
  registers = np.empty(layout.registers_shape(matrix.shape), dtype=object)
  for index, places in placements.items():
    if matrix.dtype == np.uint16:
      register = np.zeros(128, np.uint32)
      for thread, position, element in places:
        register[thread] |= np.uint32(matrix[element]) << np.uint32(16 * position)
    else:
      register = np.zeros((128, 2), np.float32)
      for thread, position, element in places:
        register[thread, position] = matrix[element]
    registers[index] = register
  return _Array(registers)


def _matrix(layout, shape, registers) -> np.ndarray:
  """float32 [shape] from f32-pair registers ([128, 2] each) in `layout`."""
  matrix = np.full(shape, np.nan, np.float32)
  for index, places in register_placements(layout, shape).items():
    for thread, position, element in places:
      matrix[element] = registers[index][thread, position]
  return matrix


def _per_warp(function, *registers, results):
  """A warp-wide instruction over 128 threads: `function` on each warp's [32, ...] slices."""
  outputs = [np.zeros((128,) + np.shape(r)[1:], dtype) for r, dtype in results]
  for warp in range(4):
    lanes = slice(32 * warp, 32 * warp + 32)
    values = function(*[np.asarray(r)[lanes] for r in registers])
    values = values if isinstance(values, tuple) else (values,)
    for output, value in zip(outputs, values):
      output[lanes] = value
  return outputs


def _emulated_ptx(shared: np.ndarray):
  """`mgpu_utils.inline_ptx` for the instructions the experiment emits, over 128 threads;
  `shared` the bytes addressed from 0."""

  def inline_ptx(ptx, *args, result_types=None, has_side_effects=False, convergent=False):
    if ptx.startswith("prmt.b32"):
      selector = int(ptx.split(",")[-1].strip(" ;"), 16)
      return emulation.byte_perm(
        as_uint(args[0]).astype(np.uint32), as_uint(args[1]).astype(np.uint32), selector
      )
    assert convergent, f"a warp-wide instruction must be convergent: {ptx}"
    if ptx.startswith("movmatrix"):
      (moved,) = _per_warp(
        emulation.movmatrix_trans, as_uint(args[0]).astype(np.uint32), results=[((128,), np.uint32)]
      )
      return moved
    if ptx.startswith("ldmatrix.sync.aligned.m8n8.x4.trans"):
      assert has_side_effects
      return transposed_matrix_loads(shared, args[0])
    if ptx.startswith("ldmatrix.sync.aligned.m8n8.x2.trans"):
      # lanes 0-15 of each warp address the two matrices' rows; the others' addresses are not
      # read: the x4 model with lanes 16-31 given lanes 0-15's, its first two registers
      assert has_side_effects
      address = as_uint(args[0]).reshape(4, 32).copy()
      address[:, 16:] = address[:, :16]
      return transposed_matrix_loads(shared, address.reshape(128))[:2]
    if ptx.startswith("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"):
      a = np.stack([as_uint(x).astype(np.uint32) for x in args[:4]], axis=1)
      b = np.stack([as_uint(x).astype(np.uint32) for x in args[4:6]], axis=1)
      c = np.stack([np.broadcast_to(np.asarray(x, np.float32), (128,)) for x in args[6:10]], axis=1)
      d = np.zeros((128, 4), np.float32)
      for warp in range(4):
        lanes = slice(32 * warp, 32 * warp + 32)
        d[lanes] = emulation.mma_m16n8k16(a[lanes], b[lanes], c[lanes])
      return [d[:, i] for i in range(4)]
    raise AssertionError(f"unexpected PTX: {ptx}")

  return inline_ptx


@pytest.fixture
def emulated(monkeypatch):
  """The inline code's ops on numpy arrays; returns a function that installs the shared bytes."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jaxlib.mlir.dialects import arith, llvm, vector

  emulate_inline_code(monkeypatch, first_thread=0, load=None)
  monkeypatch.setattr(arith, "shrui", lambda a, b: as_uint(a) >> as_uint(b))
  monkeypatch.setattr(arith, "ori", lambda a, b: as_uint(a) | as_uint(b))
  monkeypatch.setattr(arith, "extui", lambda _, value: as_uint(value))
  monkeypatch.setattr(arith, "constant", lambda _, value: np.full(128, value, np.float32))
  monkeypatch.setattr(
    arith, "addf", lambda a, b: np.asarray(a, np.float32) + np.asarray(b, np.float32)
  )

  def mulf(a, b):
    if np.asarray(a).dtype.kind == "f":  # f32 values
      return np.asarray(a, np.float32) * np.asarray(b, np.float32)
    # bf16 pairs in uint32 registers: HMUL2
    return emulation.hmul2_bf16(as_uint(a).astype(np.uint32), as_uint(b).astype(np.uint32))

  monkeypatch.setattr(arith, "mulf", mulf)
  monkeypatch.setattr(
    vector,
    "extract",
    lambda register, dynamic_position, static_position: register[:, static_position[0]],
  )
  monkeypatch.setattr(llvm, "mlir_undef", lambda _: np.zeros((128, 2), np.float32))

  def insertelement(register, value, position):
    register = np.array(register, np.float32)
    register[:, int(np.asarray(position).ravel()[0])] = value
    return register

  monkeypatch.setattr(llvm, "insertelement", insertelement)

  def byte_offset(pointer, offsets, element_type):
    assert str(element_type) == "i8", "offsets are in bytes"
    return as_uint(pointer) + as_uint(offsets[0])

  monkeypatch.setattr(mgpu_utils, "getelementptr", byte_offset)

  def install(shared: np.ndarray, bases: dict):
    """`shared` the bytes every address reads; a ref passed to the inline code is a key of
    `bases`, its byte offset in `shared`."""
    monkeypatch.setattr(mgpu_utils, "memref_ptr", lambda ref: as_uint(np.full(128, bases[ref])))
    monkeypatch.setattr(mgpu_utils, "inline_ptx", _emulated_ptx(shared))

    def load(element_type, address):
      address = np.asarray(address, np.int64)
      kind = str(element_type)
      if kind == "f32":
        return shared.view(np.float32)[address // 4]
      if kind == "i32":
        assert np.all(address % 4 == 0), "a 32-bit load must be aligned"
        return shared.view(np.uint32)[address // 4]
      if kind == "i16":
        assert np.all(address % 2 == 0), "a 16-bit load must be aligned"
        return as_uint(shared.view(np.uint16)[address // 2])
      assert kind == "vector<2xi32>", kind
      words = shared.view(np.uint32)
      return np.stack([words[address // 4], words[address // 4 + 1]], axis=1)

    monkeypatch.setattr(llvm, "load", load)

  # every argument passed through (the harness's own takes one)
  monkeypatch.setattr(
    plgpu, "inline_mgpu", lambda **_: lambda body: lambda *args: body(None, *args)
  )
  return install


def _ring_bytes(words: np.ndarray, bits: int, head_dim: int, swizzled: bool) -> np.ndarray:
  """A value ring slot's bytes holding `words` [tokens, W]: as they are, or where the ring's TMA
  swizzle (`value_operand_matrix_loads`) puts each byte."""
  logical = words.view(np.uint8).ravel()
  swizzle = value_operand_matrix_loads.ring_swizzle_bytes(head_dim, bits) if swizzled else 0
  placed = np.zeros_like(logical)
  placed[value_operand_matrix_loads.swizzled_offsets(np.arange(logical.size), swizzle)] = logical
  return placed


def _value_product_of_words(probs, acc, tile, tiles, bits, head_dim, swizzled):
  """`value_product_per_warp` of P' `probs` (uint16 bf16 bits [64, 8] each) and `acc` (float32)
  on the ring slot installed as "words"."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jaxlib.mlir import ir

  with ir.Context(), ir.Location.unknown():
    return warp_value_product.value_product_per_warp(
      [_registers(fa.WGMMA_LAYOUT, p) for p in probs],
      "words",
      _registers(fa.WGMMA_LAYOUT, acc),
      tile,
      tiles,
      bits,
      head_dim,
      swizzled=swizzled,
    )


def _bf16(rng, shape, low, high):
  return experiment.bf16_bits(rng.uniform(low, high, shape).astype(np.float32))


@pytest.mark.parametrize(
  "tiles,bits,head_dim", [(1, 2, 128), (2, 2, 128), (2, 4, 128), (2, 4, 64), (2, 2, 64), (1, 2, 64)]
)
def test_key_product_per_warp_is_each_warps_tokens_against_its_groups_scaled_queries(
  emulated, tiles, bits, head_dim
):
  """`own_token_words` -> `stage_words_in_word_order` (MMA_LHS) -> `key_product_per_warp` (at
  head_dim 64 with 2-bit codes `own_token_codes_one_word_per_lane` instead of the first two):
  scores [64, 8] per tile, row 16 w + r being token 16 tiles w + 16 tile + r, equal to its codes
  (in the word order, each a pattern code x 2^(bit - 133)) against Q' = bf16(query pairs x the
  key scales of its own group, warp w tiles / 2), plus that group's bias over 2^64."""
  import jax.numpy as jnp
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jaxlib.mlir import ir

  from pallas_kernels.bit_packing import pack_codes
  from pallas_kernels.subnormal_codes import code_exponent
  from pallas_kernels.word_operand_order import stage_words_in_word_order, word_order_channels

  rng = np.random.default_rng(21 + tiles + bits + head_dim)
  span, groups = 64 * tiles, 2 * tiles
  codes = rng.integers(0, 2**bits, (span, head_dim))
  words = np.asarray(pack_codes(jnp.asarray(codes), bits))
  channels = word_order_channels(head_dim, bits)
  exponent = code_exponent(channels, head_dim, bits)
  # queries by position, times 2^(69 - bit) as `prepare` scales them (products stay normal)
  queries = experiment.bf16_bits(
    (rng.uniform(-2.0, 2.0, (head_dim, 8)) * 2.0 ** (69 - exponent)[:, None]).astype(np.float32)
  )
  scales = _bf16(rng, (groups, head_dim), 0.01, 0.1)  # [group, channel]
  bias = rng.uniform(-1.0, 1.0, (groups, 8)).astype(np.float32)
  shared = np.concatenate(
    [words.view(np.uint8).ravel(), scales.view(np.uint8).ravel(), bias.view(np.uint8).ravel()]
  )
  bases = {"words": 0, "scales": words.nbytes, "bias": words.nbytes + scales.nbytes}
  emulated(shared, bases)
  layouts = mgpu.MMALayouts(jnp.bfloat16, m_warps=4)
  with ir.Context(), ir.Location.unknown():
    keys = []
    for tile in range(tiles):
      if words.shape[1] == 4:
        keys.append(warp_key_product.own_token_codes_one_word_per_lane("words", tile, tiles, bits))
        continue
      warp_key_product.own_token_words("words", tile, tiles, bits, head_dim)
      words_array = _Array(CapturedArray.last.registers, shape=(64, words.shape[1]))
      keys.append(stage_words_in_word_order(words_array, bits, operand_layout="mma_lhs"))
    results = warp_key_product.key_product_per_warp(
      keys, _registers(layouts.rhs, queries), "scales", "bias", tiles, bits, head_dim
    )
  patterns = codes[:, channels] * 2.0 ** (exponent - 133.0)  # [token, position]
  emulated_results = warp_key_product.key_scores_per_warp_emulated(
    jnp.asarray(words),
    jnp.asarray(queries).view(jnp.bfloat16),
    jnp.asarray(scales).view(jnp.bfloat16),
    jnp.asarray(bias),
    tiles,
    bits,
  )
  for tile, result in enumerate(results):
    scores = _matrix(fa.WGMMA_LAYOUT, (64, 8), result.registers)
    emulated_scores = np.asarray(emulated_results[tile])
    for warp in range(4):
      group = warp * tiles // 2
      scaled = experiment.bf16_values(
        experiment.bf16_bits(
          experiment.bf16_values(queries) * experiment.bf16_values(scales[group])[channels, None]
        )
      ).astype(np.float64)
      first = 16 * tiles * warp + 16 * tile
      expected = patterns[first : first + 16] @ scaled + bias[group] * 2.0**-64
      rows = slice(16 * warp, 16 * warp + 16)
      tolerance = 1e-4 * np.abs(expected).max()
      np.testing.assert_allclose(scores[rows], expected, rtol=0, atol=tolerance)
      np.testing.assert_allclose(emulated_scores[rows], expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize(
  "tiles,tile,bits,rows,head_dim,swizzled",
  [
    (1, 0, 2, 4, 128, False),
    (2, 0, 2, 4, 128, False),
    (2, 1, 2, 4, 128, False),
    (2, 1, 4, 4, 128, False),
    (1, 0, 2, 8, 128, False),
    (2, 1, 4, 8, 128, False),
    (2, 1, 2, 4, 64, False),  # 4 words a token: one 8-half-word matrix load, each register twice
    (1, 0, 2, 8, 64, False),
    (2, 1, 4, 4, 64, False),  # 8 words: one x4 load of 16 half-words, 4 m-tiles
    (2, 0, 4, 8, 64, False),
    # value_ring_layout="swizzled": 32-byte rows, 64-byte rows (the XOR reaching the second
    # load's chunks), 32-byte rows at head_dim 64, and 16-byte rows, which stay as they are
    (2, 1, 2, 4, 128, True),
    (2, 0, 4, 8, 128, True),
    (2, 1, 4, 4, 64, True),
    (1, 0, 2, 4, 64, True),
  ],
)
def test_value_product_per_warp_adds_each_warps_own_tokens_product(
  emulated, tiles, tile, bits, rows, head_dim, swizzled
):
  """acc [4 D, 8] + per warp w, m-tile m and row r: channel c = `value_row_channel(m, r)` of the
  warp's tokens 16 tiles w + 16 tile .., each code a pattern code x 2^(its bit in its byte),
  against P' rows 16 w .. 16 w + 15 of the operand for c's group: at 4 query rows its pairing
  (its group within its half, the half being r % 2), at 8 rows the group's own. `swizzled`: the
  words where the value ring's TMA swizzle puts them (`swizzled_offsets`), the same product."""
  import jax.numpy as jnp
  from jax.experimental.mosaic.gpu import fragmented_array as fa

  from pallas_kernels.bit_packing import packed_width, unpack_codes
  from pallas_kernels.subnormal_codes import code_exponent

  rng = np.random.default_rng(22 + tiles + tile + bits + rows + head_dim)
  width = packed_width(head_dim, bits)
  words = rng.integers(0, 2**32, (64 * tiles, width), dtype=np.uint64).astype(np.uint32)
  # P' carries 2^64 (`subnormal_codes.PROBS_SCALE`): the codes' patterns are subnormal bf16
  # numbers (~2^-133), and without it the products would vanish in f32 (and the test with them)
  operands = warp_value_product.value_operands(rows, head_dim)
  probs = [_bf16(rng, (64, 8), 0.0, 2.0**64) for _ in range(operands)]
  accumulator_rows = warp_value_product.partial_rows(head_dim)
  acc = (rng.normal(size=(accumulator_rows, 8)) * 2.0**-66).astype(np.float32)
  emulated(_ring_bytes(words, bits, head_dim, swizzled), {"words": 0})
  result = _value_product_of_words(probs, acc, tile, tiles, bits, head_dim, swizzled)
  out = _matrix(fa.WGMMA_LAYOUT, (accumulator_rows, 8), result.registers)
  codes = np.asarray(unpack_codes(jnp.asarray(words), bits)).astype(np.uint32)  # channel order
  expected = acc.astype(np.float64)
  seen = set()
  for warp in range(4):
    tokens = slice(16 * tiles * warp + 16 * tile, 16 * tiles * warp + 16 * tile + 16)
    b = experiment.bf16_values(np.stack(probs)[:, 16 * warp : 16 * warp + 16])
    for m in range(head_dim // 16):
      for r in range(16):
        c = warp_value_product.value_row_channel(m, r, head_dim, bits)
        seen.add(c)
        half, group_in_half = c // (head_dim // 2), (c % (head_dim // 2)) // 32
        assert half == r % 2  # a row's parity is its half of the channels
        operand = group_in_half if rows == 4 else c // 32
        bit = int(code_exponent(c, head_dim, bits))
        pattern = (codes[tokens, c] << bit).astype(np.uint16)
        a = experiment.bf16_values(pattern).astype(np.float64)
        expected[64 * m + 16 * warp + r] += a @ b[operand].astype(np.float64)
  assert seen == set(range(head_dim))  # every channel in one row of each warp's m-tiles
  increment = np.abs(expected - acc)
  assert increment.min() > 0 and increment.max() > np.abs(acc).max() / 4  # not vacuous
  np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5 * increment.max())
  emulated_out = warp_value_product.value_product_per_warp_emulated(
    [jnp.asarray(p).view(jnp.bfloat16) for p in probs],
    jnp.asarray(words),
    acc,
    tile,
    tiles,
    bits,
    head_dim,
  )
  np.testing.assert_allclose(emulated_out, expected, rtol=0, atol=1e-5 * increment.max())


@pytest.mark.parametrize(
  "bits,head_dim,rows_wavefronts",
  [(2, 128, 2), (4, 128, 4), (4, 64, 2), (2, 64, 1)],
)
@pytest.mark.parametrize("swizzled", [False, True])
def test_the_value_matrix_loads_bank_conflicts(
  emulated, monkeypatch, bits, head_dim, rows_wavefronts, swizzled
):
  """The wavefronts each of the value product's matrices takes (8 rows of 16 bytes: one at
  best), from the addresses the inline code gives `ldmatrix` (`shared_bank_conflicts.wavefronts`
  on each matrix's words): a token row apart, 2 or 4 a matrix unswizzled where rows are 32 or 64
  bytes (16-byte rows take one); with value_ring_layout="swizzled", one everywhere."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  from pallas_kernels.bit_packing import packed_width

  bank_conflicts = load_benchmark("shared_bank_conflicts")
  tiles = 2
  words = np.zeros((64 * tiles, packed_width(head_dim, bits)), np.uint32)
  emulated(_ring_bytes(words, bits, head_dim, swizzled), {"words": 0})
  run_ptx, addresses = mgpu_utils.inline_ptx, []

  def recorded(ptx, *args, **kwargs):
    if ptx.startswith("ldmatrix"):
      matrices = 4 if ".x4." in ptx else 2  # .x2: lanes 0-15 address its two matrices
      addresses.append((matrices, np.asarray(args[0], np.int64)))
    return run_ptx(ptx, *args, **kwargs)

  monkeypatch.setattr(mgpu_utils, "inline_ptx", recorded)
  operands = warp_value_product.value_operands(4, head_dim)
  zeros = np.zeros((64, 8), np.uint16)
  acc = np.zeros((warp_value_product.partial_rows(head_dim), 8), np.float32)
  for tile in range(tiles):
    _value_product_of_words([zeros] * operands, acc, tile, tiles, bits, head_dim, swizzled)
  counts = set()
  for matrices, address in addresses:
    for warp in range(4):
      for matrix in range(matrices):
        rows = address[32 * warp + 8 * matrix : 32 * warp + 8 * matrix + 8]
        counts.add(bank_conflicts.wavefronts((rows[:, None] + 4 * np.arange(4)).ravel()))
  assert len(addresses) == tiles * max(1, packed_width(head_dim, bits) // 8)
  assert counts == {1 if swizzled else rows_wavefronts}


@pytest.mark.parametrize(
  "tiles,tile,rows,head_dim",
  [(1, 0, 4, 128), (2, 1, 4, 128), (2, 1, 8, 128), (2, 1, 4, 64), (2, 0, 8, 64)],
)
def test_statistics_by_slot_give_each_column_its_slots_group(
  emulated, monkeypatch, tiles, tile, rows, head_dim
):
  """[64, 8]: row 16 w + r (token 16 tiles w + 16 tile + r), column c holds the statistic of
  group 2 (c // 4) + b at that token (4 query rows; group c // 4 at head_dim 64), or of group b
  (8 rows)."""
  import jax.numpy as jnp
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, memref, vector

  rng = np.random.default_rng(23)
  statistics = _bf16(rng, (head_dim // 32, 64 * tiles), -1.0, 1.0)
  monkeypatch.setattr(
    memref, "load", lambda _, index: statistics[index[0].astype(int), index[1].astype(int)]
  )
  monkeypatch.setattr(arith, "extf", lambda _, value: experiment.bf16_values(value))
  monkeypatch.setattr(vector, "broadcast", lambda _, value: np.stack([value, value], axis=1))
  monkeypatch.setattr(arith, "index_cast", lambda _, value: np.asarray(value, np.int64))
  values = experiment.bf16_values(statistics)
  row = np.arange(64)
  token = 16 * tiles * (row // 16) + 16 * tile + row % 16
  for b in range(warp_value_product.value_operands(rows, head_dim)):
    with ir.Context(), ir.Location.unknown():
      result = warp_value_product.statistics_by_slot(None, b, tile, tiles, rows, head_dim)
    table = _matrix(fa.WGMMA_LAYOUT, (64, 8), result.registers)
    emulated_table = np.asarray(
      warp_value_product.statistics_by_slot_emulated(
        jnp.asarray(statistics).view(jnp.bfloat16), b, tile, tiles, rows
      )
    )
    for column in range(8):
      group = (head_dim // 64) * (column // 4) + b if rows == 4 else b
      np.testing.assert_array_equal(table[:, column], values[group, token])
      np.testing.assert_array_equal(emulated_table[:, column], values[group, token])


@pytest.mark.parametrize(
  "tiles,tile,rows,head_dim",
  [(1, 0, 4, 128), (2, 1, 4, 128), (2, 1, 8, 128), (2, 1, 4, 64), (2, 0, 8, 64)],
)
def test_statistics_by_matrix_loads_are_the_per_token_loads_tables(
  emulated, monkeypatch, tiles, tile, rows, head_dim
):
  """statistic_loads="matrix_loads": from one [2, D / 32, 64 tiles] ring slot (scales, then
  minimums), each P' operand's pair of tables is `statistics_by_slot`'s (the same [64, 8]
  layout and values: row 16 w + r token 16 tiles w + 16 tile + r, column c its slot's group),
  through `ldmatrix.trans` as the emulation's lane mapping gives it; one .x4 per two operands
  (.x2 for one), and each matrix's rows on distinct banks but for the two slots' groups."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import vector

  rng = np.random.default_rng(24 + rows + head_dim)
  groups = head_dim // 32
  statistics = _bf16(rng, (2, groups, 64 * tiles), -1.0, 1.0)
  emulated(statistics.view(np.uint8).ravel().copy(), {"statistics": 0})
  run_ptx, instructions, addresses = mgpu_utils.inline_ptx, [], []

  def recorded(ptx, *args, **kwargs):
    instructions.append(ptx.split(" ")[0])
    addresses.append(np.asarray(args[0], np.int64))
    return run_ptx(ptx, *args, **kwargs)

  monkeypatch.setattr(mgpu_utils, "inline_ptx", recorded)
  monkeypatch.setattr(
    mgpu_utils,
    "bitcast",
    lambda value, type_: (
      as_uint(value).astype(np.uint32).view(np.float32) if str(type_) == "f32" else value
    ),
  )
  monkeypatch.setattr(vector, "broadcast", lambda _, value: np.stack([value, value], axis=1))
  with ir.Context(), ir.Location.unknown():
    pairs = warp_value_product.statistics_by_matrix_loads("statistics", tile, tiles, rows, head_dim)
  operands = warp_value_product.value_operands(rows, head_dim)
  assert len(pairs) == operands
  x4, x2 = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "ldmatrix.sync.aligned.m8n8.x2.trans"
  assert instructions == [x4] * (operands // 2) + [x2 + ".shared.b16"] * (operands % 2)
  bank_conflicts = load_benchmark("shared_bank_conflicts")
  for instruction, address in zip(instructions, addresses):
    for warp in range(4):
      for matrix in range(4 if instruction == x4 else 2):
        rows_of = address[32 * warp + 8 * matrix : 32 * warp + 8 * matrix + 8]
        words = (rows_of[:, None] + 4 * np.arange(4)).ravel()
        assert bank_conflicts.wavefronts(words) == (2 if rows == 4 else 1)
  values = experiment.bf16_values(statistics)
  row = np.arange(64)
  token = 16 * tiles * (row // 16) + 16 * tile + row % 16
  for b, pair in enumerate(pairs):
    for k, table in enumerate(pair):
      table = _matrix(fa.WGMMA_LAYOUT, (64, 8), table.registers)
      for column in range(8):
        group = (head_dim // 64) * (column // 4) + b if rows == 4 else b
        np.testing.assert_array_equal(table[:, column], values[k, group, token])


@pytest.mark.parametrize("tiles", [1, 2])
def test_add_warp_partials_gives_the_models_output(emulated, monkeypatch, tiles):
  """The epilogue's sum over warps, from partial outputs laid out as the kernel's registers
  hold them (the lane-by-lane states of the same design, noise in the columns of the other
  slot): thread c's 4 values are channel c's rows of the model's output."""
  import re

  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm, memref

  from tests.benchmarks.test_warp_products_mosaic_experiment import lane_partials

  arrays = experiment.random_arrays(2, 512, 2, seed=13)
  model_out, _ = experiment.model_outputs(arrays, 2, tiles)
  partial, _ = lane_partials(arrays, 2, tiles)

  def undefined(vector_type):  # vector<NxT>: N values a thread
    return np.zeros((128, int(re.match(r"vector<(\d+)x", str(vector_type)).group(1))), np.float32)

  monkeypatch.setattr(llvm, "mlir_undef", undefined)
  monkeypatch.setattr(arith, "index_cast", lambda _, value: np.asarray(value, np.int64))
  for r in range(2):
    for s in range(2):
      monkeypatch.setattr(
        memref, "load", lambda _, index, r=r, s=s: partial[r, s, index[0], index[1]]
      )
      with ir.Context(), ir.Location.unknown():
        result = warp_value_product.add_warp_partials(None)
      (register,) = result.registers
      tolerance = 1e-5 * np.abs(model_out[r, s]).max()
      np.testing.assert_allclose(register, model_out[r, s].T, rtol=0, atol=tolerance)
      emulated_sum = warp_value_product.add_warp_partials_emulated(partial[r, s])
      np.testing.assert_allclose(emulated_sum, model_out[r, s].T, rtol=0, atol=tolerance)


@pytest.mark.parametrize(
  "bits,rows,head_dim",
  [
    (2, 4, 128),
    (4, 4, 128),
    (2, 8, 128),
    (4, 8, 128),
    (2, 4, 64),
    (2, 8, 64),
    (4, 4, 64),
    (4, 8, 64),
  ],
)
def test_finished_own_slot_outputs_normalise_each_channels_own_slot(
  emulated, monkeypatch, bits, rows, head_dim
):
  """Thread t's values: channel c = t % D's rows t // D, t // D + 128 / D, ...: its sum over the
  warps from its slot's columns (row r of m-tile m with c = `value_row_channel(m, r)`; at 4 query
  rows columns 4 s + j, s = c // (D / 2), at 8 column j), times 2^(69 - bit), plus its value
  group's sum of p v_min (4 rows: row 1 + (c % (D / 2)) // 32, column 4 s + j of the statistics;
  8 rows: row 1 + c // 32, column j), over column j's sum of p (row 0); 0 for a zero sum, NaN
  for a NaN one. And the jnp counterpart gives the same."""
  import jax.numpy as jnp
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, memref

  from pallas_kernels.subnormal_codes import code_exponent

  rng = np.random.default_rng(31)
  partial_rows = warp_value_product.partial_rows(head_dim)
  partial = rng.normal(size=(partial_rows, 8)).astype(np.float32) * np.float32(2.0**-66)
  statistics = rng.uniform(
    0.5, 2.0, size=(1 + warp_value_product.value_operands(rows, head_dim), 8)
  )
  statistics = statistics.astype(np.float32)
  statistics[0, 2] = 0.0  # an empty column (no valid token in the split)
  statistics[0, 3] = np.nan
  arrays = {"partial": partial, "statistics": statistics}
  monkeypatch.setattr(
    memref, "load", lambda ref, index: arrays[ref][index[0].astype(int), index[1].astype(int)]
  )
  monkeypatch.setattr(arith, "index_cast", lambda _, value: np.asarray(value, np.int64))

  def divide(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):  # the empty column: selected away
      return np.float32(a) / np.float32(b)

  monkeypatch.setattr(arith, "divf", divide)
  monkeypatch.setattr(
    arith,
    "cmpf",
    lambda predicate, a, b: ~(np.asarray(a) == np.asarray(b)),  # UNE
  )
  with ir.Context(), ir.Location.unknown():
    result = warp_value_product.finished_own_slot_outputs(
      "partial", "statistics", bits, rows, head_dim
    )
  # register k of thread t: flat element 128 k + t of [rows, D] (WG_STRIDED, one a register)
  registers = np.stack([np.asarray(register, np.float64) for register in result.registers])
  assert registers.shape == (rows * head_dim // 128, 128)
  out = registers.reshape(rows, head_dim)
  expected = np.zeros((rows, head_dim))
  half = head_dim // 2
  for m in range(head_dim // 16):
    for r in range(16):
      c = warp_value_product.value_row_channel(m, r, head_dim, bits)
      s = c // half
      for j in range(rows):
        column = 4 * s + j if rows == 4 else j
        total = sum(partial[64 * m + 16 * w + r, column].astype(np.float64) for w in range(4))
        minimum = statistics[1 + (c % half) // 32 if rows == 4 else 1 + c // 32, column]
        scale = 2.0 ** (69 - int(code_exponent(c, head_dim, bits)))
        sums = statistics[0, j]
        expected[j, c] = 0.0 if sums == 0 else (total * scale + minimum) / sums
  assert np.all(out[2] == 0.0) and np.all(np.isnan(out[3]))
  # f32 sums of four partials and a minimum: relative to the largest term, not to a cancellation
  atol = 1e-6 * np.nanmax(np.abs(expected))
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=atol)
  emulated_out = warp_value_product.finished_own_slot_outputs_emulated(
    jnp.asarray(partial), jnp.asarray(statistics), bits, rows, head_dim
  )
  np.testing.assert_allclose(emulated_out, expected, rtol=1e-5, atol=atol)


def test_the_one_word_per_lane_operand_refuses_other_widths_by_name():
  """4 words a token only: 4-bit codes at head_dim 64 are 8 words, the wgmma word order's."""
  with pytest.raises(ValueError, match="bits=4 is not supported by the one word per lane"):
    warp_key_product.own_token_codes_one_word_per_lane(None, 0, 2, bits=4)
