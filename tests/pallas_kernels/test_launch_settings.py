import pytest

from pallas_kernels.launch_settings import check_launch_settings
from pallas_kernels.splits import plan_splits


@pytest.mark.parametrize(
  "config",
  [
    None,
    {},
    {"block_tokens": 16, "num_splits": 1, "num_warps": 1, "num_stages": 1, "unroll": 1},
    {"block_tokens": 512, "num_splits": 37, "num_warps": 16, "num_stages": 4, "unroll": 8},
    {"block_tokens": None, "num_splits": None, "num_warps": None},  # the kernels' defaults
    {"variant": "folded", "lowering": "triton"},  # not numbers: their kernels check them
  ],
)
def test_allowed_settings_pass(config):
  check_launch_settings(config)


@pytest.mark.parametrize(
  "config, message",
  [
    (
      {"block_tokens": 0},
      r"block_tokens=0 is not supported; allowed: None or a power of two >= 16",
    ),
    ({"block_tokens": -64}, "block_tokens=-64"),
    ({"block_tokens": 8}, "block_tokens=8"),
    ({"block_tokens": 96}, "block_tokens=96"),
    ({"block_tokens": 64.0}, "block_tokens=64.0"),
    ({"block_tokens": "abc"}, "block_tokens='abc'"),
    ({"num_splits": 0}, "num_splits=0 is not supported; allowed: None or an int >= 1"),
    ({"num_splits": True}, "num_splits=True"),
    ({"num_warps": 3}, r"num_warps=3 is not supported; allowed: None or one of \(1, 2, 4, 8, 16\)"),
    ({"num_warps": 32}, "num_warps=32"),
    ({"num_stages": 0}, "num_stages=0 is not supported; allowed: None or an int >= 1"),
    ({"unroll": -1}, "unroll=-1 is not supported; allowed: None or an int >= 1"),
  ],
)
def test_bad_settings_are_named_with_their_allowed_values(config, message):
  with pytest.raises(ValueError, match=message):
    check_launch_settings(config)


def test_split_planner_refuses_fewer_than_one_split_and_caps_at_one_block_each():
  with pytest.raises(ValueError, match="num_splits=0 is not supported"):
    plan_splits(1000, 64, 8, 0, 128)
  plan = plan_splits(1000, 64, 8, 100, 128)  # 16 blocks: at most 16 non-empty splits
  assert (plan.num_splits, plan.blocks_per_split) == (16, 1)
