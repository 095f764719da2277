"""The TPU kernels compiled by Mosaic for a TPU that is not there (libtpu's compile-only
topologies, `benchmarks/tpu_compile_check.py`), which interpret mode never does.

Both kernels used to fail there (a 1-D token mask Mosaic cannot lay out), and the quantized one,
taking [block, words] tiles, made XLA copy the cache into 128-lane padded layouts at every call
(KERNEL_NOTES v49). These tests compile every kernel over the interpret-mode tests' shapes and
check that a decode call at the benchmark shape moves no cache-sized array besides the kernel.
"""

import itertools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from tests.benchmarks.benchmark_modules import load_benchmark

tpu_compile_check = load_benchmark("tpu_compile_check")

pytestmark = pytest.mark.skipif(
  not tpu_compile_check.libtpu_available(),
  reason="libtpu is not installed (the dev extra brings it on Linux x86-64)",
)

BATCH, KV_HEADS = 2, 2
# 1280 tokens: three 512-token blocks at head_dim 128, the last half past the end; below 128
# channels the quantized kernel's blocks hold 128 key groups (4096 tokens at group 32), so
# 5376 make two there.
TOKENS = 1280
LANE_GROUP_TOKENS = 4096 + 1280
# There GEAR's B factors are read with the GEAR blocks on lanes, 128 a block (8192 tokens).
LANE_GEAR_TOKENS = 8192 + 1280


def _full_precision_shapes(head_dim, group, dtype, tokens=TOKENS):
  cache = ((BATCH, KV_HEADS, tokens, head_dim), dtype)
  return (
    ((BATCH, KV_HEADS, group, head_dim), jnp.float32),
    cache,
    cache,
    ((BATCH,), jnp.int32),
  )


def _quantized_shapes(bits, head_dim, group, dtype, group_size, gear, tokens, outliers=20):
  codes = ((BATCH, KV_HEADS, tokens, head_dim * bits // 32), jnp.uint32)
  key_stats = ((BATCH, KV_HEADS, tokens // group_size, head_dim), dtype)
  value_stats = ((BATCH, KV_HEADS, tokens, head_dim // group_size), dtype)
  shapes = (
    ((BATCH, KV_HEADS, group, head_dim), jnp.float32),
    codes,
    key_stats,
    key_stats,
    codes,
    value_stats,
    value_stats,
    ((BATCH,), jnp.int32),
  )
  if not gear:
    return shapes
  blocks, rank = tokens // 64, 2
  factors = (
    ((BATCH, KV_HEADS, tokens, rank), dtype),
    ((BATCH, KV_HEADS, blocks, head_dim, rank), dtype),
  ) * 2
  sparse = (
    ((BATCH, KV_HEADS, blocks, outliers), jnp.uint16),
    ((BATCH, KV_HEADS, blocks, outliers), dtype),
  ) * 2
  return shapes + factors + sparse


def _quantized_function(bits, group_size, gear):
  if not gear:
    return tpu_compile_check.quantized_call(bits, group_size)
  return tpu_compile_check.gear_call(bits, group_size)


def _compile_quantized(bits, head_dim, group, dtype, group_size, gear, topology="v5e:2x2"):
  tokens = TOKENS
  if head_dim < 128:
    tokens = LANE_GEAR_TOKENS if gear else LANE_GROUP_TOKENS
  shapes = _quantized_shapes(bits, head_dim, group, dtype, group_size, gear, tokens)
  return tpu_compile_check.compile_for_tpu(
    _quantized_function(bits, group_size, gear), shapes, topology
  )


@pytest.mark.parametrize(
  "head_dim,group,dtype",
  [(64, 1, jnp.bfloat16), (64, 8, jnp.float32), (128, 4, jnp.bfloat16), (128, 3, jnp.float32)],
)
def test_full_precision_kernel_compiles_for_a_tpu(head_dim, group, dtype):
  tpu_compile_check.compile_for_tpu(
    tpu_compile_check.full_precision_call(block_tokens=512),
    _full_precision_shapes(head_dim, group, dtype),
  )


@pytest.mark.parametrize(
  "bits,head_dim,group,dtype,group_size,gear",
  [
    (2, 128, 4, jnp.bfloat16, 32, False),
    (4, 128, 8, jnp.float32, 32, False),
    (8, 128, 1, jnp.bfloat16, 64, False),
    (2, 64, 4, jnp.bfloat16, 32, False),
    (4, 64, 3, jnp.float32, 64, False),
    (2, 128, 4, jnp.bfloat16, 64, True),
    (4, 64, 2, jnp.float32, 64, True),
  ],
)
def test_quantized_kernel_compiles_for_a_tpu(bits, head_dim, group, dtype, group_size, gear):
  _compile_quantized(bits, head_dim, group, dtype, group_size, gear)


def test_gear_compiles_for_a_tpu_v6e():
  """v6e's compiler crashed (a segmentation fault in its SparseCore backend) on the value
  outliers' 32-slot scatter the GPU path uses (v49)."""
  _compile_quantized(2, 64, 1, jnp.bfloat16, 64, True, topology="v6e:2x2")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_gear_compiles_for_a_tpu_v6e_at_32k_tokens(head_dim):
  """With GEAR's defaults at 32k tokens (2% outliers: 82 or 164 a block and side), v6e's
  compiler crashed in its SparseCore backend on XLA's one-slot outlier scatter around the
  kernel (v55). The outliers are the kernel's since v56: no scatter is left."""
  outliers = round(0.02 * 64 * head_dim)
  shapes = _quantized_shapes(2, head_dim, 4, jnp.bfloat16, 64, True, 32768, outliers)
  tpu_compile_check.compile_for_tpu(_quantized_function(2, 64, True), shapes, topology="v6e:2x2")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("bits", [None, 2, 4], ids=["bf16", "kivi2", "kivi4"])
def test_a_decode_call_moves_no_cache_sized_copy(bits, head_dim):
  """At the benchmark shape (batch 8, 8 KV heads, 32k tokens) XLA keeps every cache array in
  the layout it chose for the argument: no copy or transpose of 1 MB or more around the
  kernel (the [block, words] kernel copied 4.5 GB at 2 bits and head_dim 128)."""
  call = (
    tpu_compile_check.full_precision_call()
    if bits is None
    else tpu_compile_check.quantized_call(bits)
  )
  compiled = tpu_compile_check.compile_for_tpu(
    call, tpu_compile_check.record_shapes(head_dim, 32768, bits)
  )
  assert tpu_compile_check.large_copies(compiled, 1 << 20) == []


def _reads_token_rows(x):
  """A Pallas TPU kernel reading [512, 64] token-row tiles of [B, H, T, 64], as the TPU kernels
  did before v49."""

  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  batch, heads, tokens, width = x.shape
  spec = pl.BlockSpec((None, None, 512, width), lambda b, h, t: (b, h, t, 0))
  return pl.pallas_call(
    double,
    grid=(batch, heads, tokens // 512),
    in_specs=[spec],
    out_specs=spec,
    out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
  )(x)


def test_the_copy_check_sees_a_relayout():
  """The check on what the earlier layout did: a [B, H, T, 64] argument, laid out with T last,
  copied into 128-lane padded token rows for the kernel: listed, at its padded size."""
  compiled = tpu_compile_check.compile_for_tpu(
    _reads_token_rows, (((8, 8, 4096, 64), jnp.bfloat16),)
  )
  copies = tpu_compile_check.large_copies(compiled, 1 << 20)
  # In, padded to 128 lanes; and the kernel's output back to the argument's layout.
  assert sorted(copy.bytes for copy in copies) == [8 * 8 * 4096 * 64 * 2, 8 * 8 * 4096 * 128 * 2]


class _OptimisedText:
  """A compiled program's stand-in: `as_text` returns the given optimised HLO."""

  def __init__(self, text: str):
    self.text = text

  def as_text(self) -> str:
    return self.text


_LOOP_WITH_A_FLUSH = """HloModule m

%flush (p: (u32[8,8,128,8])) -> (u32[8,8,128,8]) {
  %p = (u32[8,8,128,8]{3,2,1,0:T(8,128)}) parameter(0)
  %g = u32[8,8,128,8]{3,2,1,0:T(8,128)} get-tuple-element(%p), index=0
  %copy.1 = u32[8,8,128,8]{2,3,1,0:T(8,128)} copy(%g)
  ROOT %t = (u32[8,8,128,8]{2,3,1,0:T(8,128)}) tuple(%copy.1)
}

%keep (p: (u32[8,8,128,8])) -> (u32[8,8,128,8]) {
  ROOT %p = (u32[8,8,128,8]{3,2,1,0:T(8,128)}) parameter(0)
}

%cond (s: (s32[], u32[8,8,128,8])) -> pred[] {
  %s = (s32[], u32[8,8,128,8]{3,2,1,0:T(8,128)}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%row (s: (s32[], u32[8,8,128,8])) -> (s32[], u32[8,8,128,8]) {
  %copy.2 = f32[4096]{0:T(1024)} copy(%x)
  %cs.3 = (f32[4096]{0:T(1024)S(1)}, f32[4096]{0:T(1024)}) copy-start(%x)
  %cs.4 = (f32[64,64]{1,0:S(1)}, f32[64,64]{1,0}) copy-start(%x)
}

%body (s: (s32[], u32[8,8,128,8])) -> (s32[], u32[8,8,128,8]) {
  %s = (s32[], u32[8,8,128,8]{3,2,1,0:T(8,128)}) parameter(0)
  %cond.1 = (u32[8]{0}, /*index=1*/s32[]) conditional(%i), branch_computations={%keep, %flush}
  %w.2 = (s32[]) while(%s), condition=%cond, body=%row, metadata={op_name="f/body=nowhere"}
  %cs.1 = (f32[8,256]{0,1:T(8,128)S(1)}, f32[8,256]{1,0:T(8,128)}, u32[]) copy-start(%a)
  %cs.2 = (f32[8,256]{1,0:T(8,128)S(1)}, /*index=1*/f32[8,256]{1,0:T(8,128)}) copy-start(%a)
  ROOT %r = (s32[], u32[8,8,128,8]{3,2,1,0:T(8,128)}) tuple(%i, %g)
}

ENTRY %main (a: f32[8,256]) -> f32[8,256] {
  %w = (s32[], u32[8,8,128,8]{3,2,1,0:T(8,128)}) while(%init), condition=%cond, body=%body
  ROOT %a = f32[8,256]{1,0:T(8,128)} parameter(0)
}
"""


def test_the_copy_check_walks_branches_and_reads_copy_starts():
  """Before, a conditional's branches went unread (a KIVI cache's flush copies in one) and a
  copy-start, whose tuple shape holds spaces, never matched. A copy-start that only moves an
  array between memory spaces (a prefetch into VMEM) is no relayout: left out."""
  compiled = _OptimisedText(_LOOP_WITH_A_FLUSH)
  copies = tpu_compile_check.large_copies(compiled, 8 * 1024, "body")
  assert [(copy.opcode, copy.computation, copy.bytes, copy.in_branch) for copy in copies] == [
    # its destination, the first of its tuple: physically [256, 8], 8 lanes padded to 128
    ("copy-start", "body", 256 * 128 * 4, False),
    # [.., 128, 8] laid out with the 128 tokens minor; in the flush branch, not every step
    ("copy", "flush", 8 * 8 * 8 * 128 * 4, True),
    # a nested loop runs every step (its metadata's "body=nowhere" is no callee)
    ("copy", "row", 4096 * 4, False),
  ]
  assert [copy.computation for copy in tpu_compile_check.large_copies(compiled, 8 * 1024)] == [
    "body",
    "flush",
    "row",
  ]
  unwalked = tpu_compile_check.entry_instructions(compiled, "body", walk_control_flow=False)
  assert [instruction.opcode for instruction in unwalked] == [
    "conditional",
    "while",
    "copy-start",
    "copy-start",
  ]
  assert tpu_compile_check.moves_memory_space_only(unwalked[3])
  assert not tpu_compile_check.moves_memory_space_only(unwalked[2])
  # Memory spaces named with a tile or without one (cs.3 and cs.4 in the nested loop)
  moves = tpu_compile_check.entry_instructions(compiled, "row")[1:]
  assert [tpu_compile_check.moves_memory_space_only(move) for move in moves] == [True, True]


def test_a_computation_also_reached_outside_a_branch_runs_every_step():
  """Tagged by every path that reaches it, not by the first one walked."""
  text = _LOOP_WITH_A_FLUSH.replace(
    "  %cs.1 = ", "  %call.1 = (u32[8]{0}) call(%s), to_apply=%flush\n  %cs.1 = "
  )
  copies = tpu_compile_check.large_copies(_OptimisedText(text), 8 * 1024, "body")
  assert [(copy.computation, copy.in_branch) for copy in copies] == [
    ("body", False),
    ("flush", False),
    ("row", False),
  ]


@pytest.mark.parametrize(
  "shape,expected",
  [
    ("u32[8,8,32768,8]{2,3,1,0:T(8,128)}", 8 * 8 * 32768 * 8 * 4),
    ("u32[8,8,32768,8]{3,2,1,0:T(8,128)}", 8 * 8 * 32768 * 128 * 4),
    ("bf16[8,8,1024,64]{3,2,1,0:T(8,128)(2,1)S(1)}", 8 * 8 * 1024 * 128 * 2),
    ("f32[8,8,4]{1,2,0:T(4,128)}", 8 * 4 * 128 * 4),  # physically [8, 4, 8]: 8 lanes padded
    ("s32[]", 4),
    ("(f32[2], f32[3])", 0),
  ],
)
def test_laid_out_bytes_pad_the_two_most_minor_dimensions_to_the_tile(shape, expected):
  assert tpu_compile_check.laid_out_bytes(shape) == expected


@pytest.mark.slow
@pytest.mark.parametrize(
  "head_dim,group,dtype,tokens",
  list(itertools.product((64, 128), (1, 2, 4, 8), (jnp.float32, jnp.bfloat16), (200, 1280))),
)
def test_full_precision_kernel_grid_compiles_for_a_tpu(head_dim, group, dtype, tokens):
  tpu_compile_check.compile_for_tpu(
    tpu_compile_check.full_precision_call(block_tokens=64),
    _full_precision_shapes(head_dim, group, dtype, tokens),
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "bits,head_dim,group,dtype,gear",
  list(
    itertools.product((2, 4, 8), (64, 128), (1, 4, 8), (jnp.float32, jnp.bfloat16), (False, True))
  ),
)
def test_quantized_kernel_grid_compiles_for_a_tpu(bits, head_dim, group, dtype, gear):
  _compile_quantized(bits, head_dim, group, dtype, 64 if gear else 32, gear)


KIVI_2 = "kivi:bits=2,residual=128,group_size=32"
KIVI_4 = "kivi:bits=4,residual=128,group_size=32"
# One value group per token: statistics XLA stores with the heads on sublanes, copied into
# [B, H, 1, T] rows at every step before v55 (16.7 MB at 128 channels, 18.8 MB in all at 64).
KIVI_2_HEAD_WIDE_GROUPS = "kivi:bits=2,residual=128,group_size={head_dim}"


@pytest.mark.parametrize(
  "spec,head_dim",
  [
    ("full", 64),
    (KIVI_2, 128),
    (KIVI_4, 128),
    (KIVI_2_HEAD_WIDE_GROUPS.format(head_dim=128), 128),
    pytest.param("full", 128, marks=pytest.mark.slow),
    pytest.param(KIVI_2, 64, marks=pytest.mark.slow),
    pytest.param(KIVI_4, 64, marks=pytest.mark.slow),
    pytest.param(KIVI_2_HEAD_WIDE_GROUPS.format(head_dim=64), 64, marks=pytest.mark.slow),
  ],
)
def test_a_decode_step_copies_no_cache_array(spec, head_dim):
  """kvjax's own decode loop compiled for a TPU (one layer, 32k tokens, batch 8). Its caches'
  appends were scatters whose window spanned the heads, for which XLA laid the caches out
  heads-minor and copied them for the kernel at every step (1.07 GB a step for a bf16 cache,
  3.1 GB for KIVI-2: KERNEL_NOTES v49); then, with the scatters indexed on (row, head, slot),
  KIVI-4's codes (836 MB) and KIVI's key statistics (34 MB) were still copied. The segment's
  blocks are now written by per-row update slices, the key statistics pinned to the kernel's
  layout (v50).

  The copies inside the loop's conditional branches count too (`large_copies` walks them): a
  KIVI cache flushes its full-precision window into the segment in one, every `residual` steps
  (128 here). There XLA copies block-sized arrays (the window's [B, H, 128, D] block being
  quantized, its f32 intermediates, its [B, H, 4, D] key statistics, and since v66 the window
  emptied for the rows that flush), never a segment array: measured 21.0 MiB in eight copies at
  head_dim 128 and 16.0 MiB in nine at 64, about 0.16 MiB a step over the 128 (17.0 and 12.0
  MiB before v66 emptied the window in the branch rather than at every step)."""
  compiled = tpu_compile_check.decode_loop(spec, context=32768, head_dim=head_dim)
  body = tpu_compile_check.while_body(compiled)
  copies = tpu_compile_check.large_copies(compiled, 1 << 20, body)
  every_step = [copy for copy in copies if not copy.in_branch]
  # What is left, below 128 channels only: a KIVI cache's full-precision window (K and V,
  # [B, H, 128 slots, head_dim], 1 MB each), which the bf16 kernel takes tokens-minor.
  assert all(copy.shape.startswith(f"bf16[8,8,128,{head_dim}]") for copy in every_step), copies
  window = 8 * 8 * 128 * head_dim * 2 if spec.startswith("kivi") and head_dim < 128 else 0
  assert sum(copy.bytes for copy in every_step) <= 2 * window
  _check_flush_copies([copy for copy in copies if copy.in_branch], total_mib=22)
  if not spec.startswith("kivi"):
    assert every_step == copies


@pytest.mark.parametrize(
  "spec, head_dim, context, flush_mib",
  [
    (KIVI_2, 128, 32768, 22),
    ("full", 128, 20100, 18),
    pytest.param(KIVI_4, 128, 20100, 22, marks=pytest.mark.slow),
    pytest.param("full", 64, 20100, 18, marks=pytest.mark.slow),
    # GEAR's outliers stored in whole lane tiles (v65; 20600 tokens: 328 GEAR blocks a row)
    pytest.param("gear", 128, 32768, 34, marks=pytest.mark.slow),
    pytest.param("gear", 128, 20600, 34, marks=pytest.mark.slow),
  ],
)
def test_a_decode_step_jitted_alone_copies_no_cache_array(spec, head_dim, context, flush_mib):
  """One decode step jitted alone (a caller's own loop), the caches passed in the TPU's default
  layouts at every call. For [B, H, groups, 128] key statistics with a number of groups not a
  multiple of 8 (1020 at 32k: the segment holds whole 128-token blocks of all but the last
  token) that layout puts the heads second-minor, and the step copied both into the kernel's
  row-major one at every call (2 x 16.7 MB at batch 8, KERNEL_NOTES v64). On a TPU the segment
  now holds whole tiles of key-statistic rows (`quantized_segment_granule`: 32768 tokens there,
  20480 for 20100), whose default layout is row-major. A full cache of 20100 tokens copied all
  of K and V (665 MB a call at head_dim 128, 992 MB at 64); on a TPU its capacity is now a
  multiple of 16 tokens, 128 below 128 channels (`full_precision_cache_granule`). What is left
  are the weights' moves into VMEM ([4096, 512] and [1024, 512] bfloat16) and the flush's
  block-sized copies. GEAR's outliers, [B, H, J, 164] at head_dim 128, were laid out (0, 3, 1,
  2) by default and copied at every call (67 MB at 32k, v64); stored in 256 slots
  (`gear_outlier_slots`) they are read in place."""
  compiled = tpu_compile_check.decode_step(spec, context=context, head_dim=head_dim)
  copies = tpu_compile_check.large_copies(compiled, 1 << 20)
  cache_sized = [copy for copy in copies if "[8,8," in copy.shape]
  assert all(copy.in_branch for copy in cache_sized), copies
  _check_flush_copies([copy for copy in copies if copy.in_branch], total_mib=flush_mib)


def _check_flush_copies(copies, *, total_mib: float) -> None:
  """The copies in a decode loop's branches (a compressed cache's flush): each at most 4 MiB
  (an f32 [B, H, 128, 128] block), where the smallest segment array at 32k tokens (KIVI's key
  statistics, [B, H, 1020, D]) is 8 MiB or more laid out; in all at most `total_mib`."""
  assert all(copy.bytes <= 4 << 20 for copy in copies), copies
  assert sum(copy.bytes for copy in copies) <= total_mib * 2**20, copies


@pytest.mark.slow
def test_a_kivi_decode_step_jitted_alone_at_head_dim_64_copies_its_window_once():
  """Below 128 channels the bf16 kernel takes the full-precision window tokens-minor, the
  default layout of [8, 8, 128, 64], so a step copies each of K and V once (1 MiB). Until v66
  the step emptied the windows of the rows that flush with a select over each whole window at
  every step, and XLA laid them out anew for it and back for the kernel: 8 MiB a step in six
  copies. Now emptied in the flush branch (every 128 steps, 18 MiB there)."""
  compiled = tpu_compile_check.decode_step(KIVI_2, context=32768, head_dim=64)
  copies = tpu_compile_check.large_copies(compiled, 1 << 20)
  every_step = [copy for copy in copies if not copy.in_branch and "[8,8," in copy.shape]
  assert [copy.shape.split("{")[0] for copy in every_step] == ["bf16[8,8,128,64]"] * 2, copies
  assert sum(copy.bytes for copy in every_step) <= 2 << 20
  _check_flush_copies([copy for copy in copies if copy.in_branch], total_mib=19)


# About 10 s a compile on a 2-core CPU since v56 (40-45 s with XLA's outlier ops around the
# kernel): head_dim 128 in the default run, 64 under -m slow.
@pytest.mark.parametrize(
  "head_dim, bound_mb", [(128, 0.0), pytest.param(64, 2.1, marks=pytest.mark.slow)]
)
def test_a_gear_decode_step_copies_little_beside_its_window(head_dim, bound_mb):
  """GEAR-2 in kvjax's decode loop compiled for a TPU: its terms laid out for a GPU ([J s, G]
  windows of the query group, padded there from 4 lanes to 128) made XLA copy 3.36 GB a step at
  head_dim 128 and 1.73 GB at 64 around the kernel; laid out for a TPU, the outliers and key
  statistics pinned row-major through the appends' loop, 206 and 222 MB (KERNEL_NOTES v50), most
  of it the low-rank rows spread over their GEAR blocks. With the low-rank terms the kernel's own
  (v51) what was left at 128 was the full-precision window (K and V [B, H, 64, 128], 1 MB each),
  and with the outliers the kernel's too (v56) nothing is; at 64 the window (2 x 1 MiB; twice,
  4 x 1 MiB, until v66 emptied it in the flush branch rather than at every step).
  There the B factors (relaid from blocks-minor to 128 channel lanes before: 2 x 16.7 MB,
  52 MiB in all) are read as stored since v54, and so are the value statistics of one group
  per token since v55 (stored heads-on-sublanes and copied to [B, H, 1, T] rows padded to 2
  sublanes before: 2 x 8 MiB, 20 MiB in all).
  The flush branch, every 64 steps, copies block-sized arrays: 33.0 MiB in 16 copies at 128,
  24.0 MiB at 64 (`_check_flush_copies`; 31.0 and 22.0 before v66)."""
  compiled = tpu_compile_check.decode_loop("gear", context=32768, head_dim=head_dim)
  body = tpu_compile_check.while_body(compiled)
  copies = tpu_compile_check.large_copies(compiled, 1 << 20, body)
  every_step = [copy for copy in copies if not copy.in_branch]
  assert sum(copy.bytes for copy in every_step) <= bound_mb * 1e6, copies
  assert all(copy.shape.startswith(f"bf16[8,8,64,{head_dim}]") for copy in every_step), copies
  _check_flush_copies([copy for copy in copies if copy.in_branch], total_mib=34)


@pytest.mark.parametrize("bits,head_dim,tokens", [(2, 128, 1280), (4, 64, 5376), (2, 64, 8192)])
def test_the_code_pair_kernel_compiles_for_a_tpu_v4_without_sublane_gathers(bits, head_dim, tokens):
  """Mosaic refuses a sublane gather for a v4 ("failed to legalize tpu.dynamic_gather", v58):
  there the code-pair products build the statistics rows from broadcasts, chosen by the
  default device (the topology's, set by `compile_for_tpu`); 2 bits at head_dim 64 in two
  4096-token blocks take the token halves' pairs."""
  shapes = _quantized_shapes(bits, head_dim, 4, jnp.bfloat16, 32, False, tokens)
  call = tpu_compile_check.quantized_call(bits, 32, block_tokens=4096)
  tpu_compile_check.compile_for_tpu(call, shapes, "v4:2x2x1")


def test_the_default_device_decides_the_sublane_gathers():
  from pallas_kernels import quantized_decode_attention_tpu as kernel

  for topology, gathers in [("v4:2x2x1", False), ("v5e:2x2", True), ("v6e:2x2", True)]:
    with jax.default_device(tpu_compile_check.tpu_device(topology)):
      assert kernel.sublane_gathers_lower() is gathers, topology
