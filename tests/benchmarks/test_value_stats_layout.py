"""benchmarks/value_stats_layout.py's HLO reading: transposes placed inside or outside loops."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp

_PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "value_stats_layout.py"
_SPEC = importlib.util.spec_from_file_location("value_stats_layout", _PATH)
value_stats_layout = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(value_stats_layout)

# Shaped like the H100 dump of kvjax's decode loop with the folded Mosaic GPU kernel: the value
# statistics go group-major through a fusion before the loop and back after it; inside the
# loop, a fusion called from the body (two calls deep) transposes another [2, 2, T, 2] array.
DUMP = """HloModule jit__decode_in_jit, entry_computation_layout={()}

%to_gm (param_0.1: bf16[2,2,3040,2]) -> bf16[2,2,2,3040] {
  %param_0.1 = bf16[2,2,3040,2]{3,2,1,0} parameter(0)
  ROOT %transpose.55.1 = bf16[2,2,2,3040]{3,2,1,0} transpose(%param_0.1), dimensions={0,1,3,2}
}

%fused_transpose (param_0.2: bf16[2,2,2,3040]) -> bf16[2,2,3040,2] {
  %param_0.2 = bf16[2,2,2,3040]{3,2,1,0} parameter(0)
  ROOT %transpose.62.1 = bf16[2,2,3040,2]{3,2,1,0} transpose(%param_0.2), dimensions={0,1,3,2}
}

%fused_inner (param_0.3: bf16[2,2,3040,2]) -> bf16[2,2,2,3040] {
  %param_0.3 = bf16[2,2,3040,2]{3,2,1,0} parameter(0)
  %transpose.7 = bf16[2,2,2,3040]{3,2,1,0} transpose(%param_0.3), dimensions={0,1,3,2}
  ROOT %transpose.8 = bf16[2,3040,2,2]{3,2,1,0} transpose(%param_0.3), dimensions={0,2,1,3}
}

%fused_outer (param_0.4: bf16[2,2,3040,2]) -> bf16[2,2,2,3040] {
  %param_0.4 = bf16[2,2,3040,2]{3,2,1,0} parameter(0)
  ROOT %fusion.9 = bf16[2,2,2,3040]{3,2,1,0} fusion(%param_0.4), kind=kLoop, calls=%fused_inner
}

%region_0.91 (arg_tuple.5: (s32[], bf16[2,2,3040,2])) -> (s32[], bf16[2,2,3040,2]) {
  %arg_tuple.5 = (s32[], bf16[2,2,3040,2]{3,2,1,0}) parameter(0)
  %gte.1 = bf16[2,2,3040,2]{3,2,1,0} get-tuple-element(%arg_tuple.5), index=1
  %fusion.10 = bf16[2,2,2,3040]{3,2,1,0} fusion(%gte.1), kind=kLoop, calls=%fused_outer
  ROOT %tuple.1 = (s32[], bf16[2,2,3040,2]{3,2,1,0}) tuple(%gte.0, %gte.1)
}

%cond (arg_tuple.6: (s32[], bf16[2,2,3040,2])) -> pred[] {
  %arg_tuple.6 = (s32[], bf16[2,2,3040,2]{3,2,1,0}) parameter(0)
  ROOT %constant.1 = pred[] constant(true)
}

ENTRY %main.97 (v_scale.1: bf16[2,2,3040,2]) -> bf16[2,2,3040,2] {
  %v_scale.1 = bf16[2,2,3040,2]{3,2,1,0} parameter(0)
  %to_group_major = bf16[2,2,2,3040]{3,2,1,0} fusion(%v_scale.1), kind=kLoop, calls=%to_gm
  %while.28 = (s32[], bf16[2,2,3040,2]{2,3,1,0}) while(%t), condition=%cond, body=%region_0.91
  ROOT %back = bf16[2,2,3040,2]{3,2,1,0} fusion(%gte.9), kind=kLoop, calls=%fused_transpose
}
"""


def test_transposes_are_placed_by_the_computations_a_while_body_reaches():
  computations = value_stats_layout.split_computations(DUMP)
  assert "ENTRY" in computations and "region_0.91" in computations
  assert value_stats_layout.computations_inside_loops(computations) == {
    "region_0.91",
    "fused_outer",
    "fused_inner",
  }
  # The [0, 2, 1, 3] transpose is not a swap of the last two axes; T matches any size.
  assert value_stats_layout.value_stats_transposes(DUMP, (2, 2, None, 2)) == {
    "inside_loop": 1,
    "outside_loop": 2,
  }
  assert value_stats_layout.value_stats_transposes(DUMP, (2, 2, 3040, 2)) == {
    "inside_loop": 1,
    "outside_loop": 2,
  }
  assert value_stats_layout.value_stats_transposes(DUMP, (2, 4, None, 2)) == {
    "inside_loop": 0,
    "outside_loop": 0,
  }


def test_a_compiled_loop_transposing_its_carry_and_an_invariant_input():
  """XLA's own optimised HLO: the carry changes every step, so its transpose (kept by a
  barrier) runs in the loop; the invariant input's runs once, before it."""

  def loop(carried, invariant):
    invariant_t = jnp.swapaxes(invariant, -1, -2) + 1

    def body(i, state):
      carried, total = state
      carried = carried.at[:, :, i, :].add(1.0)
      carried_t = jax.lax.optimization_barrier(jnp.swapaxes(carried, -1, -2))
      return carried, total + carried_t.sum() + invariant_t.sum()

    return jax.lax.fori_loop(0, 5, body, (carried, 0.0))

  x = jnp.ones((2, 3, 40, 4))
  hlo = jax.jit(loop).lower(x, x).compile().as_text()
  assert value_stats_layout.value_stats_transposes(hlo, (2, 3, None, 4)) == {
    "inside_loop": 1,
    "outside_loop": 1,
  }
