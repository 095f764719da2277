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
      r"block_tokens=0 is not supported; allowed: None or a power of two in \[16, 2\*\*20\]",
    ),
    ({"block_tokens": -64}, "block_tokens=-64"),
    ({"block_tokens": 8}, "block_tokens=8"),
    ({"block_tokens": 96}, "block_tokens=96"),
    ({"block_tokens": 64.0}, "block_tokens=64.0"),
    ({"block_tokens": "abc"}, "block_tokens='abc'"),
    ({"num_splits": 0}, r"num_splits=0 is not supported; allowed: None or an int in \[1, 2\*\*20"),
    ({"num_splits": True}, "num_splits=True"),
    ({"block_tokens": 2**31}, "block_tokens=2147483648"),  # overflowed int32 inside the trace
    ({"num_splits": 2**20 + 1}, "num_splits=1048577"),
    ({"num_warps": 3}, r"num_warps=3 is not supported; allowed: None or one of \(1, 2, 4, 8, 16\)"),
    ({"num_warps": 32}, "num_warps=32"),
    ({"num_stages": 0}, r"num_stages=0 is not supported; allowed: None or an int in \[1, 2\*\*20"),
    ({"unroll": -1}, r"unroll=-1 is not supported; allowed: None or an int in \[1, 2\*\*20\]"),
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
