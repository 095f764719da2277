import pytest

from kvjax.dense_cache import FullCache
from kvjax.method_registry import METHODS
from kvjax.method_spec import describe_method, parse_method_spec


def test_full_spec_and_implementation_override():
  assert parse_method_spec("full") == FullCache()
  assert parse_method_spec(" FULL ", implementation="reference") == FullCache("reference")


@pytest.mark.parametrize(
  "spec, message",
  [
    ("", "empty cache method spec"),
    ("nonsense", "unknown cache method 'nonsense'; available: .*full"),
    ("full:bits=2", "full: unknown parameter 'bits=2'"),
    ("full+full", "at most one selection method and one storage method"),
    ("kivi:bits=4,bits=2", r"kivi: parameter bits is given twice \('bits=4,bits=2'\)"),
    # A value the method refuses names the method of the spec it came from.
    ("snapkv:budget=64+kivi:bits=3", "kivi: bits=3 is not supported; allowed: 2, 4, 8"),
    ("gear:bits=3", "gear: bits=3 is not supported"),
  ],
)
def test_bad_specs_error_clearly(spec, message):
  with pytest.raises(ValueError, match=message):
    parse_method_spec(spec)


def test_keys_are_as_case_blind_as_names():
  assert parse_method_spec("KIVI:BITS=4,Group_Size=64") == parse_method_spec(
    "kivi:bits=4,group_size=64"
  )


@pytest.mark.parametrize("spec", [123, None, ["kivi"]])
def test_a_spec_that_is_not_a_string_is_refused(spec):
  with pytest.raises(ValueError, match=r"spec=.* must be a string such as 'kivi:bits=4'"):
    parse_method_spec(spec)


def test_bad_implementation_errors():
  with pytest.raises(ValueError, match="implementation='gpu'.*allowed: auto, pallas"):
    parse_method_spec("full", implementation="gpu")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_registered_default_spec_round_trips(name, profile_path, gates_path):
  # RazorAttention and DuoAttention have no default: they need a head profile / gate file.
  spec = {"razor": f"razor:profile={profile_path}", "duo": f"duo:profile={gates_path}"}.get(
    name, name
  )
  method = parse_method_spec(spec)
  assert parse_method_spec(describe_method(method)) == method


@pytest.mark.parametrize("method", ["kivi", None, FullCache])
def test_describe_method_refuses_what_is_not_a_method_object(method):
  with pytest.raises(ValueError, match="method must be a cache method object .* got "):
    describe_method(method)
