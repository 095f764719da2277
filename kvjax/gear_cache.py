"""GEAR: quantized backbone + sparse outliers + low-rank residual, on KIVI's streaming blocks.

Each block of `block` tokens (GEAR's streaming buffer n_b) is compressed per batch row and KV
head, for keys and for values separately, as a [block, head_dim] matrix X:

  1. outliers: the round(outliers/2 * block * head_dim) largest and as many smallest entries
     of X (by value; half-up rounding, at least one per side when outliers > 0) are taken out;
  2. the rest is quantized KIVI-style (keys per channel over groups of `group_size` tokens,
     values per token over groups of `group_size` channels); the outliers do not take part in
     their groups' min/max, so they cannot stretch the scales, and get code 0;
  3. S holds, at the outlier positions, the correction X - deq(codes) in the cache dtype, so
     deq + S reproduces the outliers up to that dtype's rounding of the correction (exactly in
     float32; in bfloat16 within 2^-9 of the correction, which the low-rank part then sees as
     residual; a correction past the dtype's largest finite number, possible in float16 only
     for values tens of thousands apart, is held at that number, the rest left to the
     residual). GEAR stores the raw outlier values next to a zero in the quantized matrix; ours
     does not widen the range with that zero;
  4. the residual X - deq - S is approximated at rank `rank` by `iterations` power iterations
     (`kvjax.quantization.low_rank`): A [block, rank], B [head_dim, rank].

K_hat = deq(codes) + S + A B^T. Storage is the pinned format of
`pallas_kernels.quantized_decode_attention_reference` (factors `k_a [B,H,T,r]`,
`k_b [B,H,T/block,D,r]`, COO outliers `[B,H,T/block,s]`, flat index t_local*D + d stored as
uint16, 2 bytes per outlier, where a block has at most 2^16 entries, else int32). Where the
compiled TPU kernel reads them, s is the outlier count rounded up to whole 128-lane tiles, the
slots past the outliers zeros (`GearCodec.outlier_slots`), so that a TPU's default layout of the
arrays is the kernel's.
Attention sums the quantized, low-rank and sparse terms separately (no dequantized K/V for the
whole context) and merges with the full-precision window by log-sum-exp, exactly as KIVI.

GEAR-L is `outliers=0`; `rank=0` drops the low-rank part. One rank is used for every block
(the authors use rank 4 for the prompt and 2 for decode blocks); a prompt is compressed block by
block like decoded tokens, each block with its own factors, and its last L mod block tokens stay
in the full-precision window.

Outliers are taken per (block, KV head) over the whole [block, head_dim] matrix, as DESIGN.md
states the rule. The authors' code takes s/2 per channel for keys and per token for values, so
every quantization group loses its own extremes.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax import attention_dispatch
from kvjax.cache_protocol import ModelCacheShape
from kvjax.kernel_settings import DEFAULT_KERNEL_SETTINGS, KernelSettings, check_kernel_settings
from kvjax.kivi_cache import (
  KiviCodec,
  KiviLayerCache,
  QuantizedKV,
  check_no_sliding_window,
  check_window,
)
from kvjax.method_registry import register_method
from kvjax.quantization.group_quantization import (
  GroupQuantized,
  check_quantization_config,
  dequantize_keys,
  dequantize_values,
  quantize_keys_per_channel,
  quantize_values_per_token,
  round_to_dtype,
)
from kvjax.quantization.low_rank import check_iterations, check_rank, power_iteration_low_rank
from kvjax.quantization.outliers import (
  check_outlier_fraction,
  extract_outliers,
  outlier_count_per_side,
  scatter_outliers,
)


@dataclasses.dataclass(frozen=True)
class _CompressedMatrix:
  """One of K or V compressed block by block (arrays of the pinned storage format)."""

  quantized: GroupQuantized
  lowrank_a: jax.Array | None  # [B, H, T, r]
  lowrank_b: jax.Array | None  # [B, H, T/block, D, r]
  outlier_index: jax.Array | None  # uint16 (int32 past 2^16 entries a block) [B, H, T/block, s]
  outlier_value: jax.Array | None  # [B, H, T/block, s]


@dataclasses.dataclass(frozen=True)
class GearCodec(KiviCodec):
  """KIVI quantization plus per-block outliers and low-rank residual factors."""

  rank: int = 2
  outliers_per_side: int = 0  # per block and KV head, for K and for V each
  iterations: int = 3
  # Entries stored per block for K's outliers (and for V's): 0 for exactly 2 outliers_per_side,
  # or more, the rest zeros (index 0, value 0), which every reader adds as nothing. On a TPU,
  # whole lane tiles (`attention_dispatch.gear_outlier_slots`). Out of the repr, which a saved
  # context's description holds (`kvjax.context_checkpoint`): how many slots a backend stores is
  # layout, told by the outliers' shapes, and a context saved before v65 (whose codec had no
  # such field) or on another backend restores into a template made here.
  outlier_slots: int = dataclasses.field(default=0, repr=False)
  method_name: ClassVar[str] = "gear"

  def __post_init__(self):
    count = self.outlier_count or 0
    slots = self.outlier_slots
    if type(slots) is not int or (slots != 0 and slots < count):
      raise ValueError(
        f"outlier_slots={slots!r} must be 0 or an int >= 2 * outliers_per_side = {count}"
      )

  @property
  def block(self) -> int:
    return self.window

  @property
  def outlier_count(self) -> int | None:
    return 2 * self.outliers_per_side or None

  @property
  def stored_outliers(self) -> int:
    """Entries each block stores for K's outliers (and for V's)."""
    return max(self.outlier_slots, self.outlier_count or 0)

  def check_fits(self, head_dim: int) -> None:
    super().check_fits(head_dim)
    check_rank(self.rank, head_dim=head_dim, block=self.block)

  def _compress(self, x, quantize, dequantize, dtype) -> _CompressedMatrix:
    """Steps 1-4 of the module docstring on x [B, H, T, D], block by block."""
    batch, kv_heads, tokens, head_dim = x.shape
    blocks, block_elements = tokens // self.block, self.block * head_dim
    x = round_to_dtype(x, x.dtype)  # float32 of exactly the values held in x's dtype
    exclude = outliers = None
    if self.outliers_per_side:
      outliers = extract_outliers(
        x.reshape(batch, kv_heads, blocks, block_elements), self.outliers_per_side
      )
      exclude = outliers.mask.reshape(x.shape)
    quantized = quantize(
      x, bits=self.bits, group_size=self.group_size, dtype=dtype, exclude=exclude
    )
    dequantized = dequantize(*quantized, bits=self.bits, group_size=self.group_size)
    residual = x - dequantized
    outlier_index = outlier_value = None
    if outliers is not None:
      dequantized_at_outliers = jnp.take_along_axis(
        dequantized.reshape(batch, kv_heads, blocks, block_elements), outliers.indices, axis=-1
      )
      outlier_index = outliers.indices
      # What is stored (rounded to dtype) is what the low-rank part must complement. An
      # outlier far from its group's range can differ from the group by more than the dtype
      # holds (float16: 40000 beside a group at -40000); held as the largest finite
      # correction, the rest is left to the residual instead of stored as inf.
      largest = float(jnp.finfo(dtype).max)
      correction = jnp.clip(outliers.values - dequantized_at_outliers, -largest, largest)
      stored_correction = round_to_dtype(correction, dtype)
      outlier_value = stored_correction.astype(dtype)
      sparse = scatter_outliers(outlier_index, stored_correction, block_elements)
      residual = residual - sparse.reshape(x.shape)
      padding = [(0, 0)] * 3 + [(0, self.stored_outliers - outlier_index.shape[-1])]
      outlier_index, outlier_value = (jnp.pad(a, padding) for a in (outlier_index, outlier_value))
    lowrank_a = lowrank_b = None
    if self.rank:
      factors = power_iteration_low_rank(
        residual.reshape(batch, kv_heads, blocks, self.block, head_dim),
        self.rank,
        iterations=self.iterations,
      )
      lowrank_a = factors.a.reshape(batch, kv_heads, tokens, self.rank).astype(dtype)
      lowrank_b = factors.b.astype(dtype)  # [B, H, blocks, D, r]
    return _CompressedMatrix(quantized, lowrank_a, lowrank_b, outlier_index, outlier_value)

  def encode(self, keys, values, dtype) -> QuantizedKV:
    k = self._compress(keys, quantize_keys_per_channel, dequantize_keys, dtype)
    v = self._compress(values, quantize_values_per_token, dequantize_values, dtype)
    return QuantizedKV(
      *k.quantized,
      *v.quantized,
      lowrank=(k.lowrank_a, k.lowrank_b, v.lowrank_a, v.lowrank_b) if self.rank else None,
      outliers=(
        (k.outlier_index, k.outlier_value, v.outlier_index, v.outlier_value)
        if self.outliers_per_side
        else None
      ),
    )

  def decode(self, segment: QuantizedKV) -> tuple[jax.Array, jax.Array]:
    """Materialised K_hat = deq + S + A B^T (and V_hat), float32: tests and analysis only."""
    keys, values = super().decode(segment)
    batch, kv_heads, tokens, head_dim = keys.shape
    if not tokens:  # a cache of at most one block has no segment, so no terms to add
      return keys, values
    blocks = tokens // self.block

    def add_terms(dense, lowrank_a, lowrank_b, outlier_index, outlier_value):
      if lowrank_a is not None:
        a = lowrank_a.astype(jnp.float32).reshape(batch, kv_heads, blocks, self.block, -1)
        low_rank = jnp.einsum("bhjtr,bhjdr->bhjtd", a, lowrank_b.astype(jnp.float32))
        dense = dense + low_rank.reshape(dense.shape)
      if outlier_index is not None:
        sparse = scatter_outliers(outlier_index, outlier_value, self.block * head_dim)
        dense = dense + sparse.reshape(dense.shape)
      return dense

    k_a, k_b, v_a, v_b = segment.lowrank or (None,) * 4
    k_index, k_value, v_index, v_value = segment.outliers or (None,) * 4
    return (
      add_terms(keys, k_a, k_b, k_index, k_value),
      add_terms(values, v_a, v_b, v_index, v_value),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GearLayerCache(KiviLayerCache):
  """KIVI's streaming cache whose blocks are compressed with `GearCodec`."""


@register_method("gear", kind="storage")
@dataclasses.dataclass(frozen=True)
class Gear:
  """Cache method `gear`. Defaults after the GEAR authors: 2-bit backbone, group 64, rank 2,
  2% outliers, streaming blocks of 64 tokens, 3 power iterations. `outliers=0` is GEAR-L.
  """

  bits: int = 2
  group_size: int = 64
  rank: int = 2
  outliers: float = 0.02
  block: int = 64
  iterations: int = 3
  implementation: str = "auto"
  kernel_settings: KernelSettings = DEFAULT_KERNEL_SETTINGS

  def __post_init__(self):
    check_quantization_config(bits=self.bits, group_size=self.group_size)
    check_window("block", self.block, self.group_size)
    check_rank(self.rank, block=self.block)
    check_outlier_fraction(self.outliers)
    check_iterations(self.iterations)
    attention_dispatch.check_implementation(self.implementation)
    check_kernel_settings(self.kernel_settings)

  def codec_for_head_dim(self, head_dim: int) -> GearCodec:
    per_side = outlier_count_per_side(self.outliers, self.block * head_dim)
    return GearCodec(
      bits=self.bits,
      group_size=self.group_size,
      window=self.block,
      rank=self.rank,
      outliers_per_side=per_side,
      iterations=self.iterations,
      outlier_slots=attention_dispatch.gear_outlier_slots(
        self.implementation, head_dim, 2 * per_side, self.kernel_settings.kernel_backend
      ),
    )

  def allocate_storage(self, *, batch, kv_heads, capacity, head_dim, dtype) -> GearLayerCache:
    """A cache holding `capacity` tokens per row (what selection methods store survivors in)."""
    return GearLayerCache.zeros(
      codec=self.codec_for_head_dim(head_dim),
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
