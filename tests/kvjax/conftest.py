import numpy as np
import pytest

from kvjax.retrieval_heads import HeadProfile
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
