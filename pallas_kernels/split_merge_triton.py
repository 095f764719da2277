"""The folded kernels' split merge in one kernel (Pallas, Triton lowering), beside its jnp
reference.

The folded Mosaic GPU kernel writes, per split of each sequence, a normalised partial output
with the head dim on its products' M side and one column per query row and value slot (f32
[B, H, S, D, R]), and each row's log-sum-exp (f32 [B, H, S, R]). What a caller wants is one
output per real query row in channel order: the splits merged by log-sum-exp, each channel's
columns taken from its value group's slot (`pick_value_slots`), and, where the rows are not in
channel order, each channel read at its row (`value_row_order`). XLA makes that four kernels of
the decode loop (the log-sum-exp's reduction, the weights, the weighted sum over the splits and
the pick with its transpose; KERNEL_NOTES v36), each a launch, and the weighted sum ran at about
1 TB/s in v34's profile (8.9 us for 8.5 MB under Nsight Compute). Here each program takes
`CHANNELS_PER_PROGRAM` channels of one head: it loads every split's log-sum-exp, computes the
weights, reads each channel's own slot of 32 splits at once (a gather: those loads are in flight
together; more splits, in steps of 32) and writes the merged rows in channel order with the
log-sum-exp.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.own_slot_partials import slot_first_column
from pallas_kernels.splits import merge_split_partials
from pallas_kernels.value_row_order import check_value_row_order, row_of_channel

# Who merges the folded Mosaic GPU kernel's split partials: XLA's fusions ("xla") or this kernel
# ("triton", one launch).
SPLIT_MERGES = ("xla", "triton")
DEFAULT_SPLIT_MERGE = "xla"
CHANNELS_PER_PROGRAM = 32  # 256 programs at batch 8 x 8 KV heads x head_dim 128
# Splits whose partials a program loads at once (32 at the shapes of record: all of them). Few
# heads get many splits (up to the planner's ~2000 programs at one head), so more are walked in
# steps of this many.
SPLITS_PER_STEP = 32
NUM_WARPS = 4


def check_split_merge(split_merge) -> None:
  """ValueError naming `split_merge` and its allowed values."""
  if split_merge not in SPLIT_MERGES:
    raise ValueError(f"split_merge={split_merge!r} is not supported; allowed: {SPLIT_MERGES}")


def pop_split_merge(settings: dict) -> str:
  """Takes `split_merge` out of a kernel's `settings` (the kernel's own outputs do not depend on
  it) and checks it: ValueError naming it and its allowed values."""
  split_merge = settings.pop("split_merge", DEFAULT_SPLIT_MERGE)
  check_split_merge(split_merge)
  return split_merge


def pick_value_slots(
  out: jax.Array, group_size: int, real_rows: int, positions: np.ndarray | None = None
) -> jax.Array:
  """f32 [..., D, rows] -> [..., D, real_rows]: channel c's rows from its value group's slot,
  columns [s * real_rows, (s + 1) * real_rows) with s = (c // group_size) % slots, read at
  row `positions[c]` (the operand position holding channel c; None: row c). One gather."""
  head_dim, rows = out.shape[-2:]
  channel = np.arange(head_dim)
  row = channel if positions is None else np.asarray(positions)
  first_column = slot_first_column(channel, group_size, real_rows, rows // real_rows)
  columns = first_column[:, None] + np.arange(real_rows)[None, :]
  flat = out.reshape(*out.shape[:-2], head_dim * rows)
  picked = jnp.take(flat, (row[:, None] * rows + columns).reshape(-1), axis=-1)
  return picked.reshape(*out.shape[:-2], head_dim, real_rows)


def merge_value_slot_partials_reference(
  out_partials: jax.Array,  # f32 [B, H, S, D, R]: normalised, D in operand positions
  lse_partials: jax.Array,  # f32 [B, H, S, R]
  *,
  group: int,
  group_size: int,
  real_rows: int,
  positions: np.ndarray | None = None,
  own_slot: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """(out f32 [B, H, G, D] in channel order, lse f32 [B, H, G]) by XLA: the splits merged
  first, then each channel's slot (and position) picked from the merged [B, H, D, R], so no
  gather runs over the partials (a split count times larger; KERNEL_NOTES v30). Column j of
  the partials is query row j % real_rows, and is weighed as that row. `own_slot`: the partials
  hold each channel's own slot alone, f32 [B, H, S, real_rows, D] (`own_slot_partials`): merged
  as they are, then each channel read at its position."""
  if own_slot:
    merged, total = merge_split_partials(out_partials, lse_partials, group, head_dim_last=True)
    return (merged if positions is None else merged[..., positions]), total
  rows = out_partials.shape[-1]
  merged, total = merge_split_partials(
    out_partials, lse_partials[..., np.arange(rows) % real_rows], rows, head_dim_last=False
  )  # [B, H, rows, D], [B, H, rows]
  picked = pick_value_slots(jnp.swapaxes(merged, 2, 3), group_size, real_rows, positions)
  return jnp.swapaxes(picked, 2, 3)[:, :, :group], total[:, :, :group]


def _merge_kernel(
  out_partials_ref,  # f32 [B, H, S, D, R], or [B, H, S, real_rows, D] with `own_slot`
  lse_partials_ref,  # f32 [B, H, S, R]
  merged_ref,  # f32 [B, H, G, D]
  total_ref,  # f32 [B, H, G]
  *,
  splits: int,
  group: int,
  group_size: int,
  real_rows: int,
  value_order: str,
  bits: int | None,
  own_slot: bool,
):
  batch, head, channel_block = (pl.program_id(axis) for axis in range(3))
  head_dim = merged_ref.shape[-1]
  rows = lse_partials_ref.shape[-1]
  slots = rows // real_rows
  steps = pl.cdiv(splits, SPLITS_PER_STEP)
  row = lax.iota(jnp.int32, real_rows)

  def splits_of(step):
    """The splits of `step` ([SPLITS_PER_STEP]) and which of them exist."""
    split = step * SPLITS_PER_STEP + lax.iota(jnp.int32, SPLITS_PER_STEP)
    return split, split < splits

  def step_lse(step):
    split, valid = splits_of(step)
    return _compat.triton_load(
      lse_partials_ref.at[batch, head, split[:, None], row[None, :]],
      mask=jnp.broadcast_to(valid[:, None], (SPLITS_PER_STEP, real_rows)),
      other=-jnp.inf,
    )  # [SPLITS_PER_STEP, real_rows]; splits past the last are empty

  # jax.nn.logsumexp's rule, over every split: a max that is not finite counts as 0, so an
  # all-empty row gives log(0) = -inf and a NaN anywhere gives NaN.
  top = lax.fori_loop(
    0,
    steps,
    lambda step, top: jnp.maximum(top, jnp.max(step_lse(step), axis=0)),
    jnp.full((real_rows,), -jnp.inf, jnp.float32),
  )
  safe_top = jnp.where(jnp.isfinite(top), top, 0.0)
  exp_sum = lax.fori_loop(
    0,
    steps,
    lambda step, total: total + jnp.sum(jnp.exp(step_lse(step) - safe_top[None, :]), axis=0),
    jnp.zeros((real_rows,), jnp.float32),
  )
  total = safe_top + jnp.log(exp_sum)
  # merge_split_partials' weights: an empty split (lse -inf) weighs 0, exactly.
  safe_total = jnp.where(total == -jnp.inf, 0.0, total)

  channel = channel_block * CHANNELS_PER_PROGRAM + lax.iota(jnp.int32, CHANNELS_PER_PROGRAM)
  slot = lax.rem(lax.div(channel, group_size), slots)
  column = slot[:, None] * real_rows + row[None, :]  # [channels, real_rows]
  position = row_of_channel(channel, value_order, head_dim, bits)
  shape = (SPLITS_PER_STEP, CHANNELS_PER_PROGRAM, real_rows)

  def add_step(step, merged):
    lse = step_lse(step)
    weights = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - safe_total[None, :]))
    split, valid = splits_of(step)
    if own_slot:  # the kernel kept each channel's slot alone (`own_slot_partials`)
      index = (split[:, None, None], row[None, None, :], position[None, :, None])
    else:
      index = (split[:, None, None], position[None, :, None], column[None, :, :])
    parts = _compat.triton_load(
      out_partials_ref.at[batch, head, *index],
      mask=jnp.broadcast_to(valid[:, None, None], shape),
      other=0.0,
    )  # the step's splits' slot of each channel, loaded together
    return merged + jnp.sum(weights[:, None, :] * parts, axis=0)

  merged = lax.fori_loop(
    0, steps, add_step, jnp.zeros((CHANNELS_PER_PROGRAM, real_rows), jnp.float32)
  )

  real_row = row < group
  _compat.triton_store(
    merged_ref.at[batch, head, row[None, :], channel[:, None]],
    merged,
    mask=jnp.broadcast_to(real_row[None, :], merged.shape),
  )
  _compat.triton_store(
    total_ref.at[batch, head, row],
    total,
    mask=real_row & (channel_block == 0),
  )


@functools.partial(
  jax.jit,
  static_argnames=(
    "group",
    "group_size",
    "real_rows",
    "value_order",
    "bits",
    "own_slot",
    "interpret",
  ),
)
def merge_value_slot_partials_triton(
  out_partials: jax.Array,  # f32 [B, H, S, D, R]: normalised, D in operand positions
  lse_partials: jax.Array,  # f32 [B, H, S, R]
  *,
  group: int,
  group_size: int,
  real_rows: int,
  value_order: str = "channel",
  bits: int | None = None,
  own_slot: bool = False,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """`merge_value_slot_partials_reference` as one kernel: (out f32 [B, H, G, D], lse f32
  [B, H, G]). `value_order`: the order of the partials' D axis (`value_row_order`: "channel",
  or "word" / "matrix" for codes of `bits` bits). `own_slot`: the partials hold each channel's
  own slot alone, f32 [B, H, S, real_rows, D] (`own_slot_partials`)."""
  check_value_row_order(value_order)
  if value_order != "channel" and bits is None:
    raise ValueError(f"value_order={value_order!r} needs bits (the codes' width), got None")
  batch, heads, splits = out_partials.shape[:3]
  head_dim = out_partials.shape[-1] if own_slot else out_partials.shape[-2]
  if head_dim % CHANNELS_PER_PROGRAM:
    raise ValueError(
      f"head_dim={head_dim} is not supported by the split-merge kernel; allowed: multiples of "
      f"{CHANNELS_PER_PROGRAM}"
    )
  kernel = functools.partial(
    _merge_kernel,
    splits=splits,
    group=group,
    group_size=group_size,
    real_rows=real_rows,
    value_order=value_order,
    bits=bits,
    own_slot=own_slot,
  )
  return pl.pallas_call(
    kernel,
    grid=(batch, heads, head_dim // CHANNELS_PER_PROGRAM),
    out_shape=(
      jax.ShapeDtypeStruct((batch, heads, group, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((batch, heads, group), jnp.float32),
    ),
    compiler_params=_compat.triton_compiler_params(num_warps=NUM_WARPS, num_stages=1),
    interpret=interpret,
    name="split_merge",
  )(out_partials, lse_partials)
