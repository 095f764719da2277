"""`benchmarks/tpu_kernel_accuracy.py`: the kernel's error against the reference, small and
nonzero (the kernel rounds to bfloat16 somewhere: an error of 0 would mean the reference was
compared with itself), and bad specs refused by name."""

import pytest

from tests.benchmarks.benchmark_modules import load_benchmark

accuracy = load_benchmark("tpu_kernel_accuracy")


@pytest.mark.parametrize("bits,head_dim", [(2, 128), (4, 64)])
def test_the_code_pair_kernels_error_is_small_and_not_zero(bits, head_dim):
  block = 512 if head_dim >= 128 else 4096  # whole lane tiles of key groups at head_dim 64
  error = accuracy.relative_error(
    0, kind="kivi", bits=bits, head_dim=head_dim, tokens=block, block_tokens=block
  )
  assert 0 < error < 2e-3


def test_a_spec_of_the_wrong_shape_is_refused(capsys):
  with pytest.raises(SystemExit):
    accuracy.main(["kivi:2:128:1:512"])
  assert "KIND:BITS:HEAD_DIM:SEEDS:TOKENS:BLOCK" in capsys.readouterr().err
  with pytest.raises(ValueError, match="kind='full'; allowed: kivi, gear"):
    accuracy.relative_error(0, kind="full", bits=2, head_dim=128, tokens=512, block_tokens=512)
