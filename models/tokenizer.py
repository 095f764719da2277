"""Text to token ids and back, and chat prompts, from a Hugging Face directory or GGUF metadata.

A GGUF file carries no tokenizer.json: it stores the vocabulary, the merges, token types and the
name of a pre-tokenizer (`tokenizer.ggml.pre`). `Tokenizer.from_gguf` rebuilds the byte-level BPE
tokenizer from those, splitting text the way llama.cpp does for that pre-tokenizer name.
"""

import dataclasses
import datetime
import json
import pathlib
from collections.abc import Callable

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors

from models.checkpoint_errors import CheckpointError
from models.gguf_checkpoint import open_gguf
from models.hf_checkpoint import read_json_file

# Tokens that end a turn or a document in common formats; any the vocabulary has joins `stop_ids`,
# since chat models often end a reply with one that is not their configured eos.
END_TOKENS = (
  "<|im_end|>",
  "<|eot_id|>",
  "<|eom_id|>",
  "<|end_of_text|>",
  "<|endoftext|>",
  "<end_of_turn>",
  "<|end|>",
)

# What transformers' `clean_up_tokenization` replaces, in its order.
_SPACES_CLEANED_UP = (
  (" .", "."),
  (" ?", "?"),
  (" !", "!"),
  (" ,", ","),
  (" ' ", "'"),
  (" n't", "n't"),
  (" 'm", "'m"),
  (" 's", "'s"),
  (" 've", "'ve"),
  (" 're", "'re"),
)

SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL = 3
_USER_DEFINED = 4

# Llama-3's split pattern (llama.cpp's LLAMA3 pre-tokenizer): numbers in groups of up to three.
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
  # ByteLevel with use_regex applies GPT-2's pattern:
  #   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
  # llama.cpp splits every digit off first ("\p{N}"), then applies GPT-2's pattern to the rest.
  # That differs from GPT-2 alone where whitespace precedes a digit: "    1" becomes "    " + "1"
  # here, but "   " + " 1" under GPT-2's pattern.
  return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _llama3_split() -> pre_tokenizers.PreTokenizer:
  return pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )


@dataclasses.dataclass(frozen=True)
class GGUFPreTokenizer:
  """What llama.cpp does for one `tokenizer.ggml.pre` value: how it splits text, whether a word
  that is itself a vocabulary entry skips the merges (Llama 3's `ignore_merges`), and whether
  BOS is added when the file has no `tokenizer.ggml.add_bos_token`."""

  split: Callable[[], pre_tokenizers.PreTokenizer]
  ignore_merges: bool = False
  add_bos_by_default: bool = False


_LLAMA3 = GGUFPreTokenizer(_llama3_split, ignore_merges=True, add_bos_by_default=True)

# `tokenizer.ggml.pre` value -> what llama.cpp does for it (its names: GPT-2's is "gpt-2", which
# convert_hf_to_gguf.py writes; "llama3" and "llama-v3" are "llama-bpe"'s other names there).
GGUF_PRE_TOKENIZERS: dict[str, GGUFPreTokenizer] = {
  "gpt-2": GGUFPreTokenizer(_gpt2_split),
  "phi-2": GGUFPreTokenizer(_gpt2_split),
  "smollm": GGUFPreTokenizer(_digits_then_gpt2_split),
  "starcoder": GGUFPreTokenizer(_digits_then_gpt2_split),
  "refact": GGUFPreTokenizer(_digits_then_gpt2_split),
  "codeshell": GGUFPreTokenizer(_digits_then_gpt2_split),
  "llama-bpe": _LLAMA3,
  "llama3": _LLAMA3,
  "llama-v3": _LLAMA3,
}

# tokenizer_config.json classes whose transformers implementation rebuilds the post-processor
# from `add_bos_token` / `add_eos_token` (defaults: add BOS, not EOS), overriding tokenizer.json.
_BOS_EOS_FLAG_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizerFast")


class Tokenizer:
  """A `tokenizers.Tokenizer` with the special tokens and chat template of one checkpoint."""

  def __init__(
    self,
    backend: tokenizers.Tokenizer,
    *,
    source: pathlib.Path,
    special_tokens: dict[str, str | None],
    chat_template: str | None = None,
    extra_stop_ids: tuple[int, ...] = (),
    clean_up_spaces: bool = False,
  ):
    self._backend = backend
    self.clean_up_spaces = clean_up_spaces
    self.source = source
    self.special_tokens = {role: special_tokens.get(role) for role in SPECIAL_TOKEN_ROLES}
    self.chat_template = chat_template
    self._template = compile_chat_template(chat_template, source) if chat_template else None
    end_ids = {backend.token_to_id(token) for token in END_TOKENS}
    self._stop_ids = tuple(sorted(({self.eos_id} | end_ids | set(extra_stop_ids)) - {None}))

  @classmethod
  def from_hf_directory(cls, directory: str | pathlib.Path) -> "Tokenizer":
    """From tokenizer.json, with tokenizer_config.json, special_tokens_map.json,
    chat_template.jinja and generation_config.json where present."""
    directory = pathlib.Path(directory)
    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.is_file():
      raise CheckpointError(f"{tokenizer_path}: file not found (a tokenizer needs tokenizer.json)")
    try:
      backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    except Exception as error:  # the Rust bindings raise a bare Exception for malformed files
      raise CheckpointError(f"{tokenizer_path}: not a readable tokenizer.json: {error}") from error

    config_path = directory / "tokenizer_config.json"
    config = read_json_file(config_path) if config_path.is_file() else {}
    # Many older Llama / Mistral directories name bos and eos only in special_tokens_map.json.
    # transformers reads it only for a tokenizer_config.json without "added_tokens_decoder"
    # (saved before 4.34), and then its entries win; newer configs are read alone.
    map_path = directory / "special_tokens_map.json"
    legacy = "added_tokens_decoder" not in config and map_path.is_file()
    token_map = read_json_file(map_path) if legacy else {}
    special_tokens = {
      role: _token_content(token_map[role] if token_map.get(role) else config.get(role))
      for role in SPECIAL_TOKEN_ROLES
    }
    if config.get("tokenizer_class") in _BOS_EOS_FLAG_CLASSES:
      token_ids = {
        role: None if token is None else backend.token_to_id(token)
        for role, token in special_tokens.items()
      }
      backend.post_processor = _bos_eos_processor(
        special_tokens,
        token_ids,
        add_bos=config.get("add_bos_token", True),
        add_eos=config.get("add_eos_token", False),
        path=config_path,
      )

    template_path = directory / "chat_template.jinja"
    if template_path.is_file():
      chat_template = template_path.read_text(encoding="utf-8")
    else:
      chat_template = _default_template(config.get("chat_template"), config_path)

    generation_path = directory / "generation_config.json"
    generation = read_json_file(generation_path) if generation_path.is_file() else {}
    return cls(
      backend,
      source=directory,
      special_tokens=special_tokens,
      chat_template=chat_template,
      extra_stop_ids=_id_tuple(generation.get("eos_token_id")),
      # transformers' default since 4.45 (its decode reads this setting)
      clean_up_spaces=config.get("clean_up_tokenization_spaces", False) is True,
    )

  @classmethod
  def from_gguf(cls, path: str | pathlib.Path) -> "Tokenizer":
    """The byte-level BPE tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata."""
    gguf_file = open_gguf(path)
    path = gguf_file.path
    tokenizer_model = gguf_file.value("tokenizer.ggml.model")
    if tokenizer_model != "gpt2":
      raise CheckpointError(
        f"{path}: GGUF tokenizer model {tokenizer_model!r} is not supported; supported: gpt2 "
        "(byte-level BPE). Load the Hugging Face directory (tokenizer.json) instead"
      )
    pre = gguf_file.value("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
      raise CheckpointError(
        f"{path}: GGUF pre-tokenizer {pre!r} is not supported; "
        f"supported: {', '.join(GGUF_PRE_TOKENIZERS)}"
      )
    tokens = gguf_file.value("tokenizer.ggml.tokens")
    token_types = gguf_file.value("tokenizer.ggml.token_type", [])
    if token_types and len(token_types) != len(tokens):
      raise CheckpointError(
        f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
      )
    merges = []
    for merge in gguf_file.value("tokenizer.ggml.merges"):
      pair = tuple(merge.split(" "))
      if len(pair) != 2:
        raise CheckpointError(f"{path}: BPE merge {merge!r} is not two tokens separated by a space")
      merges.append(pair)

    vocab = {token: index for index, token in enumerate(tokens)}
    pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]
    try:
      bpe = tokenizers.models.BPE(
        vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre_tokenizer.ignore_merges
      )
    except Exception as error:  # the Rust bindings raise a bare Exception (a merge's unknown token)
      raise CheckpointError(f"{path}: unreadable BPE vocabulary or merges: {error}") from error
    backend = tokenizers.Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizer.split()
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are matched whole and dropped by skip_special_tokens;
    # user-defined ones are matched whole but kept, as llama.cpp does.
    backend.add_special_tokens(
      [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _CONTROL
      ]
    )
    backend.add_tokens(
      [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _USER_DEFINED
      ]
    )

    token_ids = {
      role: gguf_file.value(f"tokenizer.ggml.{key}_token_id", None)
      for role, key in (
        ("bos_token", "bos"),
        ("eos_token", "eos"),
        ("unk_token", "unknown"),
        ("pad_token", "padding"),
      )
    }
    special_tokens = {
      role: tokens[index] if index is not None and 0 <= index < len(tokens) else None
      for role, index in token_ids.items()
    }
    add_bos = gguf_file.value("tokenizer.ggml.add_bos_token", pre_tokenizer.add_bos_by_default)
    add_eos = gguf_file.value("tokenizer.ggml.add_eos_token", False)
    if add_bos or add_eos:
      backend.post_processor = _bos_eos_processor(
        special_tokens, token_ids, add_bos=add_bos, add_eos=add_eos, path=path
      )
    # End-of-turn and end-of-message ids end a generation in llama.cpp too (Llama 3.1's eom).
    turn_ends = (gguf_file.value(f"tokenizer.ggml.{key}_token_id", None) for key in ("eot", "eom"))
    return cls(
      backend,
      source=path,
      special_tokens=special_tokens,
      chat_template=gguf_file.value("tokenizer.chat_template", None),
      extra_stop_ids=tuple(i for i in turn_ends if i is not None and 0 <= i < len(tokens)),
    )

  @property
  def bos_id(self) -> int | None:
    return self._token_id("bos_token")

  @property
  def eos_id(self) -> int | None:
    return self._token_id("eos_token")

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """eos plus every end-of-turn / end-of-text token the vocabulary has, sorted."""
    return self._stop_ids

  @property
  def vocab_size(self) -> int:
    return self._backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`; special tokens written in the text (<|im_start|>) map to their ids."""
    return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    """The text of `ids`; where the directory's tokenizer_config.json sets
    `clean_up_tokenization_spaces`, with the spaces before punctuation and contractions removed,
    as transformers' decode removes them (llama.cpp's own clean-up for GGUF files is not
    reproduced: for SmolLM2's `smollm` it has none)."""
    text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    if not self.clean_up_spaces:
      return text
    for spaced, joined in _SPACES_CLEANED_UP:
      text = text.replace(spaced, joined)
    return text

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}]), rendered as transformers
    renders chat templates (sandboxed Jinja, trim_blocks, lstrip_blocks)."""
    if self._template is None:
      raise CheckpointError(f"{self.source}: this tokenizer has no chat template")
    try:
      # Roles without a token stay undefined, as transformers leaves them: `{{ bos_token }}`
      # renders empty instead of the text "None". `tools` and `documents` are None, as
      # transformers passes them when none are given (a template may test `tools is not none`).
      defined = {role: token for role, token in self.special_tokens.items() if token is not None}
      return self._template.render(
        messages=messages,
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **defined,
      )
    except jinja2.TemplateError as error:
      raise ValueError(
        f"the chat template of {self.source} rejected these messages: {error}"
      ) from error

  def chat_document_and_questions(
    self, document: str, questions: list[str], separator: str = "\n\n"
  ) -> tuple[list[int], list[list[int]]]:
    """A user turn `document + separator + question` for each question, cut where the document
    ends: (the document's ids, shared by every question and compressed once; each question's
    ids, separator first, with the rest of the template, generation prompt included).

    The cut lies before the separator because byte-level BPE splits whitespace by what follows
    it: "\n\n" encoded alone is one token, but two before a word. Document ids + question ids
    are checked to be exactly the ids of the whole turn, the tokens a model asked the question
    in one prompt would see; trailing whitespace of the document is dropped for that reason.
    Question ids do not depend on the document: pass "" for those of a saved context.
    """
    marker = "\x00question\x00"  # text no document or template holds
    if marker in document:
      raise ValueError("document holds a NUL-delimited marker kvjax uses to split the template")
    document = document.rstrip()
    chat = self.apply_chat_template([{"role": "user", "content": f"{document}{marker}"}])
    if chat.count(marker) != 1:
      raise ValueError(
        f"the chat template of {self.source} renders a user turn's content "
        f"{chat.count(marker)} times, not once: the document cannot be cut out of it"
      )
    head, tail = chat.split(marker)
    document_ids = self.encode(head)
    question_ids = [self.encode(separator + question + tail) for question in questions]
    # An empty document (the questions of a context restored from disk) has no end to check:
    # the questions' ids never depend on it.
    for question, ids in zip(questions if document else (), question_ids, strict=False):
      whole = self.encode(head + separator + question + tail)
      if document_ids + ids != whole:
        raise ValueError(
          f"question {question!r}: the tokenizer of {self.source} merges tokens across the end "
          "of the document, so its ids cannot be shared by every question; end the document "
          "with a sentence's punctuation"
        )
    return document_ids, question_ids

  def _token_id(self, role: str) -> int | None:
    token = self.special_tokens[role]
    return None if token is None else self._backend.token_to_id(token)


def compile_chat_template(template: str, source: pathlib.Path) -> jinja2.Template:
  """A chat template compiled in a sandbox, with the helpers Hugging Face templates call."""
  environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
  )
  # Templates come from model files, i.e. untrusted input: hence the sandbox. Jinja's own tojson
  # escapes HTML characters, which would change prompts, so it is replaced by plain json.dumps.
  environment.filters["tojson"] = _tojson
  environment.globals["raise_exception"] = _raise_exception
  environment.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
  try:
    return environment.from_string(template)
  except jinja2.TemplateError as error:
    raise CheckpointError(f"{source}: the chat template does not compile: {error}") from error


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  return json.dumps(
    value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def _raise_exception(message: str):
  raise jinja2.TemplateError(message)


def _token_content(token) -> str | None:
  """A special token from tokenizer_config.json: a string, or an AddedToken dict with "content"."""
  return token.get("content") if isinstance(token, dict) else token


def _default_template(chat_template, config_path: pathlib.Path) -> str | None:
  """tokenizer_config.json's chat template: a string, or a list of named ones (use "default")."""
  if chat_template is None or isinstance(chat_template, str):
    return chat_template
  named = {entry.get("name"): entry.get("template") for entry in chat_template}
  if "default" not in named:
    raise CheckpointError(
      f"{config_path}: chat_template lists templates {sorted(map(str, named))} but none named "
      "'default'"
    )
  return named["default"]


def _bos_eos_processor(
  special_tokens: dict, token_ids: dict, *, add_bos: bool, add_eos: bool, path: pathlib.Path
) -> processors.TemplateProcessing:
  """Adds BOS and/or EOS around the text when encoding with add_special_tokens=True."""
  roles = [role for role, wanted in (("bos_token", add_bos), ("eos_token", add_eos)) if wanted]
  for role in roles:
    if special_tokens[role] is None or token_ids[role] is None:
      raise CheckpointError(f"{path}: asks to add the {role} but names no {role} in the vocabulary")
  pieces = (["bos_token"] if add_bos else []) + ["$A"] + (["eos_token"] if add_eos else [])
  return processors.TemplateProcessing(
    single=" ".join(piece if piece == "$A" else special_tokens[piece] for piece in pieces),
    special_tokens=[(special_tokens[role], token_ids[role]) for role in roles],
  )


def _id_tuple(value) -> tuple[int, ...]:
  """An eos_token_id entry (absent, one id, or a list of ids) as a tuple."""
  if value is None:
    return ()
  return tuple(value) if isinstance(value, list) else (value,)
