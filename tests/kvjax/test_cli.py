import dataclasses
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kvjax.cli import main
from kvjax.method_spec import parse_method_spec

RAZOR_PROFILE = str(
  pathlib.Path(__file__).parents[2] / "benchmarks" / "profiles" / "smollm2-135m.razor.json"
)


def test_generate_json_on_the_embedded_model(capsys):
  assert main(["generate", "--prompt", "What is 2+2?", "--max-new-tokens", "4", "--json"]) == 0
  record = json.loads(capsys.readouterr().out)
  expected = {
    "prompt_ids",
    "output_ids",
    "text",
    "prefill_s",
    "decode_s",
    "decode_tokens_per_s",
    "compile_s",
    "model",
  }
  assert expected <= set(record)
  assert record["model"] == "smollm2-135m" and 1 <= len(record["output_ids"]) <= 4
  assert record["prompt_ids"][:3] == [1, 9690, 198]  # "<|im_start|>system\n": the chat template
  assert record["prefill_s"] > 0 and record["compile_s"] > 0


@pytest.mark.parametrize(
  "argv, message",
  [
    (["generate", "--prompt", "x", "--method", "kivi:bits=3"], "bits=3"),
    (["generate", "--prompt", "x", "--top-k", "5"], "need --temperature"),
    (["compare", "--methods", "full", "warp:x=1"], "unknown cache method 'warp'"),
    (["compare", "--tasks", "ppl,bleu"], "allowed: ppl,kl"),
    (["compare", "--text", "/nonexistent/file.txt", "--methods", "full"], "cannot read"),
    (["compare", "--layer-loop", "while"], "invalid choice: 'while'"),
    (["compare", "--methods", "full", "--prefill-chunk", "0"], "--prefill-chunk=0 must be"),
    (
      ["ask", "--document", "/nonexistent/doc.txt", "--question", "q"],
      "--document /nonexistent/doc.txt: cannot read as UTF-8 text",
    ),
    (["ask", "--document", "/nonexistent/doc.txt"], "required: --question"),
    (["ask", "--question", "q"], "one of the arguments --document --context is required"),
    (["ask", "--document", "x", "--context", "y", "--question", "q"], "not allowed with"),
    (
      ["ask", "--context", "/nonexistent/ctx", "--question", "q"],
      "--context /nonexistent/ctx: directory='/nonexistent/ctx' holds no saved context",
    ),
    (
      ["ask", "--context", "/nonexistent/ctx", "--question", "q", "--save", "z"],
      "--save compresses or saves a document; --context /nonexistent/ctx is one already",
    ),
    (["ask", "--document", "x", "--question", "q", "--max-new-tokens", "0"], "must be >= 1"),
    (["ask", "--document", "x", "--question", "q", "--feed-chunk", "-1"], "--feed-chunk=-1"),
    (
      ["ask", "--document", "x", "--question", "q", "--rows", "repeated", "--feed-chunk", "8"],
      "--feed-chunk=8 needs --rows shared",
    ),
    (
      ["compare", "--methods", "full", "h2o:budget=32,window=4", "--prefill-chunk", "16"],
      "cache method 'h2o' cannot prefill in chunks",
    ),
  ],
)
def test_bad_input_exits_with_a_clear_message(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  assert exit_info.value.code == 2  # argparse's code for bad usage, whichever check refused
  assert message in capsys.readouterr().err


@pytest.mark.parametrize(
  "argv, message",
  [
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens=0 must be >= 1"),
    (["generate", "--prompt", "x", "--prefill-chunk", "0"], "--prefill-chunk=0 must be >= 1"),
    (["generate", "--prompt", "x", "--seed", str(2**64)], "--seed=18446744073709551616 must be"),
    # numpy's generators (compare's text windows, the razor probe) take no negative seed
    (["compare", "--seed", "-1"], "--seed=-1 must be in [0, 2**63 - 1]"),
    (["generate", "--prompt", "x", "--seed", str(-(2**63) - 1)], "must be in [-2**63, 2**63 - 1]"),
    (["razor-profile", "--output", "p.json", "--seed", "-1"], "--seed=-1 must be in [0,"),
    (["razor-profile", "--output", "p.json", "--repeats", "1"], "--repeats=1 must be >= 2"),
    (["razor-profile", "--output", "p.json", "--block-len", "0"], "--block-len=0 must be >= 2"),
    (["razor-profile", "--output", "p.json", "--induction-ratio", "2"], "must be in [0, 1]"),
    (["duo-train", "--output", "g.json", "--steps", "0"], "--steps=0 must be an int >= 1"),
    (["duo-train", "--output", "g.json", "--context-len", "300"], "--context-len=300 must exceed"),
    (["duo-train", "--output", "g.json", "--passkeys", "0"], "--passkeys=0 must be >= 1"),
    (["duo-train", "--output", "g.json", "--l1-weight", "-1"], "--l1-weight=-1.0 must be a"),
    (["duo-train", "--output", "g.json", "--learning-rate", "inf"], "--learning-rate=inf must"),
    (["duo-train", "--output", "g.json", "--lr-schedule", "cosine"], "allowed: warmup_decay,"),
    (["duo-train", "--output", "g.json", "--batch", "20"], "--batch=20 must be <= --samples=16"),
    (["duo-train", "--output", "g.json", "--seed", "-1"], "--seed=-1 must be in [0,"),
    (["compare", "--implementation", "fast"], "--implementation: implementation='fast'"),
    # found by a review: these named the setting (temperature=, top_k=) or no flag at all
    (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature=-1.0 must be 0"),
    (["generate", "--prompt", "x", "--temperature", "0", "--top-k", "5"], "need --temperature > 0"),
    (["generate", "--prompt", "x", "--temperature", "1", "--top-k", "0"], "--top-k=0 must be"),
    (["generate", "--prompt", "x", "--temperature", "1", "--top-p", "1.5"], "--top-p=1.5 must"),
    (["generate", "--prompt", "x", "--implementation", "foo"], "--implementation: "),
    (["generate", "--prompt", "x", "--method", "kivi:bits=7"], "--method kivi:bits=7: kivi:"),
    (["ask", "--document", "x", "--question", "q", "--method", "kivi:bits=7"], "--method kivi:"),
    (["ask", "--document", "x", "--question", "q", "--implementation", "gpu"], "allowed: auto"),
  ],
)
def test_bad_run_arguments_are_refused_before_the_model_loads(argv, message, capsys, monkeypatch):
  import models.loading

  monkeypatch.setattr(models.loading, "load_model", lambda *a, **k: pytest.fail("model loaded"))
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--methods", "magic"], "unknown cache method 'magic'"),
    (["--tasks", "ppl,bleu"], "allowed: ppl,kl"),
    (["--num-samples", "0"], "num_samples"),
    (["--needle-lengths", "1024", "0"], "needle_lengths[1]=0 must be an int >= 1"),
    (["--tasks", "ppl", "--needle-lengths", "2048"], "tasks=ppl runs no needle; add passkey"),
  ],
)
def test_compare_flags_are_refused_before_its_out_folder_is_made(flags, message, tmp_path, capsys):
  """Flags refused before the model loads; a refusal after it is the next test's."""
  out = tmp_path / "not_yet" / "out"
  with pytest.raises(SystemExit):
    main(["compare", "--out", str(out), *flags])
  assert message in capsys.readouterr().err
  assert not out.parent.exists()


def test_a_compare_refused_by_the_checks_that_need_the_model_makes_no_out_folder(tmp_path, capsys):
  text = tmp_path / "short.txt"
  text.write_text("Too short for one window.")
  out = tmp_path / "not_yet" / "out"
  argv = ["compare", "--methods", "full", "--tasks", "ppl", "--text", str(text)]
  with pytest.raises(SystemExit):
    main([*argv, "--context-len", "64", "--out", str(out)])
  assert "too short for" in capsys.readouterr().err
  assert not out.parent.exists()


def test_razor_profile_flags_are_refused_before_its_folder_is_made(tmp_path, capsys):
  output = tmp_path / "not_yet" / "p.json"
  with pytest.raises(SystemExit):
    main(["razor-profile", "--output", str(output), "--repeats", "1"])
  assert "--repeats=1 must be >= 2" in capsys.readouterr().err
  assert not output.parent.exists()


def test_a_razor_profile_of_another_model_is_refused_before_the_model_loads(
  tmp_path, capsys, monkeypatch
):
  import models.loading
  from kvjax.retrieval_heads import HeadProfile

  monkeypatch.setattr(models.loading, "load_model", lambda *a, **k: pytest.fail("model loaded"))
  shipped = HeadProfile.load(RAZOR_PROFILE)
  assert shipped.model_name == "smollm2-135m"
  finetune = tmp_path / "some-other-135m-finetune.gguf"
  finetune.write_bytes(b"")
  other = tmp_path / "other.json"
  dataclasses.replace(shipped, model_name=str(finetune)).save(other)
  method = f"razor:budget=64,profile={other}"
  for argv in (
    ["generate", "--prompt", "x", "--method", method],
    ["compare", "--methods", method, "--out", str(tmp_path / "out")],
    ["ask", "--document", "d", "--question", "q", "--method", method],
  ):
    with pytest.raises(SystemExit):
      main(argv)
    err = capsys.readouterr().err
    assert f"was computed for model '{finetune}', not 'smollm2-135m'" in err, argv
  # a model path recorded on another machine cannot be compared here: not refused for that
  elsewhere = tmp_path / "elsewhere.json"
  dataclasses.replace(shipped, model_name="/nowhere/model.gguf").save(elsewhere)
  from kvjax.cli import _check_profile_model
  from kvjax.method_spec import parse_method_spec

  _check_profile_model(parse_method_spec(f"razor:budget=64,profile={elsewhere}"), "smollm2-135m")


def test_output_paths_are_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
  import models.loading

  monkeypatch.setattr(models.loading, "load_model", lambda *a, **k: pytest.fail("model loaded"))
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  for argv, message in (
    (["compare", "--methods", "full", "--out", str(a_file)], "exists and is not a directory"),
    (
      ["compare", "--methods", "full", "--out", str(a_file / "out" / "deeper")],
      f"{a_file} exists and is not a directory",
    ),
    (["compare", "--methods", "full", "--out", "/proc/out"], "--out /proc/out: cannot write"),
    (["razor-profile", "--output", str(tmp_path)], "is a directory; name the profile's JSON"),
    (["razor-profile", "--output", str(a_file / "p.json")], "exists and is not a directory"),
    (["ask", "--document", "d", "--question", "q", "--save", str(a_file)], "is not a directory"),
    (["ask", "--document", "d", "--question", "q", "--save", str(tmp_path)], "--overwrite"),
    (
      ["ask", "--document", "d", "--question", "q", "--save", str(tmp_path), "--overwrite"],
      "holds no saved context (kvjax_context.json), so --overwrite does not replace it",
    ),
    (
      ["ask", "--document", "d", "--question", "q", "--save", str(a_file / "ctx")],
      f"--save {a_file / 'ctx'}: {a_file} exists and is not a directory",
    ),
    (["ask", "--document", "d", "--question", "q", "--overwrite"], "give --save too"),
    (["ask", "--save", "/proc/ctx", "--document", "d", "--question", "q"], "cannot write"),
    # A directory that exists but takes no files: refused before the work, not after it.
    (["razor-profile", "--output", "/proc/p.json"], "--output /proc: cannot write files there"),
    (["duo-train", "--output", "/proc/g.json"], "--output /proc: cannot write files there"),
  ):
    with pytest.raises(SystemExit):
      main(argv)
    assert message in capsys.readouterr().err, argv


def test_ask_refused_before_the_model_loads_makes_no_folder(tmp_path, capsys, monkeypatch):
  """Found by a review: --save made its parent folders in the early checks, so a run refused
  there or after the model loaded left them behind; and --context with --save asked for
  --overwrite before saying the two do not go together."""
  import models.loading

  def refused_after_loading(*args, **kwargs):
    raise ValueError("a check that needs the model refused the run")

  monkeypatch.setattr(models.loading, "load_model", refused_after_loading)
  saved = tmp_path / "saved"
  saved.mkdir()
  document = tmp_path / "document.txt"
  document.write_text("A short document.")
  for argv, message in (
    (["--context", str(saved), "--save", str(saved)], "--save compresses or saves a document"),
    (["--document", str(document), "--save", str(tmp_path / "new" / "ctx")], "needs the model"),
  ):
    with pytest.raises(SystemExit):
      main(["ask", "--question", "q", *argv])
    assert message in capsys.readouterr().err, argv
  assert not (tmp_path / "new").exists()


def test_repeated_methods_flags_add_up():
  from kvjax.cli import build_parser

  argv = ["compare", "--methods", "full", "kivi", "--methods", "streaming:ratio=0.5"]
  assert build_parser().parse_args(argv).methods == ["full", "kivi", "streaming:ratio=0.5"]


def test_a_saved_context_records_paths_that_hold_from_any_directory(tmp_path, monkeypatch):
  from kvjax.cli import _recorded_method, _recorded_model, _same_method

  monkeypatch.chdir(tmp_path)
  (tmp_path / "model.gguf").write_bytes(b"")
  assert _recorded_model("model.gguf") == str(tmp_path / "model.gguf")
  assert _recorded_model("smollm2-135m") == "smollm2-135m"
  spec = "razor:ratio=0.25,profile=heads.json+kivi:bits=4"
  assert _recorded_method(spec) == f"razor:ratio=0.25,profile={tmp_path}/heads.json+kivi:bits=4"
  assert _same_method("kivi:bits=2", "kivi") and not _same_method("kivi:bits=4", "kivi")
  # a razor profile is the same method by its heads, whatever path names it
  (tmp_path / "heads.json").write_text(pathlib.Path(RAZOR_PROFILE).read_text())
  (tmp_path / "copy").mkdir()
  (tmp_path / "copy" / "heads.json").write_text(pathlib.Path(RAZOR_PROFILE).read_text())
  saved = _recorded_method("razor:budget=64,profile=heads.json")
  assert _same_method("razor:budget=64,profile=heads.json", saved)
  assert _same_method(f"razor:budget=64,profile={tmp_path}/copy/heads.json", saved)
  assert not _same_method("razor:budget=65,profile=heads.json", saved)


def test_ask_answers_every_question_about_one_compressed_document(tmp_path, capsys):
  """On the tiny byte-level model: what is tested is the command's own work (compress, answer,
  save, restore, refuse what differs), which does not depend on the model (on SmolLM2 this test
  took 37-49 s of the suite; `kvjax ask` on SmolLM2 is the README's example)."""
  from kvjax.context_checkpoint import METADATA_FILE, read_context_record

  model = _tiny_byte_level_model(tmp_path / "tiny")
  document = tmp_path / "doc.txt"
  document.write_text("The mayor of Quenby is Hilda Marsh. The river flows north.\n")
  argv = ["ask", "--model", str(model), "--document", str(document), "--max-new-tokens", "4"]
  argv += ["--json", "--question", "Who is the mayor?", "--question", "Where does the river flow?"]
  # SmolLM2's default, kivi:bits=4, with groups that divide the tiny model's head_dim of 16
  kivi = "kivi:bits=4,group_size=16"
  assert main(argv + ["--method", kivi, "--save", str(tmp_path / "context")]) == 0
  record = json.loads(capsys.readouterr().out)
  assert record["questions"] == ["Who is the mayor?", "Where does the river flow?"]
  assert len(record["answers"]) == 2 and all(1 <= n <= 4 for n in record["answer_tokens"])
  assert record["method"] == kivi and record["rows"] == "shared"
  # The tiny model: 2 layers, 2 KV heads of 16 dims; each question's own bf16 cache holds its
  # longest question and its answer, beside the document's cache held once.
  per_layer_and_row, rest = divmod(record["cache_bytes"] - record["context_bytes"], 2 * 2)
  room, rest_of_row = divmod(per_layer_and_row - 4, 2 * 2 * 16 * 2)
  assert rest == rest_of_row == 0 and room >= 4 + 1  # the 4 answer tokens and a question
  saved = read_context_record(tmp_path / "context")["metadata"]
  assert saved["method"] == kivi and saved["cache_dtype"] == "bfloat16"

  # Asked again in another run, from the saved context: restored, not compressed.
  argv = ["ask", "--context", str(tmp_path / "context"), "--max-new-tokens", "4", "--json"]
  argv += ["--question", "Who is the mayor?", "--question", "Where does the river flow?"]
  assert main(argv) == 0
  restored = json.loads(capsys.readouterr().out)
  assert restored["answers"] == record["answers"] and restored["compress_s"] is None
  assert restored["restore_s"] > 0 and restored["document_tokens"] == record["document_tokens"]
  assert restored["context_bytes"] == record["context_bytes"]
  for flag, value, message in (
    ("--method", "full", "--method=full differs from the saved context's 'kivi"),
    ("--layer-loop", "unroll", "--layer-loop=unroll differs from the saved context's"),
  ):
    with pytest.raises(SystemExit) as exit_info:
      main(argv + [flag, value])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
  # The same method and model, spelled otherwise, are the saved ones.
  model_spelled_otherwise = str(tmp_path / "tiny" / ".." / "tiny")
  assert (
    main(argv + ["--method", "kivi:group_size=16,bits=4", "--model", model_spelled_otherwise]) == 0
  )
  assert json.loads(capsys.readouterr().out)["answers"] == record["answers"]
  with pytest.raises(SystemExit):  # saved before, without --overwrite
    save_again = ["--question", "q", "--save", argv[2]]
    main(["ask", "--model", str(model), "--document", str(document), *save_again])
  assert "the directory exists; pass --overwrite" in capsys.readouterr().err
  # A context saved before the prompt format was recorded cut its prompts otherwise.
  record_path = tmp_path / "context" / METADATA_FILE
  saved_record = json.loads(record_path.read_text())
  del saved_record["metadata"]["prompt_format"]
  record_path.write_text(json.dumps(saved_record))
  with pytest.raises(SystemExit):
    main(argv)
  assert "saved by an earlier `kvjax ask`" in capsys.readouterr().err
  saved_record["metadata"]["prompt_format"] = 2
  record_path.write_text(json.dumps(saved_record))
  # Without --json: each answer, then a summary line on stderr.
  one = ["ask", "--context", str(tmp_path / "context"), "--max-new-tokens", "2"]
  assert main(one + ["--question", "Who is the mayor?"]) == 0
  printed = capsys.readouterr()
  assert printed.out.startswith("Q: Who is the mayor?\nA: ")
  assert "restored in" in printed.err and "; 1 question's caches " in printed.err


def test_ask_refuses_a_document_past_the_models_positions(tmp_path, capsys):
  document = tmp_path / "long.txt"
  document.write_text("The river flows north. " * 1700)  # about 8500 tokens; SmolLM2 has 8192
  with pytest.raises(SystemExit):
    main(["ask", "--document", str(document), "--question", "Where?", "--max-new-tokens", "4"])
  assert "exceed the model's 8192 positions" in capsys.readouterr().err


def test_ask_with_shared_or_repeated_rows_answers_alike_with_a_full_cache(tmp_path, capsys):
  # On the tiny byte-level model (38 s on SmolLM2, for nothing SmolLM2's answers show).
  model = _tiny_byte_level_model(tmp_path / "tiny")
  document = tmp_path / "doc.txt"
  document.write_text("Pelle keeps three goats and a donkey named Bruno on the hill farm.\n")
  argv = ["ask", "--document", str(document), "--max-new-tokens", "6", "--json"]
  argv += ["--model", str(model)]
  argv += ["--question", "What is the donkey called?", "--question", "How many goats?"]
  argv += ["--method", "full"]
  records = {}
  # Shared with the questions fed in chunks (the default), repeated token by token.
  for rows in ("shared", "repeated"):
    assert main(argv + ["--rows", rows]) == 0
    records[rows] = json.loads(capsys.readouterr().out)
  assert records["shared"]["answers"] == records["repeated"]["answers"]
  assert records["shared"]["answer_tokens"] == [6, 6]  # no early stop leaves little to compare
  assert records["repeated"]["cache_bytes"] == 2 * records["repeated"]["context_bytes"]
  assert records["shared"]["cache_bytes"] < records["repeated"]["cache_bytes"]
  with pytest.raises(SystemExit):
    main(argv[:-1] + ["h2o_decode:budget=16"])
  assert "--rows shared: share_context: layer 0's cache cannot" in capsys.readouterr().err


def test_razor_profile_command_writes_a_loadable_profile(tmp_path, capsys):
  from kvjax.retrieval_heads import HeadProfile

  path = tmp_path / "profile.json"
  argv = ["razor-profile", "--output", str(path), "--block-len", "48", "--repeats", "2"]
  assert main(argv) == 0
  profile = HeadProfile.load(path)
  assert (profile.num_layers, profile.num_kv_heads) == (30, 3)
  assert 1 <= len(profile.retrieval_heads) <= 90
  assert "retrieval heads; wrote" in capsys.readouterr().out


def _tiny_byte_level_model(directory: pathlib.Path) -> pathlib.Path:
  """tests/fixtures/tiny_llama (2 layers, 2 KV heads, 256 positions and token ids) with a
  byte-level tokenizer: one token per byte of any text."""
  import shutil

  import tokenizers

  shutil.copytree(pathlib.Path(__file__).parents[1] / "fixtures" / "tiny_llama", directory)
  alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  backend = tokenizers.Tokenizer(
    tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
  )
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  backend.save(str(directory / "tokenizer.json"))
  # A chat template for `ask`: the user's text, then a blank line to answer after.
  template = "{% for m in messages %}{{ m['content'] }}{% endfor %}\n\n"
  (directory / "tokenizer_config.json").write_text(
    json.dumps({"eos_token": "z", "chat_template": template})
  )
  return directory


def test_duo_train_command_writes_gates_a_method_loads(tmp_path, capsys):
  from kvjax.duo_gate_profile import DuoGateProfile

  model = _tiny_byte_level_model(tmp_path / "tiny")
  text = tmp_path / "text.txt"
  text.write_text("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. " * 20)
  path = tmp_path / "gates.json"
  argv = ["duo-train", "--model", str(model), "--output", str(path), "--text", str(text)]
  argv += ["--sinks", "4", "--recent", "16", "--passkeys", "1", "--passkey-words", "2"]
  argv += ["--samples", "2", "--steps", "2"]
  # A prompt longer than the model's 256 positions is refused before training.
  with pytest.raises(SystemExit):
    main([*argv, "--context-len", "300"])
  assert "--context-len=300 exceeds the model's context of 256" in capsys.readouterr().err
  assert not path.exists()
  assert main([*argv, "--context-len", "200"]) == 0
  assert "over 2 steps; wrote" in capsys.readouterr().out
  profile = DuoGateProfile.load(path)
  assert (profile.num_layers, profile.num_kv_heads) == (2, 2)
  gates = np.asarray(profile.gates)
  # Two AdamW steps of 0.02 from gates of 1, each clipped back into [0, 1].
  assert np.all((gates >= 1 - 0.05) & (gates <= 1)) and gates.min() < 1
  training = dict(profile.training)
  assert training["steps"] == 2 and training["context_len"] == 200
  assert training["first_loss"] == pytest.approx(0.05, rel=1e-5)  # gates of 1: the penalty alone
  assert profile.model_name == str(model.resolve())
  assert parse_method_spec(f"duo:profile={path},sinks=4,recent=16").gate_profile == profile


def test_compare_on_the_embedded_model_in_one_piece_and_in_chunks(tmp_path, capsys):
  """The CLI end to end on SmolLM2, small: a table, results.json and the layer loop named; then
  --prefill-chunk reaches the prefill: the full cache scores the continuation as in one piece
  (up to its bf16 rounding of earlier chunks), and the header says so."""
  # residual=32: the 64-token context is quantized (with the default 128 the 72 tokens would all
  # stay in the full-precision window, and KIVI would be the full cache).
  kivi = "kivi:bits=4,residual=32"
  argv = ["compare", "--methods", "full", kivi, "--context-len", "64", "--continuation-len", "8"]
  assert main(argv + ["--tasks", "ppl,kl,speed", "--out", str(tmp_path / "one_piece")]) == 0
  printed = capsys.readouterr().out
  assert "layer loop scan" in printed and kivi in printed
  assert "speed on a batch of 1" in printed
  one_piece = json.loads((tmp_path / "one_piece" / "results.json").read_text())
  assert [r["method"] for r in one_piece] == ["full", kivi]
  # Measured on 2026-11-25: KL 0.0158, perplexity 5.47 against the full cache's 5.22.
  assert 1e-4 < one_piece[1]["kl"] < 0.05
  assert one_piece[0]["ppl"] < one_piece[1]["ppl"] < 1.15 * one_piece[0]["ppl"]
  assert all(r["decode_tokens_per_s"] > 0 and r["speed_batch"] == 1 for r in one_piece)

  argv += ["--tasks", "ppl", "--out", str(tmp_path / "chunks"), "--prefill-chunk", "16"]
  assert main(argv) == 0
  assert "prefill in chunks of 16" in capsys.readouterr().out
  chunks = json.loads((tmp_path / "chunks" / "results.json").read_text())
  assert chunks[0]["method"] == "full"
  assert chunks[0]["ppl"] == pytest.approx(one_piece[0]["ppl"], rel=2e-3)
  assert chunks[1]["cache_bytes"] == one_piece[1]["cache_bytes"]
  # KIVI's chunks attend to the earlier chunks' codes: close to one piece, not equal (5.50), so
  # the difference shows the chunks reached the prefill.
  assert chunks[1]["ppl"] == pytest.approx(one_piece[1]["ppl"], rel=0.03)
  assert chunks[1]["ppl"] != pytest.approx(one_piece[1]["ppl"], rel=1e-3)


def test_generate_raw_prompt_gets_the_tokenizers_bos(tmp_path, capsys):
  """--raw text is encoded as transformers' tokenizer(text) and llama.cpp encode it: with the BOS
  a Llama tokenizer adds. A chat template writes its own BOS, so chat prompts get none added."""
  import shutil

  from tests.models.test_tokenizer import TINY_IDS, write_tokenizer_dir

  model = tmp_path / "tiny_llama"
  shutil.copytree(pathlib.Path(__file__).parents[1] / "fixtures" / "tiny_llama", model)
  write_tokenizer_dir(
    model,
    {
      "tokenizer_class": "LlamaTokenizerFast",
      "bos_token": "<s>",
      "eos_token": "</s>",
      "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}",
    },
  )
  argv = ["generate", "--model", str(model), "--prompt", "ab", "--max-new-tokens", "1", "--json"]
  assert main(argv + ["--raw"]) == 0
  assert json.loads(capsys.readouterr().out)["prompt_ids"] == [TINY_IDS["<s>"], TINY_IDS["ab"]]
  assert main(argv) == 0
  assert json.loads(capsys.readouterr().out)["prompt_ids"] == [TINY_IDS["<s>"], TINY_IDS["ab"]]


@pytest.mark.parametrize(
  "tasks, says, does_not_say",
  [
    (("ppl", "kl"), ["continuation 8, 3 samples, "], []),
    (("speed",), ["continuation 8, cache dtype", "speed on a batch of 1"], ["samples"]),
    (("passkey",), ["tokens, 3 samples, cache dtype"], ["continuation"]),
  ],
)
def test_the_compare_header_names_only_the_settings_the_tasks_used(tasks, says, does_not_say):
  from kvjax.cli import compare_header
  from kvjax.eval.compare import CompareConfig

  config = CompareConfig(tasks=tasks, context_len=64, continuation_len=8, num_samples=3)
  records = [dict(speed_batch=1)] if "speed" in tasks else [dict(speed_batch=None)]
  header = compare_header(config, model="m", layer_loop="scan", machine="cpu", records=records)
  assert header.startswith("model m, context 64 tokens, ") and header.endswith("; cpu")
  assert all(text in header for text in says), header
  assert not any(text in header for text in does_not_say), header


def test_the_compare_header_names_the_needle_lengths_where_they_were_given():
  from kvjax.cli import compare_header
  from kvjax.eval.compare import CompareConfig

  def header(num_samples=3, **kwargs):
    config = CompareConfig(tasks=("passkey",), context_len=64, num_samples=num_samples, **kwargs)
    return compare_header(config, model="m", layer_loop="scan", machine="cpu", records=[{}])

  assert "needle at" not in header()
  assert "context 64 tokens, 3 samples, needle at 1024/2048 tokens, cache dtype" in header(
    needle_lengths=(1024, 2048)
  )
  assert "context 64 tokens, 1 sample, cache dtype" in header(num_samples=1)


def test_python_dash_m_kvjax_is_the_command_line():
  result = subprocess.run(
    [sys.executable, "-m", "kvjax", "--help"], capture_output=True, text=True, timeout=120
  )
  assert result.returncode == 0, result.stderr
  assert "compare" in result.stdout and "usage: kvjax" in result.stdout
