"""What `pallas_kernels._compat` adds to jax's own behaviour: kernels run by the Mosaic GPU and
TPU interpreters are waited for before their entry points return (KERNEL_NOTES v39: on jax 0.11.2
both interpreters could hang when the caller dispatched other work while the kernel's
computation ran)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
  _compat,
  decode_attention_mosaic_gpu,
  decode_attention_tpu,
  quantized_decode_attention_mosaic_gpu,
  quantized_decode_attention_tpu,
)
from pallas_kernels import quantized_decode_attention_folded_mosaic_gpu as folded
from pallas_kernels.quantized_decode_attention_reference import (
  quantized_decode_attention_reference,
)
from pallas_kernels.random_inputs import (
  random_full_segment,
  random_quantized_segment,
  random_queries,
)
from tests.pallas_kernels.kernel_checks import (
  assert_matches_reference,
  relative_tolerance,
  tpu_interpret,
  triton_interpret,
)
from tests.pallas_kernels.test_quantized_decode_attention_folded_mosaic_gpu import _kivi2_inputs

TOKENS = 128


def _full_precision_call(entry_point, rng):
  keys, values = random_full_segment(rng, 2, 2, TOKENS, 128, dtype=jnp.bfloat16)
  queries = random_queries(rng, 2, 2, 4, 128)
  lengths = jnp.asarray([TOKENS, 77], jnp.int32)
  return functools.partial(entry_point, queries, keys, values, lengths, sm_scale=0.125)


def _quantized_call(entry_point, rng):
  segment = random_quantized_segment(
    rng, 2, 2, TOKENS, 128, bits=2, group_size=32, dtype=jnp.bfloat16
  )
  queries = random_queries(rng, 2, 2, 4, 128)
  lengths = jnp.asarray([TOKENS, 77], jnp.int32)
  return functools.partial(
    entry_point, queries, *segment[:6], lengths, bits=2, group_size=32, sm_scale=0.125
  )


# name: (the entry point's call on random inputs, whether this run interprets that kernel)
CALLS = {
  "mosaic_gpu_full_precision": (
    functools.partial(
      _full_precision_call, decode_attention_mosaic_gpu.decode_attention_partials_mosaic_gpu
    ),
    triton_interpret,
  ),
  "mosaic_gpu_quantized": (
    functools.partial(
      _quantized_call,
      quantized_decode_attention_mosaic_gpu.quantized_decode_attention_partials_mosaic_gpu,
    ),
    triton_interpret,
  ),
  "mosaic_gpu_folded": (
    functools.partial(_quantized_call, folded.folded_partials_mosaic_gpu),
    triton_interpret,
  ),
  "tpu_full_precision": (
    functools.partial(_full_precision_call, decode_attention_tpu.decode_attention_partials_tpu),
    tpu_interpret,
  ),
  "tpu_quantized": (
    functools.partial(
      _quantized_call, quantized_decode_attention_tpu.quantized_decode_attention_partials_tpu
    ),
    tpu_interpret,
  ),
}


@pytest.mark.parametrize("kernel", sorted(CALLS))
def test_interpreted_kernels_wait_for_their_outputs(kernel, monkeypatch):
  """Each interpreted kernel's entry point hands its outputs to `finished_if_interpreted` (which
  waits for them: `jax.block_until_ready` returns the arrays it was given) before returning
  them."""
  make_call, interpreted = CALLS[kernel]
  if not interpreted():
    pytest.skip("interpret mode only (compiled natively in this run)")
  waited = []
  wait = _compat.finished_if_interpreted

  def recording_wait(outputs, interpret):
    waited.append(interpret)
    return wait(outputs, interpret)

  monkeypatch.setattr(_compat, "finished_if_interpreted", recording_wait)
  outputs = make_call(np.random.default_rng(0))(interpret=True)
  assert waited == [True]
  assert all(leaf.is_ready() for leaf in jax.tree.leaves(outputs))


def test_only_interpreted_outputs_are_waited_for(monkeypatch):
  blocked = []
  monkeypatch.setattr(jax, "block_until_ready", lambda tree: blocked.append(tree) or tree)
  outputs = (jnp.zeros(3), jnp.ones(2))
  assert _compat.finished_if_interpreted(outputs, False) is outputs and not blocked
  assert _compat.finished_if_interpreted(outputs, True) is outputs and blocked == [outputs]


# kernel: (the decode entry point, its settings per query group, whether this run interprets it)
HANG_CASES = {
  "mosaic_gpu_folded": (
    folded.folded_decode_attention_mosaic_gpu,
    {
      3: dict(
        block_tokens=64,
        num_splits=2,
        key_operand="registers",
        operand_order="word",
        split_merge="triton",
      ),
      4: dict(num_splits=3, split_merge="triton"),
    },
    triton_interpret,
  ),
  "tpu_quantized": (
    quantized_decode_attention_tpu.quantized_decode_attention_tpu,
    {3: {}, 4: {}},
    tpu_interpret,
  ),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kernel", sorted(HANG_CASES))
def test_interpreted_kernel_then_eager_reference_many_times(kernel):
  """The hang KERNEL_NOTES v39 found on jax 0.11.2: eager interpreted decode calls, each followed
  at once by the eager jnp reference (many small computations dispatched without waiting).
  Without the wait, the 4th to 17th call hung on a loaded 2-core machine (jax 0.11.2, both
  interpreters; none seen on 0.12)."""
  entry_point, settings, interpreted = HANG_CASES[kernel]
  if not interpreted():
    pytest.skip("interpret mode only (compiled natively in this run)")
  for repeat in range(15):
    for group, config in settings.items():
      arrays, clean = _kivi2_inputs(seed=repeat, group=group)
      quantization = dict(bits=2, group_size=32, sm_scale=0.125)
      out, lse = entry_point(*arrays, **quantization, interpret=True, **config)
      reference = quantized_decode_attention_reference(*clean, **quantization)
      assert_matches_reference(
        out, lse, *reference, rtol=relative_tolerance(jnp.bfloat16, interpret=True)
      )
