"""The file handling RazorAttention's head profile and DuoAttention's gate file share."""

import pytest

from kvjax.cache_protocol import ModelCacheShape
from kvjax.duo_gate_profile import DuoGateProfile
from kvjax.retrieval_heads import HeadProfile

SHAPE = ModelCacheShape(num_layers=2, num_kv_heads=2, num_query_heads=4, head_dim=8)


def _profiles():
  return [
    DuoGateProfile.from_gates(SHAPE, [[0.2, 0.9], [0.4, 0.1]], model_name="m"),
    HeadProfile.from_scores(
      SHAPE,
      [[0.1, 0.9], [0.3, 0.2]],
      [[0.0, 0.1], [0.5, 0.0]],
      induction_ratio=0.25,
      model_name="m",
    ),
  ]


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: type(p).__name__)
def test_a_method_argument_is_the_profile_or_its_file(profile, tmp_path):
  kind = type(profile)
  assert kind.from_method_argument("m", profile) is profile
  profile.save(tmp_path / "p.json")
  assert kind.from_method_argument("m", tmp_path / "p.json") == profile
  assert kind.from_method_argument("m", str(tmp_path / "p.json")) == profile
  with pytest.raises(ValueError, match=f"m: profile=<{kind.WHAT} JSON> is required.*{kind.MAKER}"):
    kind.from_method_argument("m", None)
  with pytest.raises(ValueError, match=f"m: profile=1.5 must be a file path or a {kind.__name__}"):
    kind.from_method_argument("m", 1.5)
  with pytest.raises(ValueError, match=f"does not exist; {kind.MAKE} it once per model with"):
    kind.from_method_argument("m", tmp_path / "missing.json")


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: type(p).__name__)
def test_a_profile_refuses_a_model_of_another_shape(profile):
  profile.check_matches(SHAPE)
  other = ModelCacheShape(num_layers=2, num_kv_heads=2, num_query_heads=2, head_dim=8)
  with pytest.raises(
    ValueError, match=f"was {profile.MADE} for another model.*kvjax {profile.COMMAND}"
  ):
    profile.check_matches(other)
