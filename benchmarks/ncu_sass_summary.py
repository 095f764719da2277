"""Summarises Nsight Compute's per-instruction SASS page of one kernel: where the warps stall
and which instructions the hottest loop runs.

  ncu --target-processes all --kernel-name regex:quantized_decode_attention --launch-skip 1 \
      --launch-count 1 --set full --import-source no -o rep \
      python benchmarks/profile_quantized_kernel.py --bits 2
  ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
  python benchmarks/ncu_sass_summary.py sass.csv

The hottest loop is taken as the instructions with the largest execution count (a kernel's
main loop body runs most often); the count is per warp, so for the decode kernels it is
(rows x KV heads x blocks per row x warps per program).
"""

import argparse
import collections
import csv
import io
from dataclasses import dataclass

STALL_PREFIX = "stall_"
SAMPLES_COLUMN = "Warp Stall Sampling (All Samples)"
EXECUTED_COLUMN = "Instructions Executed"


@dataclass(frozen=True)
class SassSummary:
  stall_fractions: dict[str, float]  # stall reason -> share of all samples
  stall_opcodes: dict[str, list[tuple[str, float]]]  # stall reason -> top opcodes by samples
  loop_opcodes: dict[str, int]  # opcode (without modifiers) -> count in the hottest loop
  loop_length: int  # instructions in the hottest loop
  loop_executions: int  # how often each of them ran


def _number(text: str) -> float:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return 0.0


def _opcode(sass: str) -> str:
  words = sass.split()
  if words and words[0].startswith("@"):  # predicate guard
    words = words[1:]
  return words[0].split(".")[0] if words else ""


def summarise(csv_text: str, top: int = 5) -> SassSummary:
  """Parses `ncu --page source --csv --print-source sass` output (a kernel-name line, then a
  header row, then one row per instruction)."""
  rows = list(csv.reader(io.StringIO(csv_text)))
  header_index = next(
    (i for i, row in enumerate(rows) if SAMPLES_COLUMN in row and EXECUTED_COLUMN in row), None
  )
  if header_index is None:
    raise ValueError(
      f"no header row with {SAMPLES_COLUMN!r} and {EXECUTED_COLUMN!r}: is this ncu's "
      "'--page source --csv --print-source sass' output?"
    )
  header = rows[header_index]
  column = {name: i for i, name in enumerate(header)}
  stalls = [n for n in header if n.startswith(STALL_PREFIX) and "Not Issued" not in n]
  instructions = [row for row in rows[header_index + 1 :] if len(row) == len(header)]
  if not instructions:
    raise ValueError("the SASS page lists no instructions")
  totals = collections.Counter()
  by_opcode = collections.defaultdict(collections.Counter)
  for row in instructions:
    opcode = _opcode(row[column["Source"]])
    for stall in stalls:
      samples = _number(row[column[stall]])
      totals[stall] += samples
      by_opcode[stall][opcode] += samples
  all_samples = sum(totals.values()) or 1.0
  executions = collections.Counter(
    int(_number(row[column[EXECUTED_COLUMN]])) for row in instructions
  )
  loop_executions = max(executions)
  loop = [
    row for row in instructions if int(_number(row[column[EXECUTED_COLUMN]])) == loop_executions
  ]
  return SassSummary(
    stall_fractions={
      stall.removeprefix(STALL_PREFIX): samples / all_samples
      for stall, samples in totals.most_common()
      if samples
    },
    stall_opcodes={
      stall.removeprefix(STALL_PREFIX): [
        (opcode, samples / all_samples)
        for opcode, samples in by_opcode[stall].most_common(top)
        if samples
      ]
      for stall, samples in totals.most_common()
      if samples
    },
    loop_opcodes=dict(
      collections.Counter(_opcode(row[column["Source"]]) for row in loop).most_common()
    ),
    loop_length=len(loop),
    loop_executions=loop_executions,
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
  parser.add_argument("--top", type=int, default=5, help="opcodes listed per stall reason")
  args = parser.parse_args()
  with open(args.csv) as f:
    summary = summarise(f.read(), top=args.top)
  print("stall reasons (share of all warp samples), top opcodes:")
  for stall, fraction in summary.stall_fractions.items():
    opcodes = ", ".join(f"{op} {share:.1%}" for op, share in summary.stall_opcodes[stall])
    print(f"  {stall:16s} {fraction:6.1%}  {opcodes}")
  print(
    f"hottest loop: {summary.loop_length} instructions, each executed "
    f"{summary.loop_executions} times; opcodes:"
  )
  for opcode, count in summary.loop_opcodes.items():
    print(f"  {opcode:10s} {count}")


if __name__ == "__main__":
  main()
