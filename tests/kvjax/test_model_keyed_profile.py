"""The file handling RazorAttention's head profile and DuoAttention's gate file share."""

import dataclasses

import numpy as np
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


def test_numpy_counts_are_written_as_json_numbers(tmp_path):
  # A count read from a numpy config (np.int64) is accepted by the checks; JSON cannot hold
  # one, and saving died half-way through the file.
  head_profile = dataclasses.replace(_profiles()[1], detection=(("block_len", np.int64(8)),))
  head_profile.save(tmp_path / "h.json")
  assert HeadProfile.load(tmp_path / "h.json").detection == (("block_len", 8),)
  gates = DuoGateProfile.from_gates(
    SHAPE, [[0.2, 0.9], [0.4, 0.1]], training=dict(steps=np.int64(10))
  )
  assert gates.training == (("steps", 10),) and type(gates.training[0][1]) is int
  gates.save(tmp_path / "g.json")
  assert DuoGateProfile.load(tmp_path / "g.json") == gates


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: type(p).__name__)
def test_a_save_that_fails_leaves_the_file_there_untouched(profile, tmp_path, monkeypatch):
  path = tmp_path / "p.json"
  profile.save(path)
  before = path.read_bytes()
  kind = type(profile)
  unwritable = dict(profile.to_json_dict(), extra=object())
  monkeypatch.setattr(kind, "to_json_dict", lambda self: unwritable)
  with pytest.raises(TypeError, match="cannot be written to JSON"):
    profile.save(path)
  assert path.read_bytes() == before
  assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # nothing partial left beside it
  monkeypatch.undo()
  assert kind.load(path) == profile


@pytest.mark.parametrize("kind", [DuoGateProfile, HeadProfile], ids=lambda k: k.__name__)
def test_a_directory_or_a_binary_file_is_refused_by_name(kind, tmp_path):
  with pytest.raises(ValueError, match=f"{kind.WHAT} '.*' cannot be read"):
    kind.load(tmp_path)
  (tmp_path / "model.gguf").write_bytes(b"GGUF\xff\xfe\x00\x01")
  with pytest.raises(ValueError, match=f"{kind.WHAT} '.*model.gguf' is not valid JSON"):
    kind.load(tmp_path / "model.gguf")


@pytest.mark.parametrize("profile", _profiles(), ids=lambda p: type(p).__name__)
def test_a_save_through_a_link_writes_the_file_it_names_and_keeps_its_mode(profile, tmp_path):
  shared = tmp_path / "shared_v1.json"
  profile.save(shared)
  shared.chmod(0o640)
  (tmp_path / "current.json").symlink_to(shared)
  kind = type(profile)
  renamed = dataclasses.replace(profile, model_name="renamed")
  renamed.save(tmp_path / "current.json")
  assert (tmp_path / "current.json").is_symlink()  # the link was replaced by a file
  assert kind.load(shared) == renamed
  assert shared.stat().st_mode & 0o777 == 0o640
