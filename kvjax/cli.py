"""`kvjax` command line: the one composition root inside kvjax that imports `models` (lazily)."""

import argparse
import json
import sys

DEFAULT_MODEL = "smollm2-135m"


def _add_generate(subparsers):
  p = subparsers.add_parser("generate", help="generate text with a (compressed) KV cache")
  p.add_argument("--prompt", required=True, help="prompt text")
  p.add_argument("--model", default=DEFAULT_MODEL, help="short name, .gguf file or HF directory")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--raw", action="store_true", help="do not apply the chat template")
  p.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=None)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--method", default="full", help="cache method spec, e.g. full, kivi:bits=4")
  p.add_argument("--implementation", default="auto", help="attention: auto|pallas|reference|interpret")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.set_defaults(run=run_generate)


def run_generate(args) -> int:
  import jax

  from kvjax.generate import generate
  from kvjax.method_spec import parse_method_spec
  from kvjax.sampling import SamplingConfig
  from models.loading import load_model

  cache_method = parse_method_spec(args.method, implementation=args.implementation)
  if args.temperature is None and (args.top_k is not None or args.top_p is not None):
    raise SystemExit("error: --top-k/--top-p need --temperature (greedy decoding otherwise)")
  sampling = SamplingConfig(
      temperature=args.temperature or 0.0, top_k=args.top_k, top_p=args.top_p
  )
  loaded = load_model(args.model)
  text = args.prompt
  if not args.raw:
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}])
  prompt_ids = loaded.tokenizer.encode(text)
  result = generate(
      loaded.decoder,
      loaded.params,
      [prompt_ids],
      max_new_tokens=args.max_new_tokens,
      cache_method=cache_method,
      sampling=sampling,
      stop_token_ids=loaded.stop_token_ids,
      pad_token_id=loaded.stop_token_ids[0] if loaded.stop_token_ids else 0,
      key=jax.random.key(args.seed),
      max_cache_tokens=loaded.config.max_position_embeddings,
  )
  output_ids = result.token_lists()[0]
  out_text = loaded.tokenizer.decode(output_ids)
  if args.json:
    print(json.dumps(dict(
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        text=out_text,
        prefill_s=result.prefill_s,
        decode_s=result.decode_s,
        decode_tokens_per_s=result.decode_tokens_per_s,
        compile_s=result.compile_s,
        model=args.model,
        method=args.method,
        cache_bytes=result.cache_bytes,
    )))
  else:
    print(out_text)
    print(
        f"[{len(prompt_ids)} prompt tokens, {len(output_ids)} new; compile {result.compile_s:.2f}s, "
        f"prefill {result.prefill_s:.3f}s, decode {result.decode_tokens_per_s:.1f} tok/s, "
        f"cache {result.cache_bytes / 2**20:.2f} MiB]",
        file=sys.stderr,
    )
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="kvjax", description=__doc__)
  subparsers = parser.add_subparsers(dest="command", required=True)
  _add_generate(subparsers)
  return parser


def main(argv=None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    return args.run(args)
  except ValueError as error:
    parser.exit(2, f"kvjax {args.command}: error: {error}\n")


if __name__ == "__main__":
  sys.exit(main())
