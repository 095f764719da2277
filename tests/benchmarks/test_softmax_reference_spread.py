"""benchmarks/softmax_reference_spread.py's per-split statistics, on random keys and queries
(the script itself runs them on SmolLM2's)."""

import numpy as np
import pytest

from benchmarks.softmax_reference_spread import split_statistics
from pallas_kernels.softmax_reference_bounds import HEADROOM, UNDERFLOW_MARGIN


@pytest.mark.parametrize("bits,split_groups", [(2, 2), (4, 3)])
def test_served_splits_sit_within_the_bounds_guarantees(bits, split_groups):
  """Every split is counted once; in a served one the true max lies below the bound U (U - M
  >= 0) and the reference HEADROOM below U, so m - M = U - M - HEADROOM, at most the margin."""
  rng = np.random.default_rng(bits)
  heads, group, head_dim, tokens, group_size = 2, 3, 64, 256, 32
  queries = rng.standard_normal((heads, group, head_dim)).astype(np.float32)
  keys = rng.standard_normal((heads, tokens, head_dim)).astype(np.float32)
  # one head with a wide channel the queries weigh: its bounds are loose, its splits exact
  keys[1, :, 7] *= 400.0
  queries[1, :, 7] = 2.0
  exchange, gaps, offsets = split_statistics(
    queries, keys, bits=bits, group_size=group_size, split_groups=split_groups, sm_scale=0.125
  )
  splits = -(-tokens // group_size // split_groups)
  assert exchange.shape == (heads * splits,)
  served = int((~exchange).sum())
  assert gaps.shape == offsets.shape == (served * group,)
  assert served > 0 and exchange.any()
  assert (gaps >= -1e-3).all()
  np.testing.assert_allclose(offsets, gaps - HEADROOM, atol=1e-3)
  assert (offsets <= UNDERFLOW_MARGIN).all()
