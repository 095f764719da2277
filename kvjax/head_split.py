"""A layer's KV heads in two groups with caches of their own (RazorAttention, DuoAttention).

Each group's heads are a static tuple of head indices; a group may be empty (None parts).
"""

import jax
import jax.numpy as jnp
import numpy as np


def split_heads(x: jax.Array, first: tuple[int, ...], second: tuple[int, ...]):
  """Heads on axis 1 -> (the `first` heads, the `second` heads); an empty group gives None."""
  take = lambda heads: x[:, np.asarray(heads)] if heads else None
  return take(first), take(second)


def join_heads(first_part, second_part, first: tuple[int, ...], second: tuple[int, ...]):
  """The inverse of `split_heads`."""
  parts = [part for part in (first_part, second_part) if part is not None]
  if len(parts) == 1:
    return parts[0]
  restore = np.argsort(np.asarray(first + second))
  return jnp.concatenate(parts, axis=1)[:, restore]


def join_head_partials(first_part, second_part, first, second):
  """`join_heads` of two groups' (out, lse) partials, either of which may be None."""
  pick = lambda part, i: None if part is None else part[i]
  return (
    join_heads(pick(first_part, 0), pick(second_part, 0), first, second),
    join_heads(pick(first_part, 1), pick(second_part, 1), first, second),
  )
