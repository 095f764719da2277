"""Codecs for quantized KV caches: group-wise quantization, sparse outliers, low-rank residuals."""

from kvjax.quantization.group_quantization import (
  GroupQuantized,
  check_quantization_config,
  dequantize_keys,
  dequantize_values,
  quantize_keys_per_channel,
  quantize_values_per_token,
)
from kvjax.quantization.low_rank import LowRankFactors, check_rank, power_iteration_low_rank
from kvjax.quantization.outliers import (
  Outliers,
  check_outlier_fraction,
  extract_outliers,
  outlier_count_per_side,
  scatter_outliers,
)

__all__ = [
  "GroupQuantized",
  "LowRankFactors",
  "Outliers",
  "check_outlier_fraction",
  "check_quantization_config",
  "check_rank",
  "dequantize_keys",
  "dequantize_values",
  "extract_outliers",
  "outlier_count_per_side",
  "power_iteration_low_rank",
  "quantize_keys_per_channel",
  "quantize_values_per_token",
  "scatter_outliers",
]
