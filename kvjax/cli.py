"""`kvjax` command line: the one composition root inside kvjax that imports `models` (lazily)."""

import argparse
import functools
import json
import sys

DEFAULT_MODEL = "smollm2-135m"


def _add_generate(subparsers):
  p = subparsers.add_parser("generate", help="generate text with a (compressed) KV cache")
  p.add_argument("--prompt", required=True, help="prompt text")
  _add_model_argument(p)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument(
    "--raw",
    action="store_true",
    help="do not apply the chat template (the tokenizer adds its BOS, if it has one to add)",
  )
  p.add_argument(
    "--temperature", type=float, default=None, help="sample at this temperature (default: greedy)"
  )
  p.add_argument("--top-k", type=int, default=None)
  p.add_argument("--top-p", type=float, default=None)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--method", default="full", help="cache method spec, e.g. full, kivi:bits=4")
  _add_prefill_chunk_argument(p)
  _add_attention_arguments(p)
  p.add_argument(
    "--layer-loop",
    choices=("unroll", "scan"),
    default="unroll",
    help="unroll: compile every layer apart (fastest decode on CPU); scan: one compiled body "
    "for look-alike layers (compiles several times faster)",
  )
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.set_defaults(run=run_generate)


def _add_model_argument(p):
  p.add_argument("--model", default=DEFAULT_MODEL, help="short name, .gguf file or HF directory")


def _add_prefill_chunk_argument(p):
  from kvjax.chunked_prefill import CHUNKED_PREFILL_METHODS

  p.add_argument(
    "--prefill-chunk",
    type=int,
    default=None,
    help="feed the prompt this many tokens at a time, compressing as it arrives (default: "
    f"the whole prompt at once; methods: {', '.join(CHUNKED_PREFILL_METHODS)})",
  )


def _add_attention_arguments(p):
  """--implementation and --kernel-settings: how a command's caches compute attention."""
  p.add_argument(
    "--implementation", default="auto", help="attention: auto|pallas|reference|interpret"
  )
  p.add_argument(
    "--kernel-settings",
    default=None,
    help='Pallas kernel settings as JSON, e.g. \'{"full": {"lowering": "mosaic_gpu"}, '
    '"quantized": {"variant": "folded"}}\', or \'{"kernel_backend": "tpu"}\' with '
    "--implementation interpret to run the TPU kernels on a CPU (see kvjax.kernel_settings)",
  )


# jax.random.key takes a seed int64 can hold (without jax_enable_x64 it keeps the low 32 bits,
# so seeds 2**32 apart draw the same); numpy's generators (compare's text windows, the razor
# probe's tokens) take no negative one.
SEED_RANGE = (-(2**63), 2**63 - 1)
NUMPY_SEED_RANGE = (0, 2**63 - 1)


def _check_run_arguments(args) -> None:
  """Checks needing neither the model nor a trace, made before the model loads (seconds)."""
  from kvjax.attention_dispatch import choose_kernel_family

  for flag, value, low in (
    ("--max-new-tokens", getattr(args, "max_new_tokens", None), 1),
    ("--prefill-chunk", args.prefill_chunk, 1),
  ):
    if value is not None and value < low:
      raise ValueError(f"{flag}={value} must be >= {low}")
  _check_seed(args)
  kernel_backend = kernel_settings_from_json(args.kernel_settings).kernel_backend
  try:
    choose_kernel_family(args.implementation, kernel_backend)
  except ValueError as error:
    raise ValueError(f"--implementation: {error}") from None


def _check_seed(args) -> None:
  seed = getattr(args, "seed", None)
  low, high = (
    NUMPY_SEED_RANGE if args.command in ("compare", "razor-profile", "duo-train") else SEED_RANGE
  )
  if seed is not None and not low <= seed <= high:
    raise ValueError(f"--seed={seed} must be in [{'0' if low == 0 else '-2**63'}, 2**63 - 1]")


def _check_razor_profile_arguments(args) -> None:
  """The probe's flags, checked before the model loads and before --output's folder is made."""
  for flag, value in (("--block-len", args.block_len), ("--repeats", args.repeats)):
    if value < 2:
      raise ValueError(f"{flag}={value} must be >= 2")
  for flag, value in (
    ("--induction-ratio", args.induction_ratio),
    ("--echo-ratio", args.echo_ratio),
  ):
    if not 0.0 <= value <= 1.0:
      raise ValueError(f"{flag}={value} must be in [0, 1] (a fraction of all KV heads)")
  _check_seed(args)


def _check_profile_model(cache_method, model_name: str) -> None:
  """A razor head profile or duo gate file records the model it was made for: another model of
  the same shape (a fine-tune, a sibling) would take its heads without an error."""
  profile = getattr(cache_method, "head_profile", None)
  what, made, command = "razor head profile", "computed", "razor-profile"
  if profile is None:
    profile = getattr(cache_method, "gate_profile", None)
    what, made, command = "duo gate file", "trained", "duo-train"
  if profile is None or not profile.model_name:
    return
  recorded, given = _resolved_model(profile.model_name), _resolved_model(model_name)
  if recorded is None or given is None:
    # A model not on this machine (a path recorded elsewhere, or moved): nothing to compare.
    print(
      f"note: the {what}'s model {profile.model_name!r} is not found here; "
      f"using it for {model_name!r} unchecked",
      file=sys.stderr,
    )
    return
  if recorded == given:
    return
  raise ValueError(
    f"--method: the {what} {cache_method.profile_path or ''!r} was {made} for model "
    f"{profile.model_name!r}, not {model_name!r}; compute one for this model with "
    f"`kvjax {command} --model {model_name} --output PATH`"
  )


def _writable_directory(flag: str, path: str, *, create: bool = True) -> None:
  """`path` made a directory now (parents too), before any work whose results go there; or,
  with `create=False`, only checked: its nearest existing ancestor takes files (the writer
  makes it, so a run refused later, by checks that need the model, leaves no folder)."""
  import pathlib
  import tempfile

  directory = pathlib.Path(path)
  if directory.exists() and not directory.is_dir():
    raise ValueError(f"{flag} {path}: exists and is not a directory")
  probe = directory.absolute()
  if not create:
    while not probe.exists():
      probe = probe.parent
    if not probe.is_dir():
      raise ValueError(f"{flag} {path}: {probe} exists and is not a directory")
  try:
    if create:
      directory.mkdir(parents=True, exist_ok=True)
    # A directory that exists may still refuse files (permissions, /proc): try one now rather
    # than after the work.
    with tempfile.TemporaryFile(dir=probe):
      pass
  except OSError as error:
    raise ValueError(f"{flag} {path}: cannot write files there: {error}") from None


@functools.cache  # the pre-load check and the command read the flag: parsed once
def kernel_settings_from_json(text: str | None):
  """--kernel-settings: a JSON object with optional "full" and "quantized" dicts and
  "kernel_backend" ("gpu" | "tpu"); frozen settings, shared by every caller."""
  import json

  from kvjax.kernel_settings import DEFAULT_KERNEL_SETTINGS, KernelSettings

  if text is None:
    return DEFAULT_KERNEL_SETTINGS
  try:
    settings = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"--kernel-settings is not JSON: {e}") from e
  if not isinstance(settings, dict) or set(settings) - {"full", "quantized", "kernel_backend"}:
    raise ValueError(
      "--kernel-settings must be a JSON object with keys among: full, quantized, kernel_backend"
    )
  try:
    return KernelSettings(**settings)
  except ValueError as e:
    raise ValueError(f"--kernel-settings: {e}") from e


def _method_of_flag(spec: str, args, whose: str = "--method"):
  """The cache method `spec` names; a refusal names `whose` it is (the flag, or a saved
  context's record)."""
  from kvjax.method_spec import parse_method_spec

  try:
    return parse_method_spec(
      spec,
      implementation=args.implementation,
      kernel_settings=kernel_settings_from_json(args.kernel_settings),
    )
  except ValueError as error:
    raise ValueError(f"{whose} {spec}: {error}") from None


def run_generate(args) -> int:
  import jax

  from kvjax.generate import generate
  from kvjax.sampling import SamplingConfig
  from models.loading import load_model

  _check_run_arguments(args)
  cache_method = _method_of_flag(args.method, args)
  if not args.temperature and (args.top_k is not None or args.top_p is not None):
    raise ValueError("--top-k/--top-p need --temperature > 0 (greedy decoding otherwise)")
  try:
    sampling = SamplingConfig(
      temperature=args.temperature or 0.0, top_k=args.top_k, top_p=args.top_p
    )
  except ValueError as error:  # name the flag, not the field ("top_k=0 ..." -> "--top-k=0 ...")
    field, rest = str(error).split("=", 1)
    raise ValueError(f"--{field.replace('_', '-')}={rest}") from None
  _check_profile_model(cache_method, args.model)
  loaded = load_model(args.model, layer_loop=args.layer_loop)
  text = args.prompt
  if not args.raw:
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}])
  # A chat template writes its own BOS; raw text gets what the tokenizer adds (Llama's BOS), as
  # transformers' tokenizer(text) and llama.cpp give it to the model.
  prompt_ids = loaded.tokenizer.encode(text, add_special_tokens=args.raw)
  context = loaded.config.max_position_embeddings
  if len(prompt_ids) + args.max_new_tokens > context:
    raise ValueError(
      f"--prompt: its {len(prompt_ids)} tokens + --max-new-tokens={args.max_new_tokens} exceed "
      f"the model's context of {context} tokens"
    )
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
    prefill_chunk=args.prefill_chunk,
  )
  output_ids = result.token_lists()[0]
  out_text = loaded.tokenizer.decode(output_ids)
  if args.json:
    print(
      json.dumps(
        dict(
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
        )
      )
    )
  else:
    print(out_text)
    print(
      f"[{len(prompt_ids)} prompt tokens, {len(output_ids)} new; compile {result.compile_s:.2f}s, "
      f"prefill {result.prefill_s:.3f}s, decode {result.decode_tokens_per_s:.1f} tok/s, "
      f"cache {result.cache_bytes / 2**20:.2f} MiB]",
      file=sys.stderr,
    )
  return 0


ASK_DEFAULT_METHOD = "kivi:bits=4"
# What `kvjax ask --save` records beside the arrays, so that `kvjax ask --context` can rebuild the
# template the context is restored into.
ASK_RECORD_KEYS = ("model", "method", "document_tokens", "room", "layer_loop", "cache_dtype")
# How `ask` cuts its prompts (recorded as "prompt_format"): 2, the document's ids end with the
# document and each question's ids start with the blank line before it. Contexts saved before
# (no such key) ended with the blank line; asked the new way they would see it twice.
ASK_PROMPT_FORMAT = 2
# `ask` compresses its context in this dtype; `--save` records it and `--context` restores it.
ASK_CACHE_DTYPE = "bfloat16"  # a name: jax is imported lazily


def _add_ask(subparsers):
  p = subparsers.add_parser(
    "ask",
    help="compress a document's cache once (or restore one saved by --save), then answer "
    "several questions about it in one batch",
  )
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--document", help="UTF-8 text file")
  source.add_argument(
    "--context",
    help="a directory written by `kvjax ask --save`: its compressed document, restored "
    "instead of compressing one (model, method and layer loop are the saved ones)",
  )
  p.add_argument(
    "--question", action="append", required=True, help="a question (repeat for several)"
  )
  _add_model_argument(p)
  p.add_argument(
    "--method",
    default=None,
    help=f"cache method spec of the document (default {ASK_DEFAULT_METHOD})",
  )
  p.add_argument("--max-new-tokens", type=int, default=64)
  _add_prefill_chunk_argument(p)
  _add_attention_arguments(p)
  p.add_argument("--layer-loop", choices=("unroll", "scan"), default=None, help="default scan")
  p.add_argument(
    "--rows",
    choices=("shared", "repeated"),
    default="shared",
    help="shared: the document's cache held once for every question, each question and answer "
    "in full precision beside it (kvjax.share_context); repeated: a copy of the cache per "
    "question, decoded by the method as in generate (kvjax.repeat_context)",
  )
  p.add_argument(
    "--feed-chunk",
    type=int,
    default=None,
    help="with --rows shared: question tokens fed per step (default 64; 0: one decode step per "
    "token); --rows repeated always feeds token by token",
  )
  p.add_argument(
    "--save",
    default=None,
    help="also save the compressed context to this directory, for --context (with --rows "
    "shared it has no room of its own: --context shares it again)",
  )
  p.add_argument(
    "--overwrite",
    action="store_true",
    help="with --save: replace a context saved in that directory before",
  )
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.set_defaults(run=run_ask, model=None)


def _check_ask_arguments(args) -> None:
  import pathlib

  _check_run_arguments(args)
  if args.feed_chunk is not None and args.feed_chunk < 0:
    raise ValueError(f"--feed-chunk={args.feed_chunk} must be >= 0 (0: token by token)")
  if args.feed_chunk is not None and args.rows == "repeated":
    # A repeated context's method would compress each fed chunk as a chunked prefill does,
    # so its rows are fed token by token, as generate decodes.
    raise ValueError(
      f"--feed-chunk={args.feed_chunk} needs --rows shared (--rows repeated feeds token by token)"
    )
  if args.context is not None:
    for flag, value in (("--save", args.save), ("--prefill-chunk", args.prefill_chunk)):
      if value is not None:
        raise ValueError(
          f"{flag} compresses or saves a document; --context {args.context} is one "
          "already compressed and saved"
        )
  if args.overwrite and args.save is None:
    raise ValueError("--overwrite replaces a context saved by --save DIR; give --save too")
  if args.save is not None:
    from kvjax.context_checkpoint import METADATA_FILE

    save = pathlib.Path(args.save)
    if save.exists() and not save.is_dir():
      raise ValueError(f"--save {args.save}: exists and is not a directory")
    if save.exists() and not args.overwrite:
      raise ValueError(
        f"--save {args.save}: the directory exists; pass --overwrite to replace a context "
        "saved there, or choose a new directory"
      )
    if save.exists() and not (save / METADATA_FILE).is_file():
      raise ValueError(
        f"--save {args.save}: the directory holds no saved context ({METADATA_FILE}), so "
        "--overwrite does not replace it; choose a new directory"
      )
    if not save.exists():
      # Only checked: save_context makes the folders, so a run refused later (by checks that
      # need the model) leaves none behind.
      _writable_directory("--save", str(save), create=False)


def _saved_ask_record(args) -> dict:
  """The settings `kvjax ask --save` recorded with the context in `args.context`; an explicit
  --model, --method or --layer-loop must be the saved one."""
  from kvjax.context_checkpoint import read_context_record

  try:
    saved = read_context_record(args.context)["metadata"]
  except (FileNotFoundError, ValueError) as error:
    raise ValueError(f"--context {args.context}: {error}") from None
  missing = [key for key in ASK_RECORD_KEYS if key not in saved]
  if missing:
    raise ValueError(
      f"--context {args.context}: its metadata lacks {', '.join(missing)}: it was not "
      "saved by `kvjax ask --save` (restore it in Python: kvjax.restore_context with a "
      "kvjax.context_template)"
    )
  if saved.get("prompt_format") != ASK_PROMPT_FORMAT:
    raise ValueError(
      f"--context {args.context}: saved by an earlier `kvjax ask`, whose document ids end with "
      "the blank line now sent with each question; compress the document again (--document)"
    )
  for flag, given, key, same in (
    ("--model", args.model, "model", _same_model),
    ("--method", args.method, "method", _same_method),
    ("--layer-loop", args.layer_loop, "layer_loop", str.__eq__),
  ):
    if given is not None and not same(given, saved[key]):
      raise ValueError(
        f"{flag}={given} differs from the saved context's {saved[key]!r} "
        f"(--context {args.context}); leave {flag} out"
      )
  return saved


def _recorded_model(name: str) -> str:
  """A model as `ask --save` records it: a file or directory by its absolute path (the context
  may be asked from another directory), a short name as given."""
  import pathlib

  path = pathlib.Path(name)
  return str(path.resolve()) if path.exists() else name


def _recorded_method(spec: str) -> str:
  """A method spec as `ask --save` records it: a razor `profile=` path made absolute."""
  import pathlib
  import re

  return re.sub(
    r"(profile=)([^,+]+)",
    lambda match: match[1] + str(pathlib.Path(match[2]).resolve()),
    spec,
  )


def _resolved_model(name: str):
  """The model file or directory `name` (a short name or a path) is here, or None."""
  from models.registry import resolve_model_path

  try:
    return resolve_model_path(name).resolve()
  except ValueError:
    return None


def _same_model(given: str, saved: str) -> bool:
  """Both names (or paths) resolve to the same model file or directory."""
  given_path, saved_path = _resolved_model(given), _resolved_model(saved)
  if given_path is None or saved_path is None:
    return given == saved
  return given_path == saved_path


def _same_method(given: str, saved: str) -> bool:
  """Both specs describe the same method (a razor profile by its heads, not its path)."""
  from kvjax.method_spec import parse_method_spec

  try:
    return parse_method_spec(given) == parse_method_spec(saved)
  except ValueError:
    return given == saved


def run_ask(args) -> int:
  import time

  import jax
  import jax.numpy as jnp

  from kvjax.cache_protocol import model_cache_shapes
  from kvjax.compressed_context import (
    check_shareable,
    compress_context,
    context_template,
    continue_context,
    repeat_context,
    share_context,
  )
  from kvjax.context_checkpoint import restore_context, save_context
  from kvjax.eval.text_corpus import load_text
  from models.loading import load_model

  _check_ask_arguments(args)
  saved = _saved_ask_record(args) if args.context is not None else None
  if saved is None:
    model_name = args.model or DEFAULT_MODEL
    method_spec = args.method or ASK_DEFAULT_METHOD
    layer_loop = args.layer_loop or "scan"
  else:
    model_name, method_spec, layer_loop = saved["model"], saved["method"], saved["layer_loop"]
  cache_method = _method_of_flag(
    method_spec, args, "--method" if saved is None else f"--context {args.context}: its method"
  )
  feed_chunk = 64 if args.feed_chunk is None else args.feed_chunk
  _check_profile_model(cache_method, model_name)
  document = "" if saved is not None else load_text(args.document, name="--document")
  loaded = load_model(model_name, layer_loop=layer_loop)
  # The questions' ids do not depend on the document: the chat template is cut where they begin.
  document_ids, question_ids = loaded.tokenizer.chat_document_and_questions(document, args.question)
  room = max(map(len, question_ids)) + args.max_new_tokens
  shared = args.rows == "shared"
  document_tokens = len(document_ids) if saved is None else saved["document_tokens"]
  positions = loaded.config.max_position_embeddings
  if document_tokens + room > positions:
    source = "--document" if saved is None else f"--context {args.context}"
    raise ValueError(
      f"{source} ({document_tokens} tokens) + the longest question "
      f"({room - args.max_new_tokens} tokens) + --max-new-tokens ({args.max_new_tokens}) exceed "
      f"the model's {positions} positions"
    )
  if shared:
    try:
      check_shareable(
        model_cache_shapes(
          cache_method,
          loaded.decoder.cache_shape,
          batch=1,
          prompt_len=document_tokens,
          max_new_tokens=0,
          dtype=jnp.dtype(ASK_CACHE_DTYPE),
        )
      )
    except ValueError as error:
      raise ValueError(f"--rows shared: {error}; use --rows repeated") from None
  # A shared context needs no room of its own: each question gets its own cache beside it.
  context_room = (0 if shared else room) if saved is None else saved["room"]
  start = time.perf_counter()
  if saved is None:
    context = jax.block_until_ready(
      compress_context(
        loaded.decoder,
        loaded.params,
        [document_ids],
        cache_method=cache_method,
        room=context_room,
        prefill_chunk=args.prefill_chunk,
        cache_dtype=jnp.dtype(ASK_CACHE_DTYPE),
      )
    )
  else:
    template = context_template(
      loaded.decoder,
      loaded.params,
      batch=1,
      prompt_len=document_tokens,
      cache_method=cache_method,
      room=context_room,
      cache_dtype=jnp.dtype(saved["cache_dtype"]),
    )
    try:
      context = jax.block_until_ready(restore_context(args.context, template))
    except (ValueError, OSError) as error:
      raise ValueError(f"--context {args.context}: {error}") from None
  context_s = time.perf_counter() - start
  if args.save:
    metadata = dict(
      model=_recorded_model(model_name),
      method=_recorded_method(method_spec),
      document_tokens=document_tokens,
      room=context_room,
      layer_loop=layer_loop,
      cache_dtype=ASK_CACHE_DTYPE,
      prompt_format=ASK_PROMPT_FORMAT,
    )
    save_context(args.save, context, metadata=metadata, overwrite=args.overwrite)
  start = time.perf_counter()
  if shared:
    rows = share_context(
      loaded.decoder,
      context,
      len(question_ids),
      room=room,
      implementation=args.implementation,
      kernel_settings=kernel_settings_from_json(args.kernel_settings),
    )
  else:
    rows = repeat_context(context, len(question_ids))
  try:
    tokens, counts = continue_context(
      loaded.decoder,
      loaded.params,
      rows,
      question_ids,
      max_new_tokens=args.max_new_tokens,
      stop_token_ids=loaded.stop_token_ids,
      feed_chunk=feed_chunk if shared and feed_chunk else None,
    )
  except ValueError as error:
    if saved is None or shared:
      raise
    # A context saved with room for its own questions may have too little for these.
    raise ValueError(
      f"--context {args.context} --rows repeated: {error}; --rows shared gives every "
      "question room of its own"
    ) from None
  answer_s = time.perf_counter() - start
  answers = [loaded.tokenizer.decode(row[:n]) for row, n in zip(tokens, counts)]
  record = dict(
    model=model_name,
    method=method_spec,
    document_tokens=document_tokens,
    rows=args.rows,
    context_bytes=context.cache_bytes,
    cache_bytes=rows.cache_bytes,
    compress_s=context_s if saved is None else None,
    restore_s=context_s if saved is not None else None,
    answer_s=answer_s,
    questions=args.question,
    answers=answers,
    answer_tokens=[int(n) for n in counts],
  )
  if args.json:
    print(json.dumps(record))
    return 0
  for question, answer in zip(args.question, answers):
    print(f"Q: {question}\nA: {answer}\n")
  how = f"compressed in {context_s:.1f} s" if saved is None else f"restored in {context_s:.1f} s"
  whose = "1 question's" if len(answers) == 1 else f"{len(answers)} questions'"
  print(
    f"[document {document_tokens} tokens, cache {context.cache_bytes / 2**20:.2f} MiB "
    f"({method_spec}); {whose} caches {rows.cache_bytes / 2**20:.2f} MiB "
    f"({args.rows}); {how}, answered in one batch in {answer_s:.1f} s, compile included]",
    file=sys.stderr,
  )
  return 0


# One or two of each family, picked so the default run takes a few minutes on a 2-core CPU
# (each method is about 35-60 s there, mostly the 256 teacher-forced decode steps).
DEFAULT_COMPARE_METHODS = (
  "full",
  "kivi:bits=2",
  "gear:bits=2",
  "streaming:ratio=0.25",
  "snapkv:ratio=0.25",
  "snapkv:ratio=0.25+kivi:bits=4",
  "h2o_decode:ratio=0.25",
)


def _add_compare(subparsers):
  p = subparsers.add_parser(
    "compare", help="measure cache methods against the full cache (memory, quality, speed)"
  )
  _add_model_argument(p)
  p.add_argument(
    "--methods",
    nargs="+",
    action="extend",  # a repeated --methods adds to the list
    default=None,
    help="method specs, e.g. full kivi:bits=2 snapkv:budget=256 pyramidkv:budget=256+kivi:bits=4 "
    f"(default: {' '.join(DEFAULT_COMPARE_METHODS)}; those not registered are skipped)",
  )
  p.add_argument(
    "--tasks",
    default="ppl,kl,passkey,passkey_agnostic,speed",
    help="comma list of ppl,kl,passkey,passkey_agnostic,speed",
  )
  p.add_argument("--context-len", type=int, default=1024)
  p.add_argument("--continuation-len", type=int, default=256)
  p.add_argument(
    "--needle-lengths",
    type=int,
    nargs="+",
    default=None,
    help="prompt lengths to ask the needle at, e.g. 1024 2048 4096 (default: --context-len); "
    "the byte columns stay those of --context-len",
  )
  p.add_argument("--text", default=None, help="UTF-8 text file (default: CPython pydoc topics)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--num-samples",
    type=int,
    default=1,
    help="text windows for ppl/kl, and needles per depth (default 1: a quick look; use 4+)",
  )
  p.add_argument("--cache-dtype", default="bfloat16", help="bfloat16|float16|float32")
  _add_prefill_chunk_argument(p)
  _add_attention_arguments(p)
  p.add_argument(
    "--layer-loop",
    choices=("scan", "unroll"),
    default="scan",
    help="scan (default): one compiled body for look-alike layers, so each method compiles in "
    "seconds; unroll: every layer compiled apart (minutes for quantized caches, faster decode "
    "on CPU)",
  )
  p.add_argument("--out", default="results/compare", help="output directory")
  p.set_defaults(run=run_compare)


def compare_header(config, *, model: str, layer_loop: str, machine: str, records) -> str:
  """The line results.md starts with: the settings the run's tasks used (a speed run takes one
  window, a needle-only run feeds no continuation), and the machine."""
  # Speed is timed on the continuation batch: prefill s covers all its rows, tok/s sums them.
  batches = {r["speed_batch"] for r in records if r.get("speed_batch")}
  tasks = set(config.tasks)
  continuation = (
    f"continuation {config.continuation_len}, " if tasks & {"ppl", "kl", "speed"} else ""
  )
  sampled = tasks & {"ppl", "kl", "passkey", "passkey_agnostic"}
  samples = (
    f"{config.num_samples} sample{'s' if config.num_samples > 1 else ''}, " if sampled else ""
  )
  needle_lengths = (
    "needle at " + "/".join(str(n) for n in config.needle_lengths) + " tokens, "
    if config.needle_lengths
    else ""
  )
  return (
    f"model {model}, context {config.context_len} tokens, {continuation}{samples}{needle_lengths}"
    f"cache dtype {config.cache_dtype}, seed {config.seed}, layer loop {layer_loop}"
    + (f", prefill in chunks of {config.prefill_chunk}" if config.prefill_chunk else "")
    + (f", speed on a batch of {batches.pop()}" if len(batches) == 1 else "")
    + f"; {machine}"
  )


def run_compare(args) -> int:
  import pathlib
  import time

  from kvjax.eval.compare import CompareConfig, compare_methods
  from kvjax.eval.machine import machine_description
  from kvjax.eval.report import format_table, write_results
  from kvjax.eval.text_corpus import load_text
  from kvjax.method_registry import METHODS
  from kvjax.method_spec import parse_method_spec

  _check_run_arguments(args)
  start = time.perf_counter()
  config = CompareConfig(
    tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()),
    context_len=args.context_len,
    continuation_len=args.continuation_len,
    num_samples=args.num_samples,
    seed=args.seed,
    cache_dtype=args.cache_dtype,
    implementation=args.implementation,
    kernel_settings=kernel_settings_from_json(args.kernel_settings),
    prefill_chunk=args.prefill_chunk,
    needle_lengths=tuple(args.needle_lengths or ()),
  )
  if args.methods is None:
    specs = [
      s for s in DEFAULT_COMPARE_METHODS if all(p.split(":")[0] in METHODS for p in s.split("+"))
    ]
  else:
    specs = args.methods
  for spec in specs:  # every spec is checked before the model loads
    method = parse_method_spec(
      spec, implementation=args.implementation, kernel_settings=config.kernel_settings
    )
    _check_profile_model(method, args.model)
  text = load_text(args.text)
  # Checked before the model loads; made by the first results written (write_results), so a
  # run refused by the checks that need the model (text too short, ids past its vocabulary)
  # leaves no folder.
  _writable_directory("--out", args.out, create=False)
  from models.loading import load_model

  loaded = load_model(args.model, layer_loop=args.layer_loop)
  out = pathlib.Path(args.out)
  machine = machine_description()

  def header_after(seconds, records):
    return (
      compare_header(
        config, model=args.model, layer_loop=args.layer_loop, machine=machine, records=records
      )
      + f"; wall {seconds:.0f}s"
    )

  records = compare_methods(
    loaded.decoder,
    loaded.params,
    loaded.tokenizer,
    specs,
    text=text,
    config=config,
    pad_token_id=loaded.stop_token_ids[0] if loaded.stop_token_ids else 0,
    max_context=loaded.config.max_position_embeddings,
    on_record=lambda so_far: write_results(
      so_far, out, header=header_after(time.perf_counter() - start, so_far) + " (partial)"
    ),
  )
  header = header_after(time.perf_counter() - start, records)
  write_results(records, out, header=header)
  print(header)
  print(format_table(records))
  print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'quality_vs_memory.png'}")
  return 0


def _add_razor_profile(subparsers):
  p = subparsers.add_parser(
    "razor-profile",
    help="detect a model's retrieval heads for RazorAttention (data-free) and save the profile",
  )
  _add_model_argument(p)
  p.add_argument(
    "--output", required=True, help="profile JSON to write (use with razor:profile=PATH)"
  )
  p.add_argument("--block-len", type=int, default=2500, help="random tokens per repeat")
  p.add_argument("--repeats", type=int, default=4)
  p.add_argument("--induction-ratio", type=float, default=0.14)
  p.add_argument("--echo-ratio", type=float, default=0.01)
  p.add_argument("--seed", type=int, default=0)
  p.set_defaults(run=run_razor_profile)


def _check_json_output(output: str, whose: str) -> None:
  """--output names a JSON file to write, in a folder that exists or can be made."""
  import pathlib

  if pathlib.Path(output).is_dir():
    raise ValueError(f"--output {output}: is a directory; name {whose} JSON file")
  _writable_directory("--output", str(pathlib.Path(output).parent))


def run_razor_profile(args) -> int:
  from kvjax.retrieval_heads import compute_head_profile
  from models.loading import load_model

  _check_razor_profile_arguments(args)
  _check_json_output(args.output, "the profile's")
  loaded = load_model(args.model)
  config = loaded.config
  block_len = args.block_len
  # Repeats of one block must fit in the model's context (BOS included).
  if args.repeats * block_len + 1 > config.max_position_embeddings:
    block_len = (config.max_position_embeddings - 1) // args.repeats
    if block_len < 2:
      raise ValueError(
        f"--repeats={args.repeats} leaves blocks of fewer than 2 tokens in the model's "
        f"{config.max_position_embeddings} positions"
      )
    print(f"block length lowered to {block_len} to fit the model's context", file=sys.stderr)
  profile = compute_head_profile(
    loaded.decoder,
    loaded.params,
    vocab_size=config.vocab_size,
    block_len=block_len,
    repeats=args.repeats,
    seed=args.seed,
    induction_ratio=args.induction_ratio,
    echo_ratio=args.echo_ratio,
    bos_token_id=config.bos_token_id,
    max_positions=config.max_position_embeddings,
    model_name=_recorded_model(args.model),
  )
  profile.save(args.output)
  for layer, head in profile.retrieval_heads:
    print(
      f"layer {layer:3d} kv head {head}: induction {profile.induction_scores[layer][head]:.3f} "
      f"echo {profile.echo_scores[layer][head]:.3f}"
    )
  print(f"{len(profile.retrieval_heads)} retrieval heads; wrote {args.output}")
  return 0


def _add_duo_train(subparsers):
  p = subparsers.add_parser(
    "duo-train",
    help="train a model's DuoAttention gates on synthetic pass keys and save them",
  )
  _add_model_argument(p)
  p.add_argument("--output", required=True, help="gate JSON to write (use with duo:profile=PATH)")
  p.add_argument("--context-len", type=int, default=1024, help="tokens per training prompt")
  p.add_argument("--samples", type=int, default=16, help="training prompts (used in turn)")
  p.add_argument("--passkeys", type=int, default=10, help="pass keys per prompt")
  p.add_argument("--passkey-words", type=int, default=32, help="random words per pass key")
  p.add_argument(
    "--steps", type=int, default=2000, help="optimizer steps (the authors' 2000; fewer on a CPU)"
  )
  p.add_argument("--sinks", type=int, default=64, help="tokens a streaming head keeps first")
  p.add_argument("--recent", type=int, default=256, help="recent tokens a streaming head keeps")
  p.add_argument("--learning-rate", type=float, default=0.02)
  p.add_argument(
    "--lr-schedule",
    default="warmup_decay",
    help="warmup_decay (the authors': up over the first fifth of the steps, down over the last, "
    "never under a tenth) or constant",
  )
  p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's (the authors': 0)")
  p.add_argument("--l1-weight", type=float, default=0.05, help="weight of mean |gate|")
  p.add_argument("--batch", type=int, default=1, help="prompts per step")
  p.add_argument("--text", default=None, help="UTF-8 text file (default: CPython pydoc topics)")
  p.add_argument("--seed", type=int, default=0)
  p.set_defaults(run=run_duo_train)


def run_duo_train(args) -> int:
  from kvjax.duo_gate_profile import DuoGateProfile
  from kvjax.duo_gate_training import GateTraining, passkey_training_samples, train_duo_gates
  from kvjax.eval.text_corpus import load_text
  from models.loading import load_model

  for flag, value, minimum in (
    ("--context-len", args.context_len, 2),
    ("--samples", args.samples, 1),
    ("--passkeys", args.passkeys, 1),
    ("--passkey-words", args.passkey_words, 1),
  ):
    if value < minimum:
      raise ValueError(f"{flag}={value} must be >= {minimum}")
  try:
    settings = GateTraining(
      sinks=args.sinks,
      recent=args.recent,
      steps=args.steps,
      learning_rate=args.learning_rate,
      l1_weight=args.l1_weight,
      batch=args.batch,
      weight_decay=args.weight_decay,
      lr_schedule=args.lr_schedule,
    )
  except ValueError as error:  # name the flag, not the field ("l1_weight=..." -> "--l1-weight=...")
    field, rest = str(error).split("=", 1)
    raise ValueError(f"--{field.replace('_', '-')}={rest}") from None
  if args.context_len <= args.sinks + args.recent:
    raise ValueError(
      f"--context-len={args.context_len} must exceed --sinks + --recent = "
      f"{args.sinks + args.recent}, or streaming heads see every token"
    )
  if args.batch > args.samples:
    raise ValueError(f"--batch={args.batch} must be <= --samples={args.samples}")
  _check_seed(args)
  _check_json_output(args.output, "the gates'")
  text = load_text(args.text)
  # Every layer's gate cache looks alike: scanned, the gradient's program is compiled once, not
  # once per layer.
  loaded = load_model(args.model, layer_loop="scan")
  if args.context_len > loaded.config.max_position_embeddings:
    raise ValueError(
      f"--context-len={args.context_len} exceeds the model's context of "
      f"{loaded.config.max_position_embeddings}"
    )
  samples = passkey_training_samples(
    loaded.tokenizer,
    context_len=args.context_len,
    num_samples=args.samples,
    passkeys=args.passkeys,
    passkey_words=args.passkey_words,
    seed=args.seed,
    text=text,
  )
  gates, losses = train_duo_gates(loaded.decoder, loaded.params, samples, settings, progress=True)
  record = dict(
    settings.as_record(),
    context_len=args.context_len,
    samples=args.samples,
    passkeys=args.passkeys,
    passkey_words=args.passkey_words,
    seed=args.seed,
    text=args.text,
    first_loss=float(losses[0]),
    last_loss=float(losses[-1]),
  )
  profile = DuoGateProfile.from_gates(
    loaded.decoder.cache_shape, gates, training=record, model_name=_recorded_model(args.model)
  )
  profile.save(args.output)
  for layer, row in enumerate(profile.gates):
    print(f"layer {layer:3d} gates " + " ".join(f"{g:.3f}" for g in row))
  print(
    f"loss {losses[0]:.4g} -> {losses[-1]:.4g} over {settings.steps} steps; wrote {args.output}"
  )
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="kvjax", description=__doc__)
  subparsers = parser.add_subparsers(dest="command", required=True)
  _add_generate(subparsers)
  _add_ask(subparsers)
  _add_compare(subparsers)
  _add_razor_profile(subparsers)
  _add_duo_train(subparsers)
  return parser


def main(argv=None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    return args.run(args)
  except (ValueError, OSError) as error:  # a file the command reads or writes, too
    parser.exit(2, f"kvjax {args.command}: error: {error}\n")


if __name__ == "__main__":
  sys.exit(main())
