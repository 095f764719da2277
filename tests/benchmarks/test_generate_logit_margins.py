"""The teacher-forced logit table of `benchmarks/generate_logit_margins.py` on made-up logits."""

import numpy as np

from benchmarks.generate_logit_margins import margins_table


def test_margin_difference_and_flip_per_step_and_row():
  reference = np.array(
    [
      [[0.0, 1.0, 0.99], [2.0, 0.0, 0.5]],  # step 0: rows 0 and 1
      [[3.0, 1.0, 0.0], [0.0, 0.0, 0.25]],  # step 1
    ],
    np.float32,
  )
  other = reference.copy()
  other[0, 0, 2] += 0.02  # a near tie flips: 0.99 + 0.02 > 1.0
  other[1, 1, 0] -= 0.1  # a difference that flips nothing
  rows = margins_table(reference, other)
  assert [(r["step"], r["row"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  np.testing.assert_allclose([r["margin"] for r in rows], [0.01, 1.5, 2.0, 0.25], atol=1e-6)
  np.testing.assert_allclose(
    [r["max_logit_difference"] for r in rows], [0.02, 0.0, 0.0, 0.1], atol=1e-6
  )
  assert [r["same_best"] for r in rows] == [False, True, True, True]
