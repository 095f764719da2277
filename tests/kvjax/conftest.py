from typing import NamedTuple

import jax
import numpy as np
import pytest

from kvjax import attention_dispatch
from kvjax.duo_gate_profile import DuoGateProfile
from kvjax.retrieval_heads import HeadProfile
from pallas_kernels import (
  decode_attention_gpu,
  decode_attention_tpu,
  quantized_decode_attention_gpu,
  quantized_decode_attention_tpu,
)
from pallas_kernels.gear_outlier_terms_tpu import stored_outlier_slots
from tests.kvjax.tiny_decoder import tiny_decoder


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
  """A RazorAttention head profile of the tiny decoder (random scores, a quarter retained)."""
  decoder, _ = tiny_decoder()
  rng = np.random.default_rng(0)
  shape = decoder.cache_shape
  profile = HeadProfile.from_scores(
    shape,
    rng.random((shape.num_layers, shape.num_kv_heads)),
    rng.random((shape.num_layers, shape.num_kv_heads)),
    induction_ratio=0.25,
    echo_ratio=0.0,
  )
  path = tmp_path_factory.mktemp("razor") / "tiny.json"
  profile.save(path)
  return str(path)


@pytest.fixture(scope="module")
def gates_path(tmp_path_factory):
  """DuoAttention gates of the tiny decoder (random: half the KV heads full by default)."""
  decoder, _ = tiny_decoder()
  shape = decoder.cache_shape
  gates = np.random.default_rng(1).random((shape.num_layers, shape.num_kv_heads))
  path = tmp_path_factory.mktemp("duo") / "tiny_gates.json"
  DuoGateProfile.from_gates(shape, gates).save(path)
  return str(path)


class KernelCall(NamedTuple):
  name: str  # the entry point's name, e.g. "quantized_decode_attention_gpu"
  query_shape: tuple[int, ...]
  kwargs: dict


class KernelCalls(list):
  """The kernel entry points the dispatch called, in order (recorded when traced)."""

  @property
  def names(self) -> list[str]:
    return [call.name for call in self]


@pytest.fixture
def kernel_calls(monkeypatch):
  """Every call of the GPU and TPU kernel entry points, full and quantized: a result equal to
  the reference's could also come from the reference itself."""
  calls = KernelCalls()
  for module in (
    decode_attention_gpu,
    decode_attention_tpu,
    quantized_decode_attention_gpu,
    quantized_decode_attention_tpu,
  ):
    name = module.__name__.rsplit(".", 1)[-1]
    kernel = getattr(module, name)

    def record(queries, *args, _kernel=kernel, _name=name, **kwargs):
      calls.append(KernelCall(_name, queries.shape, kwargs))
      return _kernel(queries, *args, **kwargs)

    monkeypatch.setattr(module, name, record)
  return calls


@pytest.fixture
def laid_out_for_a_tpu():
  """Calling it, caches made from then on are laid out as the compiled TPU kernel reads them
  (`attention_dispatch.quantized_segment_granule`, `full_precision_cache_granule` and
  `gear_outlier_slots`, made to answer here
  what they answer on a TPU); its `undo` (and the test's end) puts this machine's layout back.
  Programs jit traced before either are dropped: they hold the other layout under the same
  static arguments."""
  patch = pytest.MonkeyPatch()  # its own: undoing it leaves other fixtures' patches in place

  def lay_out():
    patch.setattr(
      attention_dispatch,
      "quantized_segment_granule",
      lambda implementation, head_dim, group_size, stats_dtype, kernel_backend=None, **kw: (
        quantized_decode_attention_tpu.segment_token_granule(
          head_dim, group_size, stats_dtype, kw.get("outlier_block")
        )
      ),
    )
    patch.setattr(
      attention_dispatch,
      "full_precision_cache_granule",
      lambda implementation, head_dim, kernel_backend=None: (
        decode_attention_tpu.cache_token_granule(head_dim)
      ),
    )
    patch.setattr(
      attention_dispatch,
      "gear_outlier_slots",
      lambda implementation, head_dim, count, kernel_backend=None: (
        stored_outlier_slots(count) if count else count
      ),
    )
    jax.clear_caches()  # the programs traced so far made this machine's layout

  def undo():
    patch.undo()
    jax.clear_caches()

  lay_out.undo = undo
  yield lay_out
  undo()
