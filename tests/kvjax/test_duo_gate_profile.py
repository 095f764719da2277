import dataclasses
import json

import numpy as np
import pytest

from kvjax.cache_protocol import ModelCacheShape
from kvjax.duo_gate_profile import DuoGateProfile, default_full_fraction

SHAPE = ModelCacheShape(num_layers=3, num_kv_heads=2, num_query_heads=4, head_dim=8)
GATES = [[0.9, 0.1], [0.5, 0.5], [0.0, 1.0]]


def test_the_largest_gates_keep_the_full_cache():
  profile = DuoGateProfile.from_gates(SHAPE, GATES)
  assert profile.full_heads(1 / 3) == ((0, 0), (2, 1))
  # ties: the earlier head
  assert profile.full_heads(0.5) == ((0, 0), (1, 0), (2, 1))
  assert profile.full_heads(0.0) == ()
  assert len(profile.full_heads(1.0)) == 6
  # ceil: a fraction of a head keeps a whole one
  assert profile.full_heads(0.01) == ((2, 1),)


def test_the_authors_fractions_by_attention_kind():
  assert default_full_fraction(SHAPE) == 0.5  # grouped-query
  assert default_full_fraction(dataclasses.replace(SHAPE, num_query_heads=2)) == 0.25


def test_a_saved_profile_loads_equal(tmp_path):
  profile = DuoGateProfile.from_gates(
    SHAPE, np.array(GATES), training=dict(steps=3, text=None), model_name="m"
  )
  profile.save(tmp_path / "g.json")
  loaded = DuoGateProfile.load(tmp_path / "g.json")
  assert loaded == profile and hash(loaded) == hash(profile)
  assert "m: 3 layers x 2 KV heads" in repr(loaded)


def _saved(tmp_path, **changes):
  data = DuoGateProfile.from_gates(SHAPE, GATES).to_json_dict()
  for key, value in changes.items():
    if key in data["model"]:
      data["model"][key] = value
    else:
      data[key] = value
  path = tmp_path / "g.json"
  path.write_text(json.dumps(data))
  return path


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(format="kvjax-head-profile"), "not a kvjax duo gate file"),
    (dict(version=2), "gate file version 2; this kvjax reads version 1"),
    (dict(head_dim=8.9), "model head_dim=8.9 must be an int"),
    (dict(num_layers="3"), "model num_layers='3' must be an int"),
    (dict(gates=[[0.9, 0.1], [0.5, 0.5]]), r"gates must be \[num_layers, num_kv_heads\]"),
    (dict(gates=[[0.9, "0.1"], [0.5, 0.5], [0.0, 1.0]]), "gate '0.1' must be a number"),
    (dict(gates=[[0.9, 1.5], [0.5, 0.5], [0.0, 1.0]]), r"every gate must be a finite number in"),
    (dict(training=dict(steps=[1, 2])), "training setting 'steps'=\\[1, 2\\] must be a scalar"),
  ],
)
def test_a_malformed_file_is_refused_by_name(tmp_path, changes, message):
  with pytest.raises(ValueError, match=message):
    DuoGateProfile.load(_saved(tmp_path, **changes))


def test_missing_and_broken_files_are_refused(tmp_path):
  with pytest.raises(
    ValueError, match="does not exist; train it once per model with .kvjax duo-train."
  ):
    DuoGateProfile.load(tmp_path / "missing.json")
  (tmp_path / "bad.json").write_text("{")
  with pytest.raises(ValueError, match="is not valid JSON"):
    DuoGateProfile.load(tmp_path / "bad.json")


def test_gates_of_another_model_are_refused():
  profile = DuoGateProfile.from_gates(SHAPE, GATES)
  with pytest.raises(ValueError, match="was trained for another model"):
    profile.check_matches(dataclasses.replace(SHAPE, head_dim=16), source="duo: gate file")


@pytest.mark.parametrize("fraction", [-0.1, 1.5, True, "0.5"])
def test_a_bad_fraction_is_refused(fraction):
  with pytest.raises(ValueError, match="full_fraction=.* must be a number in \\[0, 1\\]"):
    DuoGateProfile.from_gates(SHAPE, GATES).full_heads(fraction)


def test_a_training_setting_that_is_not_a_scalar_is_refused_when_made():
  # It saved, then its file did not load, and the method holding it did not hash (jit).
  with pytest.raises(ValueError, match=r"training setting 'token_range'=\[1, 2\] must be a scalar"):
    DuoGateProfile.from_gates(SHAPE, np.full((3, 2), 0.5), training=dict(token_range=[1, 2]))
