import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.quantization import low_rank
from kvjax.quantization.low_rank import check_rank, power_iteration_low_rank


def _residual_like(seed, rows, columns, decay):
  """Random matrix with singular values falling like decay**i (decay 1: a flat spectrum)."""
  rng = np.random.default_rng(seed)
  u, _ = np.linalg.qr(rng.normal(size=(rows, rows)))
  v, _ = np.linalg.qr(rng.normal(size=(columns, columns)))
  size = min(rows, columns)
  singular = decay ** np.arange(size) * rng.uniform(0.5, 2.0)
  return (u[:, :size] * singular) @ v[:, :size].T


_power_iteration = jax.jit(power_iteration_low_rank, static_argnums=1)


@settings(max_examples=25, deadline=None)
@given(
  shape=st.sampled_from([(16, 8), (64, 32)]),
  rank=st.sampled_from([1, 2, 4]),
  decay=st.sampled_from([1.0, 0.9, 0.6]),
  seed=st.integers(0, 2**31 - 1),
)
def test_power_iteration_reduces_the_residual_close_to_a_truncated_svd(shape, rank, decay, seed):
  matrix = _residual_like(seed, *shape, decay).astype(np.float32)
  factors = _power_iteration(jnp.asarray(matrix), rank)
  a, b = np.asarray(factors.a), np.asarray(factors.b)
  assert a.shape == (shape[0], rank) and b.shape == (shape[1], rank)
  np.testing.assert_allclose(a.T @ a, np.eye(rank), atol=1e-5)  # orthonormal columns
  error = np.linalg.norm(matrix - a @ b.T)
  singular = np.linalg.svd(matrix, compute_uv=False)
  svd_error = np.sqrt(np.sum(singular[rank:] ** 2))
  assert error < np.linalg.norm(matrix)
  assert error <= 1.25 * svd_error + 1e-5
  # The energy the factors capture against the truncated SVD's: the bound above is loose where
  # the spectrum is flat (there a zero product meets it). With a flat spectrum every rank-r
  # subspace is optimal; with a steep one (0.6) three iterations nearly converge (>= 0.997 of
  # the optimum over 4000 seeds); with a shallow one (0.9, neighbouring singular values 10%
  # apart) they do not: >= 0.74.
  captured = np.linalg.norm(matrix) ** 2 - error**2
  assert captured >= {1.0: 0.9999, 0.9: 0.7, 0.6: 0.99}[decay] * np.sum(singular[:rank] ** 2)


def test_batched_factors_equal_per_matrix_factors_and_are_deterministic():
  matrices = np.stack([_residual_like(s, 16, 8, 0.8) for s in range(3)]).astype(np.float32)
  batched = power_iteration_low_rank(jnp.asarray(matrices), 2)
  again = power_iteration_low_rank(jnp.asarray(matrices), 2)
  np.testing.assert_array_equal(batched.a, again.a)
  for i, matrix in enumerate(matrices):
    single = power_iteration_low_rank(jnp.asarray(matrix), 2)
    np.testing.assert_allclose(
      np.asarray(batched.a[i] @ batched.b[i].T), np.asarray(single.a @ single.b.T), atol=1e-5
    )


def test_zero_residual_gives_zero_product_and_no_nans():
  factors = power_iteration_low_rank(jnp.zeros((2, 16, 8)), 2)
  product = np.asarray(jnp.einsum("...mr,...nr->...mn", factors.a, factors.b))
  assert np.all(np.isfinite(product)) and np.all(product == 0)


@pytest.mark.parametrize(
  "rank, kwargs, message",
  [
    (-1, {}, "rank=-1 must be a non-negative int"),
    (16, dict(head_dim=16), "rank=16 must be < head_dim=16"),
    (9, dict(head_dim=64, block=8), "rank=9 must be <= block=8"),
  ],
)
def test_bad_ranks_raise(rank, kwargs, message):
  with pytest.raises(ValueError, match=message):
    check_rank(rank, **kwargs)


def test_many_iterations_run_as_a_loop_that_converges_and_equals_the_unrolled_one(monkeypatch):
  """Past MAX_UNROLLED_ITERATIONS the iterations are an XLA loop: the program does not grow with
  their count (400 compile like 9), it computes what the unrolled iterations do, and on a
  shallow spectrum (where 3 iterations capture >= 0.74 of the optimum) 40 converge."""
  matrix = jnp.asarray(_residual_like(5, 64, 32, 0.9).astype(np.float32))
  lowered = {
    count: jax.jit(lambda m, count=count: power_iteration_low_rank(m, 2, iterations=count))
    .lower(matrix)
    .as_text()
    for count in (3, 9, 400)
  }
  loops = {count: text.count("stablehlo.while") for count, text in lowered.items()}
  assert loops[9] == loops[3] + 1  # (the random start's generator may hold loops of its own)
  assert lowered[400].count("\n") == lowered[9].count("\n")  # (only the trip count differs)
  looped = power_iteration_low_rank(matrix, 2, iterations=9)
  monkeypatch.setattr(low_rank, "MAX_UNROLLED_ITERATIONS", 9)
  unrolled = power_iteration_low_rank(matrix, 2, iterations=9)
  np.testing.assert_allclose(
    np.asarray(looped.a @ looped.b.T), np.asarray(unrolled.a @ unrolled.b.T), atol=1e-5
  )
  factors = power_iteration_low_rank(matrix, 2, iterations=40)
  error = np.linalg.norm(np.asarray(matrix - factors.a @ factors.b.T))
  singular = np.linalg.svd(np.asarray(matrix), compute_uv=False)
  np.testing.assert_allclose(error, np.sqrt(np.sum(singular[2:] ** 2)), rtol=1e-3)
