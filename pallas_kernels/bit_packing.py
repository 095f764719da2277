"""Dense packing of 2/4/8-bit quantization codes into uint32 words, planar layout.

Layout ("planar"): with `n = 32 // bits` codes per word and a last axis of `L` codes
(`L % n == 0`), there are `W = L // n` words and

    packed[..., j] = OR_{k < n} code[..., k * W + j] << (bits * k)
    code[..., k * W + j] = (packed[..., j] >> (bits * k)) & (2**bits - 1)

So the k-th bit field of every word holds the contiguous slice `[k * W, (k + 1) * W)` of the
codes. Unpacking is `n` shifted-and-masked copies of the word array concatenated along the
last axis: no interleaving reshape, which keeps the kernels' unpack cheap (one shift and one
mask per code, words read once).
"""

import jax
import jax.numpy as jnp

SUPPORTED_BITS = (2, 4, 8)


def check_bits(bits: int) -> None:
  if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
    raise ValueError(f"bits={bits!r} is not supported; allowed: 2, 4, 8")


def codes_per_word(bits: int) -> int:
  check_bits(bits)
  return 32 // bits


def packed_width(length: int, bits: int) -> int:
  """Number of uint32 words holding `length` codes of `bits` bits (ValueError if not exact)."""
  per_word = codes_per_word(bits)
  if length % per_word != 0:
    raise ValueError(
      f"the packed axis has {length} codes, which is not a multiple of {per_word} "
      f"(= 32 // bits for bits={bits}); pad it or choose other bits"
    )
  return length // per_word


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
  """Packs integer codes in [0, 2**bits) along the last axis: [..., L] -> uint32 [..., L*bits/32].

  Codes outside [0, 2**bits) are masked to their low `bits` bits.
  """
  words = packed_width(codes.shape[-1], bits)
  per_word = 32 // bits
  mask = jnp.uint32((1 << bits) - 1)
  codes_u32 = codes.astype(jnp.uint32) & mask
  packed = jnp.zeros(codes.shape[:-1] + (words,), jnp.uint32)
  for field in range(per_word):
    slice_codes = codes_u32[..., field * words : (field + 1) * words]
    packed = packed | (slice_codes << jnp.uint32(bits * field))
  return packed


def unpack_codes(packed: jax.Array, bits: int) -> jax.Array:
  """Inverse of `pack_codes`: uint32 [..., W] -> uint8 codes [..., W * 32 // bits]."""
  check_bits(bits)
  if packed.dtype != jnp.uint32:
    raise ValueError(f"packed codes must be uint32, got dtype {packed.dtype}")
  per_word = 32 // bits
  mask = jnp.uint32((1 << bits) - 1)
  fields = [
    (jax.lax.shift_right_logical(packed, jnp.uint32(bits * field)) & mask)
    for field in range(per_word)
  ]
  return jnp.concatenate(fields, axis=-1).astype(jnp.uint8)
