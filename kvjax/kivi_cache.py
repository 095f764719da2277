"""KIVI: a 2/4/8-bit quantized KV cache with a full-precision residual window.

Storage of one layer (`KiviLayerCache`):
  - a quantized segment (`QuantizedKV`) of `quantized_capacity` tokens in the pinned format of
    `pallas_kernels.quantized_decode_attention_reference`: keys per channel over groups of
    `group_size` tokens, values per token over groups of `group_size` channels, codes packed
    into uint32 words, scales/minimums in the cache dtype at their true granularity;
  - a full-precision window of `window` (KIVI's residual R) slots holding each row's most
    recent tokens. A cache allocated for at most R tokens never flushes a block, so its
    window has only as many slots as it was asked to hold (short generations then cost what
    the full cache costs, not R tokens' worth). Otherwise the segment has whole blocks of R for
    all but the last of the tokens asked for, and the window R slots: a row filled to capacity
    keeps its last 1..R tokens in the window. So a cache holds exactly what it was asked for
    when that is a multiple of R, and at most R - 1 tokens more otherwise (whole blocks). A
    prompt that fills its cache (no room, a multiple of R tokens) thus keeps its last block in
    full precision, where a cache with room quantizes it as KIVI's prefill does. Where the
    compiled TPU kernel reads the segment (head_dim >= 128), its capacity is rounded up to whole
    tiles of the key statistics' rows (512 tokens at group 32 in bfloat16:
    `attention_dispatch.quantized_segment_granule`), so that a TPU's default layout of the
    stored statistics is the one the kernel reads and its last block is whole tiles: a few
    hundred tokens of room more, counted in the cache's bytes.

Segment schedule. The K and V of a token always live in the same segment, and the segment
holds whole blocks of `window` tokens:
  - ingest of a row of length L: its first L - (L mod R) tokens are quantized, the last L mod R
    go to the window (a row filled to capacity keeps its last whole block in the window: the
    segment has no room for it);
  - append: a window that holds R tokens is quantized as a whole block, written after the row's
    quantized tokens and emptied; then the token goes to the window. A window fills at one
    append and is quantized at the next, so the query of the token that filled it attends over
    all R in full precision, as in KIVI's code (which quantizes after that attention);
  - ingest_chunk (chunked prefill): the window's tokens and the chunk's, in order, are cut into
    blocks of R; whole blocks are quantized and written, the rest is the new window. So a
    prompt in chunks ends with the codes a one-piece ingest makes.
Deviation from the paper: KIVI keeps exactly the last R *values* in full precision (the oldest
value is quantized as the R+1-th arrives) while keys flush in blocks of R. Here values follow
the keys' block schedule, so a decode step's query sees 1..R values in full precision (on
average fewer than the paper's R, never more), one length per segment suffices, and the
quantized segment keeps the pinned block layout the kernels read.

Rows of a batch flush at different steps. Under jit nothing branches on traced values per row:
each append encodes the window's block (inside one `lax.cond` on "any row flushes", so steps
without a flush skip the arithmetic) and writes it with a single scatter whose rows that do not
flush point past the end of the storage and are dropped (in place inside a scan carry).

Attention never dequantizes the whole context: the quantized segment goes through
`attention_dispatch.quantized_decode_attention` (score/value decomposition over the codes), the
window through `attention_dispatch.decode_attention`, and the two partial results are merged by
log-sum-exp.

GEAR (`kvjax.gear_cache`) reuses this cache with a codec that adds sparse outliers and low-rank
factors per block.
"""

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from kvjax import attention_dispatch
from kvjax.cache_protocol import ModelCacheShape, check_count, tree_nbytes
from kvjax.chunk_attention import attend_folded_chunk
from kvjax.compact_rows import cut_or_pad_to, write_blocks_by_row_slices, write_token_at_lengths
from kvjax.kernel_settings import DEFAULT_KERNEL_SETTINGS, KernelSettings, check_kernel_settings
from kvjax.method_registry import register_method
from kvjax.quantization.group_quantization import (
  check_quantization_config,
  dequantize_keys,
  dequantize_values,
  quantize_keys_per_channel,
  quantize_values_per_token,
)
from pallas_kernels import quantized_decode_attention_tpu
from pallas_kernels.decode_attention_reference import merge_attention_partials


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
  """A quantized K/V segment of T tokens (T a multiple of the codec's window).

  Every array has the token-like axis at position 2, at its own granularity, so a block of
  tokens maps to a contiguous range of rows of each array.
  """

  k_codes: jax.Array  # uint32 [B, H, T, D*bits/32]
  k_scale: jax.Array  # [B, H, T/group_size, D]
  k_min: jax.Array  # [B, H, T/group_size, D]
  v_codes: jax.Array  # uint32 [B, H, T, D*bits/32]
  v_scale: jax.Array  # [B, H, T, D/group_size]
  v_min: jax.Array  # [B, H, T, D/group_size]
  # GEAR only: (k_a [B,H,T,r], k_b [B,H,T/block,D,r], v_a, v_b)
  lowrank: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None
  # GEAR only: (k_index [B,H,T/block,s] (uint16 where a block has at most 2^16 entries, else
  # int32), k_value [B,H,T/block,s], v_index, v_value)
  outliers: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None

  @property
  def tokens(self) -> int:
    return self.k_codes.shape[2]


@dataclasses.dataclass(frozen=True)
class KiviCodec:
  """How a block of tokens is compressed: group-wise quantization only (KIVI)."""

  bits: int
  group_size: int
  window: int  # tokens per flushed block: KIVI's residual R
  method_name: ClassVar[str] = "kivi"  # the cache method whose errors these are

  @property
  def outlier_count(self) -> int | None:
    """The outliers a block holds in its first outlier slots (GEAR's); None: none."""
    return None

  def check_head_dim(self, head_dim: int) -> None:
    """`check_fits`, its error naming the method (a composed spec such as `snapkv+kivi` says
    which part does not fit the model)."""
    try:
      self.check_fits(head_dim)
    except ValueError as error:
      raise ValueError(f"{self.method_name}: {error}") from None

  def check_fits(self, head_dim: int) -> None:
    check_quantization_config(bits=self.bits, group_size=self.group_size, head_dim=head_dim)

  def encode(
    self,
    keys: jax.Array,  # [B, H, T, D], T % window == 0
    values: jax.Array,  # [B, H, T, D]
    dtype,  # storage dtype of scales, minimums (and GEAR's factors and outliers)
  ) -> QuantizedKV:
    k = quantize_keys_per_channel(keys, bits=self.bits, group_size=self.group_size, dtype=dtype)
    v = quantize_values_per_token(values, bits=self.bits, group_size=self.group_size, dtype=dtype)
    return QuantizedKV(k.codes, k.scale, k.minimum, v.codes, v.scale, v.minimum)

  def decode(self, segment: QuantizedKV) -> tuple[jax.Array, jax.Array]:
    """Materialised (K_hat, V_hat) float32 [B, H, T, D]: tests and analysis, never attention."""
    keys = dequantize_keys(
      segment.k_codes, segment.k_scale, segment.k_min, bits=self.bits, group_size=self.group_size
    )
    values = dequantize_values(
      segment.v_codes, segment.v_scale, segment.v_min, bits=self.bits, group_size=self.group_size
    )
    return keys, values


def _write_blocks(
  storage: QuantizedKV,  # [B, H, capacity-granular rows, ...]
  blocks: QuantizedKV,  # `num_given` consecutive blocks of `window` tokens per row
  *,
  start_tokens: jax.Array,  # int32 [B]: first token of the first block (a multiple of window)
  num_blocks: jax.Array,  # int32 [B]: blocks each row writes (its first ones; 0 writes none)
  window: int,
  layouts: dict[str, tuple[int, ...]] | None = None,
) -> QuantizedKV:
  """`storage[b, :, rows of blocks[b, :num_blocks[b]]] = ...`: one scatter per array; or, with
  `layouts` (where the TPU reads them: `attention_dispatch.quantized_segment_layouts`), one
  update slice per row and block, the arrays it reads row-major pinned to that layout."""
  batch = start_tokens.shape[0]
  batch_index = jnp.arange(batch)[:, None, None]
  num_given = blocks.tokens // window

  def write_array(path, stored, new):  # stored [B, H, rows, ...], new [B, H, given * rpb, ...]
    rows_per_block = new.shape[2] // num_given
    first_rows = start_tokens // window * rows_per_block  # [B]
    if layouts is not None:
      # Only the row-major layouts are pinned. The others (tokens minor) XLA picks by itself
      # for these narrow arrays; and a pinned layout becomes the layout of a jitted function's
      # output when the cache is returned, which jax on the CPU then read as row-major (wrong
      # values). A field's layout holds for each array of it (GEAR's outliers).
      order = layouts.get(path[0].name)
      pin = None
      if order is not None and order == tuple(range(stored.ndim)):
        pin = lambda array: with_layout_constraint(array, Layout(major_to_minor=order))
      return write_blocks_by_row_slices(
        stored, new, first_rows, num_blocks, rows_per_block, pin=pin
      )
    offsets = jnp.arange(new.shape[2])
    row_index = first_rows[:, None] + offsets  # [B, given rows]
    # Rows past a row's blocks write past the end, and mode="drop" discards them.
    written = offsets[None, :] < (num_blocks * rows_per_block)[:, None]
    row_index = jnp.where(written, row_index, stored.shape[2])
    # Indices on batch, head and row, each write a trailing row: a scatter whose window is the
    # row alone keeps the storage's row-major layout on a TPU. (One whose window spans the
    # heads, [H, ...] per row, made XLA lay the storage out heads-minor there, padded to 128
    # lanes, and copy it for the attention kernel at every step: KERNEL_NOTES v49.)
    head_index = jnp.arange(stored.shape[1])[None, :, None]
    return stored.at[batch_index, head_index, row_index[:, None, :]].set(
      new.astype(stored.dtype), mode="drop"
    )

  return jax.tree_util.tree_map_with_path(write_array, storage, blocks)


def _window_tokens(
  x: jax.Array,  # [B, H, tokens, D]
  first: jax.Array,  # int32 [B]: each row's first token for the window
  window_lengths: jax.Array,  # int32 [B]: tokens the window takes from there
  slots: int,
) -> jax.Array:  # [B, H, slots, D]: those tokens from slot 0, zeros past them
  source = jnp.minimum(first[:, None] + jnp.arange(slots), x.shape[2] - 1)
  taken = jnp.take_along_axis(x, source[:, None, :, None], axis=2)
  in_window = (jnp.arange(slots)[None, :] < window_lengths[:, None])[:, None, :, None]
  return jnp.where(in_window, taken, jnp.zeros((), x.dtype))


def _zero_rows_past(
  segment: QuantizedKV,  # T tokens
  kept_tokens: jax.Array,  # int32 [B], multiples of every array's tokens-per-row
) -> QuantizedKV:
  """Zeroes every array's rows that hold tokens at or past `kept_tokens[b]`."""
  tokens = segment.tokens

  def zero(array):
    rows = array.shape[2]
    first_token = jnp.arange(rows) * (tokens // rows)
    keep = first_token[None, :] < kept_tokens[:, None]  # [B, rows]
    keep = keep.reshape(keep.shape[0], 1, rows, *([1] * (array.ndim - 3)))
    return jnp.where(keep, array, jnp.zeros((), array.dtype))

  return jax.tree_util.tree_map(zero, segment)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KiviLayerCache:
  """One layer's quantized segment + full-precision window (see the module docstring)."""

  segment: QuantizedKV  # [B, H, quantized_capacity tokens, ...]
  window_keys: jax.Array  # [B, H, window, D] cache dtype
  window_values: jax.Array  # [B, H, window, D]
  quantized_lengths: jax.Array  # int32 [B]: tokens in the segment, a multiple of window
  window_lengths: jax.Array  # int32 [B]: tokens in the window, in [0, window_slots]
  codec: KiviCodec = dataclasses.field(metadata=dict(static=True))
  implementation: str = dataclasses.field(default="auto", metadata=dict(static=True))
  kernel_settings: KernelSettings = dataclasses.field(
    default=DEFAULT_KERNEL_SETTINGS, metadata=dict(static=True)
  )

  @classmethod
  def zeros(
    cls,
    *,
    codec,
    batch,
    kv_heads,
    capacity,
    head_dim,
    dtype,
    implementation="auto",
    kernel_settings=DEFAULT_KERNEL_SETTINGS,
  ):
    """A cache that holds at least `capacity` tokens per row."""
    check_count("capacity", capacity, 0)
    codec.check_head_dim(head_dim)
    # Whole blocks for all but the last of `capacity` tokens: a row filled to capacity keeps its
    # last 1..R tokens in the window, so the window's R slots are never left empty by design.
    quantized_capacity = max(int(capacity) - 1, 0) // codec.window * codec.window
    # A cache that never flushes a block needs no more window slots than tokens it holds.
    window_slots = codec.window if quantized_capacity else max(int(capacity), 1)
    encoded = lambda tokens: jax.eval_shape(
      lambda keys, values: codec.encode(keys, values, dtype),
      *[jax.ShapeDtypeStruct((batch, kv_heads, tokens, head_dim), dtype)] * 2,
    )
    segment_shapes = encoded(quantized_capacity)
    # On a TPU the segment holds whole tiles of key-statistic rows (at most a few hundred tokens
    # more), so that its kernel reads it as stored (`quantized_segment_granule`).
    granule = attention_dispatch.quantized_segment_granule(
      implementation,
      head_dim,
      codec.group_size,
      segment_shapes.k_scale.dtype,
      kernel_settings.kernel_backend,
      outlier_block=_outlier_block(codec),
    )
    rounded = round_segment_tokens(quantized_capacity, granule, codec.window)
    if rounded != quantized_capacity:
      quantized_capacity = rounded
      segment_shapes = encoded(quantized_capacity)
    window_shape = (batch, kv_heads, window_slots, head_dim)
    return cls(
      segment=jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), segment_shapes),
      window_keys=jnp.zeros(window_shape, dtype),
      window_values=jnp.zeros(window_shape, dtype),
      quantized_lengths=jnp.zeros((batch,), jnp.int32),
      window_lengths=jnp.zeros((batch,), jnp.int32),
      codec=codec,
      implementation=implementation,
      kernel_settings=kernel_settings,
    )

  @property
  def window(self) -> int:
    """Tokens per flushed block (KIVI's residual R)."""
    return self.codec.window

  @property
  def window_slots(self) -> int:
    """Full-precision slots: `window`, or fewer in a cache of at most one block."""
    return self.window_keys.shape[2]

  @property
  def quantized_capacity(self) -> int:
    return self.segment.tokens

  @property
  def capacity(self) -> int:
    """Most tokens a row can hold: a full segment and a full window (a cache of at most one
    block never flushes and holds as many tokens as its window has slots)."""
    return self.quantized_capacity + self.window_slots

  @property
  def room(self) -> jax.Array:  # int32 [B]: tokens each row can still take
    return self.capacity - self.lengths

  @property
  def tokens_seen(self) -> jax.Array:  # int32 [batch]: the position of each row's next token
    return self.lengths

  @property
  def dtype(self):
    return self.window_keys.dtype

  @property
  def lengths(self) -> jax.Array:  # int32 [B]
    return self.quantized_lengths + self.window_lengths

  def ingest(self, keys, values, queries, lengths):
    del queries  # a codec stores every token it is given
    prompt_len = keys.shape[2]
    if prompt_len > self.capacity:
      raise ValueError(f"prompt of {prompt_len} tokens exceeds cache capacity {self.capacity}")
    window = self.window
    lengths = lengths.astype(jnp.int32)
    # Quantize what the cache would hold in its dtype, so ingesting a prompt and streaming the
    # same tokens through the window give the same codes.
    keys = keys.astype(self.dtype)
    values = values.astype(self.dtype)
    # A row filled to capacity ends with a full window: the segment has no room for its last
    # block, which the window holds as it does after the append that filled it.
    quantized_lengths = jnp.minimum(lengths - lengths % window, self.quantized_capacity)
    window_lengths = lengths - quantized_lengths

    segment = self.segment
    full_block_tokens = min(prompt_len // window * window, self.quantized_capacity)
    if full_block_tokens:  # static: some row may have a whole block to quantize
      encoded = self.codec.encode(
        keys[:, :, :full_block_tokens], values[:, :, :full_block_tokens], self.dtype
      )
      encoded = _zero_rows_past(encoded, quantized_lengths)
      segment = jax.tree_util.tree_map(
        lambda stored, new: stored.at[:, :, : new.shape[2]].set(new.astype(stored.dtype)),
        segment,
        encoded,
      )

    # The window takes tokens [quantized_length, length) of each row, slot 0 onward.
    gather_window = lambda x: _window_tokens(
      x, quantized_lengths, window_lengths, self.window_slots
    )
    return dataclasses.replace(
      self,
      segment=segment,
      window_keys=gather_window(keys),
      window_values=gather_window(values),
      quantized_lengths=quantized_lengths,
      window_lengths=window_lengths,
    )

  def append(self, keys, values):
    window = self.window
    # KIVI quantizes a filled window only after the query of the token that filled it has
    # attended over it in full precision; so the block that filled at the previous append is
    # quantized now, before this token is written. A cache of at most one block (static)
    # never flushes: it holds at most `window_slots` tokens, and appending past that is a
    # capacity error.
    flush = (self.window_lengths == window) & (self.quantized_capacity > 0)  # bool [B]

    segment = self.segment
    held = (self.window_keys, self.window_values)
    layouts = self._segment_layouts()
    if self.quantized_capacity:
      emptied = flush[:, None, None, None]
      empty = lambda held: tuple(jnp.where(emptied, jnp.zeros((), self.dtype), x) for x in held)
      encode = lambda held: self.codec.encode(*held, self.dtype)
      block_shapes = jax.eval_shape(encode, held)
      no_block = lambda: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), block_shapes)
      if layouts is not None:
        # Where the compiled TPU kernel reads the cache, the windows of the rows that flush are
        # emptied in the flush branch: emptied at every step, the select over each whole window
        # made XLA lay it out anew and back for the kernel below 128 channels (a KIVI step
        # jitted alone copied 8 MiB a layer at batch 8, 8 KV heads, head_dim 64, now 2 MiB:
        # KERNEL_NOTES v66). Elsewhere the windows stay out of the branch: XLA on the CPU copied
        # both through the branch that does not flush, at every step.
        block, held = jax.lax.cond(
          jnp.any(flush),
          lambda held: (encode(held), empty(held)),
          lambda held: (no_block(), held),
          held,
        )
      else:
        block = jax.lax.cond(jnp.any(flush), lambda: encode(held), no_block)
        held = empty(held)
      segment = _write_blocks(
        segment,
        block,
        start_tokens=self.quantized_lengths,
        num_blocks=flush.astype(jnp.int32),
        window=window,
        layouts=layouts,
      )

    window_lengths = jnp.where(flush, 0, self.window_lengths)
    return dataclasses.replace(
      self,
      segment=segment,
      window_keys=write_token_at_lengths(held[0], keys, window_lengths),
      window_values=write_token_at_lengths(held[1], values, window_lengths),
      quantized_lengths=self.quantized_lengths + jnp.where(flush, window, 0),
      window_lengths=window_lengths + 1,
    )

  def ingest_chunk(self, keys, values, queries, counts):
    """Stores the first `counts[b]` tokens of a prompt chunk after each row's tokens: the
    window and the chunk together are cut into blocks, whole blocks are quantized, the rest is
    the new window. Blocks start at multiples of `window`, as in `ingest`, so a prompt ingested
    chunk by chunk gets the codes it gets in one piece."""
    del queries
    window, slots = self.window, self.window_slots
    keys, values = keys.astype(self.dtype), values.astype(self.dtype)
    chunk = keys.shape[2]
    combined_len = slots + chunk
    offsets = jnp.arange(combined_len)[None, :]  # [1, slots + chunk]
    from_chunk = offsets >= self.window_lengths[:, None]  # [B, slots + chunk]
    chunk_index = jnp.clip(offsets - self.window_lengths[:, None], 0, chunk - 1)
    totals = self.window_lengths + counts  # tokens of the window and the chunk, per row

    def combine(held, new):  # window slots then the chunk's tokens: [B, H, slots + chunk, D]
      taken = jnp.take_along_axis(new, chunk_index[:, None, :, None], axis=2)
      held = jnp.pad(held, ((0, 0), (0, 0), (0, chunk), (0, 0)))
      return jnp.where(from_chunk[:, None, :, None], taken, held)

    combined_keys, combined_values = (
      combine(self.window_keys, keys),
      combine(self.window_values, values),
    )
    segment = self.segment
    flushed = jnp.zeros_like(totals)
    if self.quantized_capacity:  # static: a cache of at most one block never flushes
      given = combined_len // window * window
      blocks = self.codec.encode(
        combined_keys[:, :, :given], combined_values[:, :, :given], self.dtype
      )
      # Only the blocks the segment has room for: a row filled to capacity keeps its last block
      # in the window, as `ingest` does.
      num_blocks = jnp.minimum(
        totals // window, (self.quantized_capacity - self.quantized_lengths) // window
      )
      segment = _write_blocks(
        segment,
        blocks,
        start_tokens=self.quantized_lengths,
        num_blocks=num_blocks,
        window=window,
        layouts=self._segment_layouts(),
      )
      flushed = num_blocks * window
    window_lengths = totals - flushed
    # Tokens [flushed, total) of each row's window + chunk.
    new_window = lambda combined: _window_tokens(combined, flushed, window_lengths, slots)

    return dataclasses.replace(
      self,
      segment=segment,
      window_keys=new_window(combined_keys),
      window_values=new_window(combined_values),
      quantized_lengths=self.quantized_lengths + flushed,
      window_lengths=window_lengths,
    )

  def segment_tokens_on_tpu(self, tokens: int, whole_outlier_blocks: bool = True) -> int:
    """The segment capacity this cache would have, asked for a segment of `tokens` (whole
    blocks), where the compiled TPU kernel reads it (`zeros`: whole tiles of its rows). Without
    `whole_outlier_blocks`, as v64 rounded it (GEAR's outliers were not yet in whole tiles of
    GEAR blocks: contexts saved then restore)."""
    granule = quantized_decode_attention_tpu.segment_token_granule(
      self.window_keys.shape[-1],
      self.codec.group_size,
      self.segment.k_scale.dtype,
      _outlier_block(self.codec) if whole_outlier_blocks else None,
    )
    return round_segment_tokens(tokens, granule, self.window)

  def with_segment_layout(self, tokens: int, codec: KiviCodec) -> "KiviLayerCache":
    """This cache with a segment of `tokens` token rows (whole blocks), stored as `codec` stores
    them: the same quantization, GEAR's outliers in `codec.stored_outliers` slots (where one
    backend's kernel reads another layout than the next's: `zeros`). Rows past `tokens` and
    slots past the outliers are cut off, or zeros added (what an empty row and a padding slot
    hold). The caller checks that no row holds more than `tokens` quantized tokens."""
    check_count("tokens", tokens, 0)
    if tokens % self.window:
      raise ValueError(
        f"tokens={tokens!r} must be a multiple of the cache's block of {self.window} tokens"
      )
    if _without_layout(codec) != _without_layout(self.codec):
      raise ValueError(
        f"codec={codec!r} must quantize as the cache's codec {self.codec!r} does (only its "
        "outlier_slots may differ)"
      )
    batch, kv_heads, _, head_dim = self.window_keys.shape
    stored = jax.eval_shape(
      lambda keys, values: codec.encode(keys, values, self.dtype),
      *[jax.ShapeDtypeStruct((batch, kv_heads, tokens, head_dim), self.dtype)] * 2,
    )
    return dataclasses.replace(
      self,
      segment=jax.tree.map(
        lambda held, want: cut_or_pad_to(held, want.shape), self.segment, stored
      ),
      codec=codec,
    )

  def _segment_layouts(self) -> dict[str, tuple[int, ...]] | None:
    return attention_dispatch.quantized_segment_layouts(
      self.implementation, self.segment.k_scale.shape[-1], self.kernel_settings.kernel_backend
    )

  def _attention_partials(self, queries, *, sm_scale, implementation):
    """(out, lse) over the quantized segment (if any) and over the window."""
    partials = []
    if self.quantized_capacity:
      segment = self.segment
      partials.append(
        attention_dispatch.quantized_decode_attention(
          queries,
          segment.k_codes,
          segment.k_scale,
          segment.k_min,
          segment.v_codes,
          segment.v_scale,
          segment.v_min,
          self.quantized_lengths,
          bits=self.codec.bits,
          group_size=self.codec.group_size,
          sm_scale=sm_scale,
          lowrank=segment.lowrank,
          outliers=segment.outliers,
          outlier_count=self.codec.outlier_count,
          block=self.window,
          implementation=implementation,
          kernel_config=self.kernel_settings.quantized_config(),
          kernel_backend=self.kernel_settings.kernel_backend,
        )
      )
    partials.append(
      attention_dispatch.decode_attention(
        queries,
        self.window_keys,
        self.window_values,
        self.window_lengths,
        sm_scale=sm_scale,
        implementation=implementation,
        kernel_config=self.kernel_settings.full_config(),
        kernel_backend=self.kernel_settings.kernel_backend,
      )
    )
    return partials

  def attend_with_lse(self, queries, *, sm_scale):
    """(out, lse) of one query position per row over the quantized segment and the window."""
    return merge_attention_partials(
      self._attention_partials(queries, sm_scale=sm_scale, implementation=self.implementation)
    )

  def attend(self, queries, *, sm_scale):
    return self.attend_with_lse(queries, sm_scale=sm_scale)[0]

  def attend_chunk(self, queries, *, sm_scale):
    """(out, lse) of a prompt chunk's queries over every token held (all precede the chunk)."""
    return attend_folded_chunk(
      lambda q: merge_attention_partials(
        self._attention_partials(q, sm_scale=sm_scale, implementation="reference")
      ),
      queries,
    )

  def dequantized(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(K, V float32 [B, H, quantized_capacity + window_slots, D], lengths): every slot
    materialised.

    Row b's tokens are slots [0, quantized_lengths[b]) then the window's [0, window_lengths[b])
    at slots quantized_capacity onward. Tests and analysis only; attention never does this.
    """
    keys, values = self.codec.decode(self.segment)
    return (
      jnp.concatenate([keys, self.window_keys.astype(jnp.float32)], axis=2),
      jnp.concatenate([values, self.window_values.astype(jnp.float32)], axis=2),
      self.lengths,
    )

  @property
  def nbytes(self) -> int:
    """Codes, scales, minimums, GEAR factors and outliers, the window and the lengths."""
    return tree_nbytes(self)

  @property
  def stored_elements(self) -> int:
    batch, kv_heads, _, head_dim = self.window_keys.shape
    return 2 * batch * kv_heads * (self.quantized_capacity + self.window_slots) * head_dim

  @property
  def bits_per_element(self) -> float:
    return 8 * self.nbytes / self.stored_elements


def _outlier_block(codec: KiviCodec) -> int | None:
  """Tokens a block of GEAR's outliers covers, where the codec stores outliers."""
  return codec.window if codec.outlier_count else None


def _without_layout(codec: KiviCodec) -> KiviCodec:
  """`codec` less how many outlier slots it stores (layout, not what it computes)."""
  if hasattr(codec, "outlier_slots"):
    return dataclasses.replace(codec, outlier_slots=0)
  return codec


def round_segment_tokens(tokens: int, granule: int, window: int) -> int:
  """A segment of `tokens` (whole blocks of `window`) rounded up to whole blocks that are whole
  `granule`s of tokens (a kernel's tiles; 1: as it is)."""
  if not tokens or granule <= 1:
    return tokens
  step = math.lcm(granule, window)
  return -(-tokens // step) * step


def check_window(name: str, window: int, group_size: int) -> None:
  if isinstance(window, bool) or not isinstance(window, int) or window < 1:
    raise ValueError(f"{name}={window!r} must be a positive int")
  if window % group_size:
    raise ValueError(
      f"{name}={window} must be a multiple of group_size={group_size} (keys are quantized "
      f"over groups of group_size tokens within each flushed block)"
    )


def check_no_sliding_window(method: str, shape: ModelCacheShape, capacity: int) -> None:
  """A quantized cache attends to every token it holds; a sliding-window model must not."""
  if shape.sliding_window is not None and shape.sliding_window < capacity:
    raise ValueError(
      f"{method}: the model attends within a sliding window of {shape.sliding_window} tokens "
      f"but prompt + max_new_tokens = {capacity}; {method} keeps every token, which would "
      "attend beyond the window. Use `full` (a ring buffer) or a shorter generation."
    )


@register_method("kivi", kind="storage")
@dataclasses.dataclass(frozen=True)
class Kivi:
  """Cache method `kivi`: `bits`-bit KIVI with a full-precision window of `residual` tokens.

  Authors' defaults: bits=2 (bits=4 recommended for GQA models), group_size=32, residual=128.
  """

  bits: int = 2
  group_size: int = 32
  residual: int = 128
  implementation: str = "auto"
  kernel_settings: KernelSettings = DEFAULT_KERNEL_SETTINGS

  def __post_init__(self):
    check_quantization_config(bits=self.bits, group_size=self.group_size)
    check_window("residual", self.residual, self.group_size)
    attention_dispatch.check_implementation(self.implementation)
    check_kernel_settings(self.kernel_settings)

  @property
  def codec(self) -> KiviCodec:
    return KiviCodec(bits=self.bits, group_size=self.group_size, window=self.residual)

  def allocate_storage(self, *, batch, kv_heads, capacity, head_dim, dtype) -> KiviLayerCache:
    """A cache holding `capacity` tokens per row (what selection methods store survivors in)."""
    return KiviLayerCache.zeros(
      codec=self.codec,
      batch=batch,
      kv_heads=kv_heads,
      capacity=capacity,
      head_dim=head_dim,
      dtype=dtype,
      implementation=self.implementation,
      kernel_settings=self.kernel_settings,
    )

  def allocate(self, shape: ModelCacheShape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    del layer
    capacity = prompt_len + max_new_tokens
    check_no_sliding_window(self.method_name, shape, capacity)
    return self.allocate_storage(
      batch=batch,
      kv_heads=shape.num_kv_heads,
      capacity=capacity,
      head_dim=shape.head_dim,
      dtype=dtype,
    )
