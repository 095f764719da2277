"""Writing comparison results: terminal table, results.json, results.md, quality_vs_memory.png."""

import json
import math
import pathlib

COLUMNS = (
  ("method", "method", "{}"),
  ("cache_bytes", "cache MiB", "{:.2f}"),
  ("cache_bytes_at_end", "MiB at end", "{:.2f}"),
  ("compression_ratio", "x smaller", "{:.2f}"),
  ("bits_per_element", "bits/elem", "{:.2f}"),
  ("ppl", "ppl", "{:.3f}"),
  ("kl", "KL", "{:.4f}"),
  ("passkey_acc", "needle", "{:.2f}"),
  ("passkey_agnostic_acc", "needle (q-agnostic)", "{:.2f}"),
  ("prefill_s", "prefill s", "{:.2f}"),
  ("decode_tokens_per_s", "decode tok/s", "{:.1f}"),
  ("compile_s", "compile s", "{:.1f}"),
)


def _cell(record, key, fmt):
  value = record.get(key)
  if value is None:  # not measured; a NaN or inf result prints as such
    return "-"
  if key in ("cache_bytes", "cache_bytes_at_end"):
    value = value / 2**20
  text = fmt.format(value)
  if not key.endswith("_acc"):
    return text
  # A needle asked at several lengths shows each length's accuracy (results.json has each
  # one's depths); at one length, each depth's.
  by_length = record.get(key + "_by_length") or {}
  if len(by_length) > 1:
    return text + " (" + ", ".join(f"{n}: {r['accuracy']:.2f}" for n, r in by_length.items()) + ")"
  by_depth = record.get(key + "_by_depth")
  if by_depth:
    text += " (" + "/".join(f"{v:.2f}" for v in by_depth.values()) + ")"
  return text


def format_table(records: list[dict], *, markdown: bool = False) -> str:
  columns = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in records)]
  header = [title for _, title, _ in columns]
  rows = [[_cell(r, key, fmt) for key, _, fmt in columns] for r in records]
  if markdown:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
  widths = [max(len(x) for x in col) for col in zip(header, *rows)]
  fmt_row = lambda row: "  ".join(x.ljust(w) for x, w in zip(row, widths))
  return "\n".join(
    [fmt_row(header), fmt_row(["-" * w for w in widths])] + [fmt_row(r) for r in rows]
  )


def plot_quality_vs_memory(records: list[dict], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  metrics = [
    m
    for m in ("ppl", "kl", "passkey_acc", "passkey_agnostic_acc")
    if any(r.get(m) is not None for r in records)
  ]
  fig, axes = plt.subplots(
    1, max(len(metrics), 1), figsize=(5 * max(len(metrics), 1), 4), squeeze=False
  )
  for axis, metric in zip(axes[0], metrics):
    for record in records:
      if record.get(metric) is None:
        continue
      x = record["cache_bytes"] / 2**20
      axis.scatter(x, record[metric])
      axis.annotate(
        record["method"], (x, record[metric]), fontsize=7, xytext=(3, 3), textcoords="offset points"
      )
    axis.set_xlabel("cache MiB after the context")
    axis.set_ylabel(
      {
        "ppl": "continuation perplexity",
        "kl": "KL(full || method)",
        "passkey_acc": "needle accuracy",
        "passkey_agnostic_acc": "needle accuracy (query-agnostic)",
      }[metric]
    )
    axis.grid(alpha=0.3)
  fig.suptitle("quality vs. cache memory")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _finite_or_none(value):
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, dict):
    return {key: _finite_or_none(item) for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [_finite_or_none(item) for item in value]
  return value


def write_results(records: list[dict], out_dir: pathlib.Path, *, header: str = "") -> None:
  out_dir.mkdir(parents=True, exist_ok=True)
  # A NaN or infinite result (a KL that overflowed) is written as null: bare NaN / Infinity
  # are not JSON, and strict readers (jq, JavaScript) refuse the file. The table prints them.
  (out_dir / "results.json").write_text(
    json.dumps(_finite_or_none(records), indent=2, allow_nan=False)
  )
  (out_dir / "results.md").write_text(
    (header + "\n\n" if header else "") + format_table(records, markdown=True) + "\n"
  )
  plot_quality_vs_memory(records, out_dir / "quality_vs_memory.png")
