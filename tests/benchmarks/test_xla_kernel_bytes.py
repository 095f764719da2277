"""benchmarks/xla_kernel_bytes.py's HLO reading: kernel launches of the entry computation and the
bytes each moves (text and a CPU compile: no CUDA plugin, no GPU)."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.xla_kernel_bytes import (
  computation_kernels,
  entry_kernels,
  type_bytes,
  while_body_kernels,
)

# Shaped like the H100 compile of GEAR's score bias: a called computation (not read), bitcasts
# and tuple accesses (not launches), a fusion reading one operand twice, a multi-output fusion,
# a Triton GEMM custom call and the scatter that updates the ROOT.
MODULE = """HloModule jit_gear, entry_computation_layout={()}

%fused_reduce (param_0: f32[4,8]) -> f32[4] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  ROOT %reduce.1 = f32[4]{0} reduce(%param_0, %c), dimensions={1}, to_apply=%add
}

ENTRY %main.1 (q.1: f32[4,8], idx.1: u16[2,3]) -> f32[4,8] {
  %q.1 = f32[4,8]{1,0} parameter(0), sharding={replicated}
  %idx.1 = u16[2,3]{1,0} parameter(1)
  %bitcast.2 = f32[32]{0} bitcast(%q.1)
  %loop_multiply_fusion = f32[4,8]{1,0} fusion(%q.1, %q.1), kind=kLoop, calls=%fused_multiply
  %pair = (f32[4]{0}, pred[2,3]{1,0}) fusion(%loop_multiply_fusion, %idx.1), kind=kInput, calls=%r
  %gte = f32[4]{0} get-tuple-element(%pair), index=0
  %gemm = bf16[2,16]{1,0} custom-call(%bitcast.2, %gte), custom_call_target="__cublas$gemm"
  ROOT %scatter = f32[4,8]{1,0} fusion(%loop_multiply_fusion, %gemm, %idx.1), kind=kInput, calls=%s
}
"""


def test_type_bytes_of_arrays_and_tuples():
  assert type_bytes("f32[8,4]{1,0}") == 128
  assert type_bytes("bf16[3]") == 6
  assert type_bytes("pred[]") == 1  # a scalar
  assert type_bytes("(f32[4]{0}, pred[2,3]{1,0})") == 16 + 6
  with pytest.raises(ValueError, match="c64"):
    type_bytes("c64[2]")


def test_entry_kernels_are_the_launches_with_their_operand_and_result_bytes():
  kernels = entry_kernels(MODULE)
  assert [(k.name, k.opcode) for k in kernels] == [
    ("loop_multiply_fusion", "fusion:kLoop"),
    ("pair", "fusion:kInput"),
    ("gemm", "custom-call:__cublas$gemm"),
    ("scatter", "fusion:kInput"),
  ]
  by_name = {k.name: k for k in kernels}
  assert (
    by_name["loop_multiply_fusion"].bytes_read,
    by_name["loop_multiply_fusion"].bytes_written,
  ) == (
    128,  # q once, though it is both operands
    128,
  )
  assert (by_name["pair"].bytes_read, by_name["pair"].bytes_written) == (128 + 12, 16 + 6)
  assert by_name["pair"].result == "(f32[4], pred[2,3])"
  assert (by_name["gemm"].bytes_read, by_name["gemm"].bytes_written) == (128 + 16, 64)
  assert by_name["scatter"].bytes_read == 128 + 64 + 12


def test_entry_kernels_needs_one_entry():
  with pytest.raises(ValueError, match="ENTRY"):
    entry_kernels(MODULE.replace("ENTRY ", ""))


def test_entry_kernels_of_a_cpu_compile():
  """A transpose that cannot be a bitcast is a launch that reads and writes the array once."""

  def transpose_then_scale(x):
    return jnp.swapaxes(x, 0, 1) * 3.0

  x = jnp.zeros((64, 48), jnp.float32)
  text = jax.jit(transpose_then_scale).lower(x).compile().as_text()
  kernels = entry_kernels(text)
  assert kernels, text
  assert sum(k.bytes_written for k in kernels) >= x.nbytes
  assert all(k.bytes_read <= x.nbytes + 1024 for k in kernels)  # x, and at most a constant
  assert kernels[-1].result.startswith("f32[48,64]")


def test_while_body_kernels_are_what_each_iteration_launches():
  """The timed loop's body on a CPU compile: the per-iteration transpose is there, and the
  entry computation's launches are not."""

  def loop(x, y):
    def body(_, carry):
      carry, y_barrier = jax.lax.optimization_barrier((carry, y))
      return carry + jnp.swapaxes(y_barrier, 0, 1)

    return jax.lax.fori_loop(0, 3, body, x)

  x, y = jnp.zeros((48, 64), jnp.float32), jnp.zeros((64, 48), jnp.float32)
  text = jax.jit(loop).lower(x, y).compile().as_text()
  body = while_body_kernels(text)
  assert body, text
  assert any(k.bytes_read >= y.nbytes and k.bytes_written >= x.nbytes for k in body)
  assert [k.name for k in body] != [k.name for k in entry_kernels(text)]


def test_computation_kernels_names_a_missing_computation_or_loop():
  with pytest.raises(ValueError, match="named 'fused_sum'"):
    computation_kernels(MODULE, "fused_sum")
  with pytest.raises(ValueError, match="one while loop, found 0"):
    while_body_kernels(MODULE)
