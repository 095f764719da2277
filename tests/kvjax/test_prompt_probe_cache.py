import jax.numpy as jnp
import pytest

from kvjax.duo_gate_training import DuoGateLayerCache
from kvjax.retrieval_heads import HeadScoreProbeLayerCache


def _probes():
  zeros = jnp.zeros((1, 2, 3), jnp.float32)
  return [
    DuoGateLayerCache(jnp.ones((2,), jnp.float32), sinks=1, recent=4),
    HeadScoreProbeLayerCache(
      echo=zeros, induction=zeros, block_len=4, prefix_len=1, sm_scale=0.5, query_chunk=8
    ),
  ]


@pytest.mark.parametrize("probe", _probes(), ids=lambda p: type(p).__name__)
def test_a_prompt_probe_refuses_to_decode_and_counts_its_own_arrays(probe):
  name = type(probe).__name__
  with pytest.raises(ValueError, match=f"{name} only observes a prompt's attention.*cannot decode"):
    probe.append(jnp.zeros((1, 2, 8)), jnp.zeros((1, 2, 8)))
  with pytest.raises(ValueError, match=f"{name} only observes"):
    probe.attend(jnp.zeros((1, 2, 3, 8)), sm_scale=0.5)
  # No K/V stored; its bytes are its own arrays (gates or scores).
  assert probe.stored_elements == 0
  assert probe.nbytes == {"DuoGateLayerCache": 8, "HeadScoreProbeLayerCache": 48}[name]
