"""Products of a float32 operand and a bfloat16-exact one in one MXU pass, exact to 2^-16.

A TPU's MXU multiplies bfloat16 operands; a float32 operand takes its multi-pass precision
(HIGHEST: about three times the passes, or six), which in the TPU decode kernel cost more than
the work it served (KERNEL_NOTES v55, v56). Where the other operand is exact in bfloat16 (a 0/1
matrix, or values stored in bfloat16), the float32 one is split into its bfloat16 high half and
the rest, the two stacked along the rows: one pass gives both products, whose sum carries 16 of
the float32 operand's 24 significant bits (exact where it has no more, as the product of two
bfloat16 numbers)."""

import jax
import jax.numpy as jnp


def product_by_halves(a: jax.Array, b: jax.Array, contracting: tuple[int, ...]) -> jax.Array:
  """float32 [rows, n]: a [rows, k] (float32, contracting axis 1) times b, contracting b's axis
  `contracting`; b must be exact in bfloat16 (it is cast)."""
  rows = a.shape[0]
  a = a.astype(jnp.float32)
  high = a.astype(jnp.bfloat16)
  low = (a - high.astype(jnp.float32)).astype(jnp.bfloat16)
  both = jax.lax.dot_general(
    jnp.concatenate([high, low], axis=0),
    b.astype(jnp.bfloat16),
    (((1,), contracting), ((), ())),
    preferred_element_type=jnp.float32,
  )
  return both[:rows] + both[rows:]
