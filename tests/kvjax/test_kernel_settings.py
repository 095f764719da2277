"""Kernel settings: checked when built, hashable (static pytree metadata), carried by every part
of a composition into its caches, and from the CLI."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention_dispatch
from kvjax.cache_protocol import ModelCacheShape
from kvjax.cli import main
from kvjax.dense_cache import DenseLayerCache
from kvjax.generate import generate
from kvjax.kernel_settings import KernelSettings
from kvjax.method_spec import describe_method, parse_method_spec
from tests.kvjax.tiny_decoder import tiny_decoder

SETTINGS = KernelSettings(
  full={"lowering": "mosaic_gpu", "block_tokens": 64},
  quantized={"variant": "folded", "prefetch": False, "code_operand": "offset"},
)


def test_settings_are_frozen_hashable_and_give_back_their_dicts():
  again = KernelSettings(
    full=(("block_tokens", 64), ("lowering", "mosaic_gpu")), quantized=SETTINGS.quantized
  )
  assert again == SETTINGS and hash(again) == hash(SETTINGS)
  assert SETTINGS.full_config() == {"lowering": "mosaic_gpu", "block_tokens": 64}
  assert SETTINGS.quantized_config() == {
    "variant": "folded",
    "prefetch": False,
    "code_operand": "offset",
  }
  assert KernelSettings().full_config() is None and KernelSettings().quantized_config() is None


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(full={"lowering": "cuda"}), "full: lowering='cuda' is not supported; allowed: triton"),
    (
      dict(full={"lowering": "mosaic_gpu", "num_warps": 4}),
      r"full: kernel_config keys \['num_warps'\] are not taken by lowering='mosaic_gpu'",
    ),
    (
      dict(full={"lowering": "mosaic_gpu", "num_stages": 7}),
      r"full: num_stages=7 is not supported; allowed: \(2, 3, 4\)",
    ),
    (
      dict(full={"lowering": "mosaic_gpu", "block_tokens": 32}),
      r"full: block_tokens=32 is not supported; allowed: \(64, 128, 256\)",
    ),
    (dict(quantized={"variant": "fast"}), "variant='fast' is not supported; allowed: folded"),
    (dict(full={"variant": "folded"}), r"full: unknown keys \['variant'\]"),
    (
      dict(quantized={"lowering": "cuda"}),
      "quantized: lowering='cuda' is not supported; allowed: triton, mosaic_gpu",
    ),
    (
      dict(quantized={"lowering": "mosaic_gpu", "prefetch": True}),
      r"quantized: kernel_config keys \['prefetch'\] are not taken by the quantized kernel of "
      "lowering='mosaic_gpu'",
    ),
    (
      dict(quantized={"lowering": "mosaic_gpu", "num_stages": 5}),
      r"quantized: num_stages=5 is not supported; allowed: \(2, 3, 4\)",
    ),
    (dict(full={"block_tokens": 6.4}), "block_tokens=6.4 must be an int"),
    (dict(full={"num_stages": True}), "num_stages=True must be an int"),
    (dict(quantized={"prefetch": 1}), "prefetch=1 must be True or False"),
    (dict(quantized={"prefetch": None}), "prefetch=None must be True or False"),
    (
      dict(quantized={"variant": "reshape", "prefetch": True}),
      "quantized: prefetch=True is a setting of variant='folded' only; got variant='reshape'",
    ),
    (
      dict(quantized={"code_operand": "magic"}),
      "quantized: code_operand='magic' is not supported; allowed: subnormal, offset",
    ),
    (
      dict(quantized={"variant": "joined", "code_operand": "offset"}),
      "quantized: code_operand='offset' is a setting of variant='folded' only",
    ),
    (dict(full={"code_operand": "offset"}), r"full: unknown keys \['code_operand'\]"),
    (
      dict(quantized={"channel_parts": 3}),
      "quantized: channel_parts=3 is not supported; allowed: 1, 2, 4",
    ),
    (
      dict(quantized={"variant": "planar", "channel_parts": 2}),
      "quantized: channel_parts=2 is a setting of variant='folded' only",
    ),
    (
      dict(quantized={"gear_terms": "around"}),
      "quantized: gear_terms='around' is not supported; allowed: kernel, xla",
    ),
    (
      dict(quantized={"variant": "reshape", "gear_terms": "xla"}),
      "quantized: gear_terms='xla' is a setting of variant='folded' only",
    ),
    (dict(quantized={"stack_copies": 1}), "quantized: stack_copies=1 must be True or False"),
    (
      dict(quantized={"variant": "joined", "stack_copies": True}),
      "quantized: stack_copies=True is a setting of variant='folded' only",
    ),
    (dict(full=[("block_tokens", 64)]), "full must be a dict"),
    # Numbers against pallas_kernels.launch_settings, at build: not later, deep in pallas_call.
    (
      dict(full={"block_tokens": -1}),
      r"full: block_tokens=-1 is not supported; allowed: None or a power of two in \[16, 2\*\*20\]",
    ),
    (dict(full={"block_tokens": 48}), "full: block_tokens=48 is not supported"),
    (
      dict(quantized={"num_splits": 0}),
      r"quantized: num_splits=0 is not supported; allowed: None or an int in \[1, 2\*\*20\]",
    ),
    (
      dict(quantized={"num_warps": 3}),
      r"quantized: num_warps=3 is not supported; allowed: None or one of \(1, 2, 4, 8, 16\)",
    ),
    (dict(full={"num_stages": 0}), "full: num_stages=0 is not supported"),
    (dict(quantized={"unroll": -1}), "quantized: unroll=-1 is not supported"),
    # A Mosaic GPU key without its lowering would reach no kernel until a trace, or none at all
    # where the reference runs (CPU).
    (
      dict(quantized={"lowering": "triton", "row_max": "bound"}),
      r"quantized: keys \['row_max'\] are taken by the Mosaic GPU kernels only; add "
      '"lowering": "mosaic_gpu"',
    ),
    (
      dict(quantized={"variant": "folded", "query_loads": 7}),
      r"keys \['query_loads'\] are taken by the Mosaic GPU kernels only",
    ),
    (dict(quantized={"approx_math": "yes"}), "quantized: approx_math='yes' must be True or False"),
    (
      dict(full=("num_warps", 4)),
      r"full must be a dict or a tuple of \(key, value\) pairs, got \('num_warps', 4\)",
    ),
    (dict(quantized=("lowering",)), r"quantized must be a dict or a tuple of \(key, value\) pairs"),
    (
      dict(kernel_backend="cuda"),
      "kernel_backend='cuda' is not supported; allowed: None, gpu, tpu",
    ),
    (dict(kernel_backend=""), "kernel_backend='' is not supported"),
    # Named, the family's keys are checked whole here: no other kernel could take them.
    (
      dict(full={"lowering": "triton"}, kernel_backend="tpu"),
      r"full \(kernel_backend='tpu'\): kernel_config keys \['lowering'\] are not taken by the tpu "
      "full-precision kernel; allowed: block_tokens, num_splits",
    ),
    (
      dict(quantized={"variant": "folded"}, kernel_backend="tpu"),
      r"quantized \(kernel_backend='tpu'\): kernel_config keys \['variant'\] are not taken by "
      "the tpu quantized kernel",
    ),
    (
      dict(full={"num_warps": 4, "block_tokens": 64}, kernel_backend="tpu"),
      r"full \(kernel_backend='tpu'\): kernel_config keys \['num_warps'\] are not taken",
    ),
    (
      dict(
        quantized={"lowering": "mosaic_gpu", "variant": "folded", "num_warps": 4},
        kernel_backend="gpu",
      ),
      r"quantized: kernel_config keys \['num_warps'\] are not taken by the quantized kernel of "
      "lowering='mosaic_gpu'",
    ),
    (
      dict(quantized={"variant": "joined", "gear_terms": "kernel"}, kernel_backend="gpu"),
      "quantized: gear_terms='kernel' is a setting of variant='folded' only",
    ),
  ],
)
def test_bad_settings_name_what_is_wrong(kwargs, message):
  with pytest.raises(ValueError, match=message):
    KernelSettings(**kwargs)


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(full={"block_tokens": 64, "num_splits": 4}, kernel_backend="tpu"),
    dict(quantized={"block_tokens": 128}, kernel_backend="tpu"),
    dict(full={"num_warps": 8}, quantized={"variant": "reshape"}, kernel_backend="gpu"),
    dict(quantized={"lowering": "mosaic_gpu", "variant": "folded"}, kernel_backend="gpu"),
  ],
)
def test_settings_for_a_named_kernel_family_are_taken(kwargs):
  settings = KernelSettings(**kwargs)
  assert settings.kernel_backend == kwargs["kernel_backend"]
  assert settings == KernelSettings(**kwargs) and hash(settings) == hash(KernelSettings(**kwargs))
  assert settings != KernelSettings(**{**kwargs, "kernel_backend": None})


def test_every_part_of_a_composition_carries_the_settings():
  method = parse_method_spec(
    "snapkv:budget=64+kivi:bits=4", implementation="interpret", kernel_settings=SETTINGS
  )
  assert method.storage.kernel_settings == SETTINGS  # SnapKV attends through its storage
  assert describe_method(method) == "snapkv:budget=64+kivi:bits=4"
  selection_only = parse_method_spec("snapkv:budget=64", kernel_settings=SETTINGS)
  assert selection_only.storage.kernel_settings == SETTINGS  # the implicit full storage
  with pytest.raises(ValueError, match="kernel_settings must be a kvjax.kernel_settings"):
    parse_method_spec("full", kernel_settings={"full": {}})


@pytest.mark.parametrize(
  "spec, sliding_window, kernels",
  [
    ("full", None, ["decode_attention_tpu"]),
    ("full", 16, ["decode_attention_tpu"]),  # the sliding window's ring
    ("streaming:budget=16,sinks=4", None, ["decode_attention_tpu"]),
    (
      "kivi:bits=2,group_size=16,residual=16",
      None,
      ["quantized_decode_attention_tpu", "decode_attention_tpu"],
    ),
  ],
)
def test_each_cache_runs_the_kernel_family_its_settings_name(
  spec, sliding_window, kernels, kernel_calls
):
  """Every cache kind that attends through the dispatch passes `kernel_backend` on: with
  "interpret" the TPU kernels run, not the GPU ones ("interpret"'s default). KIVI's two calls:
  its quantized segment and its window."""
  shape = ModelCacheShape(
    num_layers=1, num_kv_heads=2, num_query_heads=4, head_dim=64, sliding_window=sliding_window
  )
  method = parse_method_spec(
    spec, implementation="interpret", kernel_settings=KernelSettings(kernel_backend="tpu")
  )
  cache = method.allocate(shape, 0, batch=2, prompt_len=40, max_new_tokens=8, dtype=jnp.float32)
  queries = jnp.ones((2, 2, 2, 64), jnp.float32)
  out = cache.attend(queries, sm_scale=0.125)
  assert out.shape == queries.shape
  assert kernel_calls.names == kernels


@pytest.mark.parametrize("spec", ["kivi:bits=4", "snapkv:budget=64+kivi:bits=4"])
def test_settings_naming_the_other_backends_kernels_are_refused_before_tracing(
  spec, monkeypatch, capsys
):
  """On a GPU (patched where the dispatch reads it: nothing runs), caches naming the TPU
  kernels are refused by generate and by the command line before anything is traced or
  loaded."""
  monkeypatch.setattr(jax, "default_backend", lambda: "cuda")
  decoder, params = tiny_decoder()
  method = parse_method_spec(spec, kernel_settings=KernelSettings(kernel_backend="tpu"))
  message = "kernel_backend='tpu' cannot run compiled on the 'cuda' backend"
  # (named by generate's own check; the dispatch's, when traced, would not name the method)
  with pytest.raises(ValueError, match=f"cache_method .*: {message}"):
    generate(decoder, params, [[1, 2, 3]], max_new_tokens=2, cache_method=method)
  arguments = ["--prompt", "x", "--method", spec, "--kernel-settings", '{"kernel_backend": "tpu"}']
  with pytest.raises(SystemExit) as exit_info:
    main(["generate", *arguments])
  assert f"--implementation: {message}" in capsys.readouterr().err + str(exit_info.value)


def test_caches_keep_settings_as_static_metadata():
  cache = parse_method_spec("full", kernel_settings=SETTINGS).allocate_storage(
    batch=1, kv_heads=1, capacity=8, head_dim=64, dtype=jnp.bfloat16
  )
  assert isinstance(cache, DenseLayerCache) and cache.kernel_settings == SETTINGS
  leaves, treedef = jax.tree_util.tree_flatten(cache)
  assert len(leaves) == 3  # keys, values, lengths: the settings are not traced
  assert jax.tree_util.tree_unflatten(treedef, leaves).kernel_settings == SETTINGS


@pytest.mark.parametrize(
  "config, quantized, family, message",
  [
    (
      {"lowering": "mosaic_gpu", "code_operand": "offset"},
      True,
      "gpu",
      r"keys \['code_operand'\] are not taken by the quantized kernel of lowering='mosaic_gpu'",
    ),
    (
      {"lowering": "mosaic_gpu", "variant": "planar"},
      True,
      "gpu",
      r"variant='planar' is not a Mosaic GPU quantized kernel; allowed: dequantize, folded",
    ),
    (
      {"lowering": "mosaic_gpu"},
      True,
      "tpu",
      r"keys \['lowering'\] are not taken by the tpu quantized kernel",
    ),
    (
      {"lowering": "mosaic_gpu"},
      False,
      "tpu",
      r"keys \['lowering'\] are not taken by the tpu full-precision kernel",
    ),
    ({"variant": "folded"}, False, "gpu", r"keys \['variant'\] are not taken by lowering='triton'"),
  ],
)
def test_dispatch_refuses_keys_its_kernel_does_not_take(config, quantized, family, message):
  with pytest.raises(ValueError, match=message):
    attention_dispatch.check_kernel_config(config, quantized=quantized, family=family)
  attention_dispatch.check_kernel_config(config, quantized=quantized, family="reference")


@pytest.mark.parametrize(
  "text, message",
  [
    ("{", "--kernel-settings is not JSON"),
    ('{"fast": {}}', "keys among: full, quantized, kernel_backend"),
    ('{"kernel_backend": "cuda"}', "kernel_backend='cuda' is not supported; allowed: None, gpu"),
    ('{"quantized": {"variant": "fast"}}', "variant='fast' is not supported"),
  ],
)
def test_cli_kernel_settings_errors(text, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["generate", "--prompt", "x", "--kernel-settings", text])
  assert message in capsys.readouterr().err + str(exit_info.value)


@pytest.mark.parametrize("spec", ["full", "kivi:group_size=128", "gear:group_size=128,block=128"])
def test_storage_methods_take_only_kernel_settings_objects(spec):
  method = type(parse_method_spec(spec))
  with pytest.raises(ValueError, match="kernel_settings must be a kvjax.kernel_settings.Kernel"):
    method(kernel_settings={"quantized": {"variant": "folded"}})
  # Blocks smaller than a key group: refused by the Triton kernel when traced, taken by the
  # Mosaic GPU one, rounded up by the TPU one; so the method takes them.
  settings = KernelSettings(quantized={"lowering": "mosaic_gpu", "block_tokens": 64})
  parse_method_spec(spec, kernel_settings=settings)


def test_numpy_ints_are_held_as_the_ints_they_equal():
  settings = KernelSettings(full={"block_tokens": np.int64(64), "num_splits": np.int32(2)})
  assert settings == KernelSettings(full={"block_tokens": 64, "num_splits": 2})
  assert all(type(value) is int for _, value in settings.full)


@pytest.mark.parametrize("approx_math", [True, False])
def test_boolean_folded_settings_are_taken(approx_math):
  quantized = {"lowering": "mosaic_gpu", "variant": "folded", "approx_math": approx_math}
  assert KernelSettings(quantized=quantized).quantized_config() == quantized


def test_cli_kernel_settings_are_parsed_once():
  """The pre-load check and the command share one frozen KernelSettings per flag text."""
  from kvjax.cli import kernel_settings_from_json

  text = '{"kernel_backend": "tpu", "quantized": {"num_splits": 2}}'
  settings = kernel_settings_from_json(text)
  assert settings == KernelSettings(quantized={"num_splits": 2}, kernel_backend="tpu")
  assert kernel_settings_from_json(text) is settings
