"""End to end: the Pallas kernels (interpret mode on CPU) drive generation exactly like the
jnp reference path, for a full-precision and a quantized cache.

The tiny model's head_dim is 64 here (the kernels take 64/128/256), and a fallback to the
reference is an error, so the "interpret" run really goes through the kernels."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention_dispatch
from kvjax.compressed_context import compress_context, continue_context, share_context
from kvjax.eval.continuation import score_continuation
from kvjax.generate import generate
from kvjax.kernel_settings import DEFAULT_KERNEL_SETTINGS, KernelSettings
from kvjax.method_spec import parse_method_spec
from tests.kvjax.layer_loop_params import each_in_one_layer_loop
from tests.kvjax.tiny_decoder import TINY_CONFIG, tiny_decoder

KERNEL_CONFIG = dataclasses.replace(TINY_CONFIG, head_dim=64)
TPU_SETTINGS = KernelSettings(kernel_backend="tpu")  # "interpret" then runs the TPU kernels

PROMPTS = [
  list(np.random.default_rng(3).integers(1, 64, 37)),
  list(np.random.default_rng(4).integers(1, 64, 21)),
]
# v36's candidate for the folded Mosaic GPU kernel (KERNEL_NOTES v36, v39): the fixed softmax
# reference, the kernel's own bias, register value codes, each lane's own value statistics.
V36_CANDIDATE_KIVI = {
  "lowering": "mosaic_gpu",
  "variant": "folded",
  "block_tokens": 64,
  "row_max": "bound",
  "key_bias_source": "kernel",
  "value_operand": "registers",
  "value_stats": "separate",
  "value_stat_loads": "own_slot",
}


@pytest.fixture(autouse=True)
def fallback_warnings_fire_again(monkeypatch):
  """The dispatch warns once per process about a fallback to the reference; these tests turn
  that warning into an error, so each must see it even if an earlier test in the process
  already did."""
  monkeypatch.setattr(attention_dispatch, "_warned", set())


def _generated_tokens(decoder, params, spec, cache_dtype, kernel_settings=DEFAULT_KERNEL_SETTINGS):
  """{"reference", "interpret"}: the tokens `generate` gives through each path (4 new ones)."""
  return {
    implementation: generate(
      decoder,
      params,
      PROMPTS,
      max_new_tokens=4,
      cache_dtype=cache_dtype,
      cache_method=parse_method_spec(
        spec, implementation=implementation, kernel_settings=kernel_settings
      ),
    ).tokens
    for implementation in ("reference", "interpret")
  }


@pytest.mark.parametrize(
  "spec, layer_loop",
  # The other loops (the same dispatch) under -m slow: 7 s and 18 s in interpret mode.
  each_in_one_layer_loop([("full", "unroll"), ("kivi:bits=4,group_size=16,residual=16", "scan")]),
)
@pytest.mark.filterwarnings("error:.*kernel does not support:RuntimeWarning")
def test_interpret_kernels_generate_the_reference_tokens(spec, layer_loop, kernel_calls):
  """Also with the kernels called inside the scan over layers (kvjax.layer_runs)."""
  decoder, params = tiny_decoder(config=KERNEL_CONFIG, layer_loop=layer_loop)
  tokens = _generated_tokens(decoder, params, spec, jnp.float32)
  np.testing.assert_array_equal(tokens["interpret"], tokens["reference"])
  gpu_kernel = "decode_attention_gpu" if spec == "full" else "quantized_decode_attention_gpu"
  assert gpu_kernel in kernel_calls.names
  assert_forced_logprobs_agree(decoder, params, spec, continuation=6)


def assert_forced_logprobs_agree(
  decoder, params, spec, *, continuation, kernel_settings=DEFAULT_KERNEL_SETTINGS
):
  """Equal greedy tokens could hide a moderate error in the scores: the log-probs of a forced
  continuation (`continuation` tokens after 21) through each path's caches agree to float32
  rounding."""
  windows = np.array([p[:21] + p[:continuation] for p in PROMPTS], np.int32)
  logprobs = {
    implementation: score_continuation(
      decoder,
      params,
      parse_method_spec(spec, implementation=implementation, kernel_settings=kernel_settings),
      windows,
      context_len=21,
      cache_dtype=jnp.float32,
    ).logprobs
    for implementation in ("reference", "interpret")
  }
  np.testing.assert_allclose(logprobs["interpret"], logprobs["reference"], atol=1e-4)


# Slow cases: settings whose kernels' own tests run by default, here only carried through the
# decode loop again (8-16 s each in interpret mode).
@pytest.mark.parametrize(
  "spec, settings, cache_dtype",
  [
    # The Mosaic GPU kernel takes 16-bit caches; capacity 37 + 3 = 40, a multiple of 8.
    ("full", KernelSettings(full={"lowering": "mosaic_gpu"}), jnp.bfloat16),
    pytest.param(
      "kivi:bits=2,group_size=16,residual=16",
      # Not the default ("folded"), so the recorded call shows the setting arrived (slow: the
      # stack_copies case below shows a quantized setting arriving).
      KernelSettings(quantized={"variant": "reshape"}),
      jnp.float32,
      marks=pytest.mark.slow,
    ),
    pytest.param(
      # The Mosaic GPU quantized kernel: 16-bit staging, 8 code words per token at 4 bits
      # (slow: 16 s in interpret mode; the folded one below reaches the same lowering switch).
      "kivi:bits=4,group_size=16,residual=16",
      KernelSettings(quantized={"lowering": "mosaic_gpu"}),
      jnp.bfloat16,
      marks=pytest.mark.slow,
    ),
    (
      # The folded Mosaic GPU quantized kernel: bf16 statistics, 2 or 4 bits.
      "kivi:bits=4,group_size=16,residual=16",
      KernelSettings(quantized={"lowering": "mosaic_gpu", "variant": "folded"}),
      jnp.bfloat16,
    ),
    pytest.param(
      # GEAR's low-rank and outlier terms fused into the folded kernel (not the default: XLA
      # computes them around it, KERNEL_NOTES v13; slow: 20 s in interpret mode).
      "gear:bits=4,group_size=16,block=16,rank=2,outliers=0.02",
      KernelSettings(quantized={"gear_terms": "kernel"}),
      jnp.float32,
      marks=pytest.mark.slow,
    ),
    pytest.param(
      # The folded Mosaic GPU kernel with a fixed softmax reference per split from the key
      # statistics' bounds (KERNEL_NOTES v33), XLA's products for them and for q . k_min as
      # reductions and the value codes as the register operand (v34), through the decode loop.
      "kivi:bits=4,group_size=16,residual=16",
      KernelSettings(
        quantized={
          "lowering": "mosaic_gpu",
          "variant": "folded",
          "row_max": "bound",
          "key_products": "reduction",
          "value_operand": "registers",
        }
      ),
      jnp.bfloat16,
      marks=pytest.mark.slow,
    ),
    pytest.param(
      # The folded Mosaic GPU kernel computing q . k_min itself before its loop (KERNEL_NOTES
      # v35), writing each channel's own value slot only (v38), and its splits merged by the
      # Triton merge kernel (v36), through the decode loop (experiments no default picks: slow).
      "kivi:bits=4,group_size=16,residual=16",
      KernelSettings(
        quantized={
          "lowering": "mosaic_gpu",
          "variant": "folded",
          "key_bias_source": "kernel",
          "partial_slots": "own",
          "split_merge": "triton",
        }
      ),
      jnp.bfloat16,
      marks=pytest.mark.slow,
    ),
    pytest.param(
      # The folded Mosaic GPU kernel with ring slots of two 64-token blocks and the value
      # product's tokens in the spread order (KERNEL_NOTES v37) and v36's candidate settings,
      # through the decode loop.
      "kivi:bits=4,group_size=16,residual=16",
      KernelSettings(
        quantized={
          **V36_CANDIDATE_KIVI,
          "num_stages": 2,
          "blocks_per_copy": 2,
          "token_order": "spread",
        }
      ),
      jnp.bfloat16,
      marks=pytest.mark.slow,
    ),
    pytest.param(
      # v36's candidate with the next block's Q' staged before each block's one barrier and
      # each ring slot refilled in the value product's shadow (KERNEL_NOTES v40), and each
      # row tile's value product against its own P' tiles (v41: at this head_dim of 64 the one
      # row tile reads every tile, so it passes the setting through), through the decode loop;
      # as two warpgroups a program, each its own split (v42).
      "kivi:bits=4,group_size=16,residual=16",
      KernelSettings(
        quantized={
          **V36_CANDIDATE_KIVI,
          "num_stages": 3,
          "key_operand": "registers",
          "key_stack_timing": "block_ahead",
          "copy_issue_point": "value_product",
          "value_product_columns": "own_tiles",
          "warpgroups_per_program": 2,
        }
      ),
      jnp.bfloat16,
      marks=pytest.mark.slow,
    ),
    pytest.param(
      # v36's candidate with the value codes by transposing matrix loads (KERNEL_NOTES v43: the
      # value product's rows in their own order, taken back to channels by the Triton merge;
      # an experiment no default picks: slow).
      "kivi:bits=4,group_size=16,residual=16",
      KernelSettings(
        quantized={
          **V36_CANDIDATE_KIVI,
          "key_operand": "registers",
          "value_operand": "matrix_loads",
          "split_merge": "triton",
        }
      ),
      jnp.bfloat16,
      marks=pytest.mark.slow,
    ),
    (
      # 2 query heads per KV head: the folded kernel's stacked operands in 2 copies instead of
      # 2 padding query rows (KERNEL_NOTES v22).
      "kivi:bits=2,group_size=16,residual=16",
      KernelSettings(quantized={"stack_copies": True}),
      jnp.bfloat16,
    ),
    (
      # GEAR's terms by XLA around the folded kernel: the default, asked for by name so that
      # the recorded call shows it.
      "gear:bits=4,group_size=16,block=16,rank=2,outliers=0.02",
      KernelSettings(quantized={"gear_terms": "xla"}),
      jnp.float32,
    ),
  ],
)
@pytest.mark.filterwarnings("error:.*kernel does not support:RuntimeWarning")
def test_kernel_settings_reach_the_kernels_in_generate(spec, settings, cache_dtype, kernel_calls):
  """The settings a method carries pick the kernel its caches run (here in interpret mode)."""
  decoder, params = tiny_decoder(config=KERNEL_CONFIG)
  tokens = {
    implementation: generate(
      decoder,
      params,
      PROMPTS,
      max_new_tokens=3,
      cache_dtype=cache_dtype,
      cache_method=parse_method_spec(spec, implementation=implementation, kernel_settings=settings),
    ).tokens
    for implementation in ("reference", "interpret")
  }
  np.testing.assert_array_equal(tokens["interpret"], tokens["reference"])
  recorded = (
    "lowering",
    "variant",
    "gear_terms",
    "stack_copies",
    "row_max",
    "key_products",
    "value_operand",
    "key_bias_source",
    "split_merge",
    "block_tokens",
    "num_stages",
    "blocks_per_copy",
    "value_stats",
    "value_stat_loads",
    "token_order",
    "partial_slots",
    "key_stack_timing",
    "key_operand",
    "copy_issue_point",
    "value_product_columns",
    "warpgroups_per_program",
  )
  seen = [
    {k: v for k, v in call.kwargs.items() if k in recorded}
    for call in kernel_calls
    if call.name.endswith("_gpu")
  ]
  wanted = settings.full_config() or settings.quantized_config()
  assert wanted in seen, seen


@pytest.mark.filterwarnings("error:.*kernel does not support:RuntimeWarning")
def test_a_shared_context_runs_the_kernels_with_its_rows_in_the_query_group(kernel_calls):
  """Three rows per context row: their queries reach the kernel as one group three times as
  large (a fallback to the reference would be an error here)."""
  decoder, params = tiny_decoder(config=KERNEL_CONFIG, layer_loop="scan")
  questions = [[5, 9], [7], [1, 2, 3], [4], [], [8, 8]]
  tokens = {}
  for implementation in ("reference", "interpret"):
    method = parse_method_spec(
      "kivi:bits=4,group_size=16,residual=16", implementation=implementation
    )
    context = compress_context(
      decoder, params, PROMPTS, cache_method=method, room=0, cache_dtype=jnp.float32
    )
    shared = share_context(
      decoder, context, 3, room=6, cache_dtype=jnp.float32, implementation=implementation
    )
    tokens[implementation], _ = continue_context(
      decoder, params, shared, questions, max_new_tokens=3
    )
  np.testing.assert_array_equal(tokens["interpret"], tokens["reference"])
  group = KERNEL_CONFIG.num_heads // KERNEL_CONFIG.num_kv_heads
  context_rows = [
    call.query_shape for call in kernel_calls if call.name == "quantized_decode_attention_gpu"
  ]
  assert context_rows and all(shape[0] == len(PROMPTS) for shape in context_rows)
  assert all(shape[2] == 3 * group for shape in context_rows)


@pytest.mark.parametrize(
  "bits,num_heads,head_dim,settings",
  [
    (2, 4, 128, {}),
    # (KIVI-4, and 8 query rows with v46's ring settings: slow, 14-19 s each in interpret mode;
    # the kernel's own tests run both by default)
    pytest.param(4, 4, 128, {}, marks=pytest.mark.slow),
    pytest.param(
      2,
      14,
      128,
      {"copy_issuer": "slot_owner", "ring_release": "per_warp", "num_stages": 2},
      marks=pytest.mark.slow,
    ),
    # 4 words a token: one word a lane, one 8-half-word matrix load (slow: no default runs the
    # warp kernel on 2-bit codes at head_dim 64, and its own tests run that shape by default)
    pytest.param(2, 6, 64, {}, marks=pytest.mark.slow),
    # (KIVI-4 at head_dim 64: 8 words a token, the word order head_dim 128 uses; slow: 13 s)
    pytest.param(4, 12, 64, {}, marks=pytest.mark.slow),
  ],
)
@pytest.mark.filterwarnings("error:.*kernel does not support:RuntimeWarning")
def test_the_warp_kernel_generates_the_reference_tokens(
  monkeypatch, bits, num_heads, head_dim, settings
):
  """The "warp" Mosaic GPU variant (KERNEL_NOTES v45-v47: KIVI-2 and KIVI-4, head_dim 64 and
  128, group size 32 only) through the decode loop, on tiny models of head_dim 128 with 2 and
  7 query heads per KV head (4 and 8 query rows; the latter with v46's ring settings, given in
  the kernel_config) and of head_dim 64 with 3 and 6: the reference path's tokens, and the
  kernel really called (a fallback would be an error)."""
  from pallas_kernels import quantized_decode_attention_warp_mosaic_gpu as warp

  calls = []
  kernel = warp.warp_decode_attention_mosaic_gpu

  def counted(*args, **kwargs):
    calls.append((args[0].shape[2], kwargs))  # the query group, the settings
    return kernel(*args, **kwargs)

  monkeypatch.setattr(warp, "warp_decode_attention_mosaic_gpu", counted)
  config = dataclasses.replace(TINY_CONFIG, head_dim=head_dim, num_heads=num_heads)
  decoder, params = tiny_decoder(config=config)
  # long enough for two 128-token blocks of quantized tokens in one row, part of one in the other
  prompts = [
    list(np.random.default_rng(5).integers(1, 64, 190)),
    list(np.random.default_rng(6).integers(1, 64, 90)),
  ]
  kernels = KernelSettings(quantized={"lowering": "mosaic_gpu", "variant": "warp", **settings})
  tokens = {
    implementation: generate(
      decoder,
      params,
      prompts,
      max_new_tokens=3,
      cache_dtype=jnp.bfloat16,
      cache_method=parse_method_spec(
        f"kivi:bits={bits},group_size=32,residual=32",
        implementation=implementation,
        kernel_settings=kernels,
      ),
    ).tokens
    for implementation in ("reference", "interpret")
  }
  np.testing.assert_array_equal(tokens["interpret"], tokens["reference"])
  assert calls, "the warp kernel was not called"
  assert {group for group, _ in calls} == {num_heads // config.num_kv_heads}
  assert all(kwargs.items() >= settings.items() for _, kwargs in calls)
  # (under the layer loop's jit the lengths are traced: the prompts set them, 160 and 64)


@pytest.mark.parametrize(
  "spec",
  [
    "full",
    "kivi:bits=2,group_size=16,residual=16",
    "gear:bits=4,group_size=16,block=16,rank=2,outliers=0.02",
  ],
)
@pytest.mark.filterwarnings("error:.*kernel does not support:RuntimeWarning")
def test_the_tpu_kernels_generate_the_reference_tokens(spec, kernel_calls, monkeypatch):
  """The TPU kernels (interpret mode) through generate and a forced continuation, as the GPU
  ones above, chosen by the caches' `KernelSettings(kernel_backend="tpu")`. The
  tokens-on-lanes layout (v49) over real caches: ragged rows, KIVI's window, GEAR's low-rank
  terms (v51) and outliers (v56) in the kernel. GEAR's outliers stored as on a TPU, in whole
  lane tiles (`attention_dispatch.gear_outlier_slots`, compiled kernels only: made to pad in
  interpret mode here, 20 outliers a block in 128 slots), the reference path's unpadded."""
  from kvjax import attention_dispatch
  from pallas_kernels.gear_outlier_terms_tpu import stored_outlier_slots

  padded = []

  def outlier_slots(implementation, head_dim, count, kernel_backend=None):
    padded.append(implementation == "interpret")
    return stored_outlier_slots(count) if implementation == "interpret" else count

  monkeypatch.setattr(attention_dispatch, "gear_outlier_slots", outlier_slots)
  decoder, params = tiny_decoder(config=KERNEL_CONFIG)
  run = lambda implementation: (
    generate(
      decoder,
      params,
      PROMPTS,
      max_new_tokens=3,  # a length no other test here compiles, so no program is reused
      cache_dtype=jnp.float32,
      cache_method=parse_method_spec(
        spec, implementation=implementation, kernel_settings=TPU_SETTINGS
      ),
    ).tokens
  )
  np.testing.assert_array_equal(run("interpret"), run("reference"))
  assert (any(padded) and not all(padded)) == spec.startswith("gear")
  tpu_kernel = "decode_attention_tpu" if spec == "full" else "quantized_decode_attention_tpu"
  assert tpu_kernel in kernel_calls.names
  assert not any(name.endswith("_gpu") for name in kernel_calls.names)
  assert_forced_logprobs_agree(decoder, params, spec, continuation=5, kernel_settings=TPU_SETTINGS)


@pytest.mark.filterwarnings("error:.*kernel does not support:RuntimeWarning")
def test_a_segment_rounded_up_for_the_tpu_kernel_generates_the_reference_tokens(monkeypatch):
  """On a TPU a segment's capacity is rounded up to whole tiles of its key statistics
  (`attention_dispatch.quantized_segment_granule`, compiled kernels only). Made to round here
  too, to 128 tokens where 32 were asked (41 tokens a row, blocks of 16), the TPU kernel in
  interpret mode reads a segment mostly past every row's length: the reference path's tokens,
  which it takes unrounded."""
  from kvjax import attention_dispatch

  rounded = []

  def granule(implementation, *args, **kwargs):
    rounded.append(implementation == "interpret")
    return 128 if implementation == "interpret" else 1

  monkeypatch.setattr(attention_dispatch, "quantized_segment_granule", granule)
  decoder, params = tiny_decoder(config=KERNEL_CONFIG)
  spec = "kivi:bits=2,group_size=16,residual=16"
  tokens = _generated_tokens(decoder, params, spec, jnp.float32, TPU_SETTINGS)
  assert any(rounded) and not all(rounded)
  np.testing.assert_array_equal(tokens["interpret"], tokens["reference"])


@pytest.mark.parametrize(
  "spec,head_dim",
  [("kivi:bits=2,group_size=32,residual=32", 128), ("kivi:bits=4,group_size=16,residual=16", 64)],
)
@pytest.mark.filterwarnings("error:.*kernel does not support:RuntimeWarning")
def test_the_tpu_code_pair_kernel_generates_the_reference_tokens(spec, head_dim, kernel_calls):
  """bfloat16 caches whose codes fill whole registers (2 bits at head_dim 128, 4 at 64): the TPU
  quantized kernel makes its operands from the codes as bfloat16 pairs (`code_pairs_apply`,
  KERNEL_NOTES v57), the query rows copied into the padding (4 query heads a KV head: two
  groups a register of rows). The reference path's tokens through generate."""
  from pallas_kernels.quantized_decode_attention_tpu import code_pairs_apply

  assert code_pairs_apply(int(spec[len("kivi:bits=")]), head_dim, jnp.bfloat16)
  decoder, params = tiny_decoder(config=dataclasses.replace(TINY_CONFIG, head_dim=head_dim))
  tokens = _generated_tokens(decoder, params, spec, jnp.bfloat16, TPU_SETTINGS)
  np.testing.assert_array_equal(tokens["interpret"], tokens["reference"])
  assert "quantized_decode_attention_tpu" in kernel_calls.names


@pytest.mark.filterwarnings("error:.*kernel does not support:RuntimeWarning")
def test_the_tpu_token_halves_pair_kernel_generates_the_reference_tokens(monkeypatch):
  """2-bit codes at head_dim 64 (SmolLM2's) in a segment of whole 256-token halves: the TPU
  kernel takes the token halves' code pairs (`code_pair_halves_tpu`, KERNEL_NOTES v58). A
  509-token prompt and a window of 128: a 512-token segment, one block."""
  from pallas_kernels import code_pair_halves_tpu

  traced = []
  half_pair_queries = code_pair_halves_tpu.half_pair_queries
  monkeypatch.setattr(
    code_pair_halves_tpu,
    "half_pair_queries",
    lambda *args: traced.append(1) or half_pair_queries(*args),
  )
  decoder, params = tiny_decoder(config=dataclasses.replace(TINY_CONFIG, head_dim=64))
  prompts = [list(np.random.default_rng(5).integers(1, 64, 509)), PROMPTS[1]]
  spec = "kivi:bits=2,group_size=32,residual=128"
  tokens = {
    implementation: generate(
      decoder,
      params,
      prompts,
      max_new_tokens=4,
      cache_dtype=jnp.bfloat16,
      cache_method=parse_method_spec(
        spec, implementation=implementation, kernel_settings=TPU_SETTINGS
      ),
    ).tokens
    for implementation in ("reference", "interpret")
  }
  np.testing.assert_array_equal(tokens["interpret"], tokens["reference"])
  assert traced  # the halves' path was traced
