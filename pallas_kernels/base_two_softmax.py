"""The GPU decode kernels' online softmax runs in base 2, as FlashAttention-2 and -3 do.

The queries are scaled by sm_scale * log2(e) before a kernel sees them (XLA does it, on the
small query array), so every score a kernel computes, and every term added to the scores
(q . k_min, GEAR's low-rank and outlier terms, all linear in the queries), is a base-2 logit
s2 = s log2(e), and exp(s - m) is exp2(s2 - m2). jnp.exp on f32 lowers to libdevice's accurate
`__nv_expf` in Pallas-Triton (~15 SASS instructions, a range reduction around MUFU.EX2), and in
Mosaic GPU to a range reduction about 4 instructions longer than exp2's; jnp.exp2 is MUFU.EX2
with a denormal fix-up. Statically (sm_90a, 32k shapes of record, KERNEL_NOTES v20) that takes
the folded Triton KIVI-2 loop from 784 to 710 instructions per 128 tokens, the bf16 Triton
kernel from 252 to 205 per 32, and the folded Mosaic GPU loop from 1099 to 1057.

What leaves a kernel stays in natural units: the log-sum-exp of each split,
(m2 + log2(sum)) ln 2, so `merge_split_partials` and every caller see the reference's contract.
Only the scores the folded Triton kernel writes for GEAR's value terms are base 2
(`gear_terms_xla.gear_value_terms_from_scores` takes them so).

The TPU kernels keep natural units: their exp runs on the EUP, and nothing measured there says
base 2 pays.
"""

import math

import jax
import jax.numpy as jnp

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def base_two_queries(queries: jax.Array, sm_scale: float) -> jax.Array:
  """float32 queries times sm_scale log2(e): what every GPU kernel starts from, so that its
  scores come out as base-2 logits."""
  return queries.astype(jnp.float32) * (sm_scale * LOG2_E)


def natural_log_sum_exp(running_max: jax.Array, running_sum: jax.Array) -> jax.Array:
  """A split's log-sum-exp in natural units from its base-2 running max and sum (sum > 0)."""
  return (running_max + jnp.log2(running_sum)) * LN_2
