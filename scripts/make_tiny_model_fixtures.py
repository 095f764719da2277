"""Build tiny random Llama / Mistral checkpoints plus Hugging Face reference outputs.

These fixtures let the kvjax Flax decoders be checked against Hugging Face
``transformers`` (eager attention, float32) without downloading anything.

Outputs (each directory is well under 1 MB)::

    tests/fixtures/tiny_llama/    config.json, model.safetensors, generation_config.json,
                                  reference.npz
    tests/fixtures/tiny_mistral/  the same four files

``tiny_llama``: GQA (8 query heads, 2 KV heads), head_dim=16 != hidden/heads=8,
untied lm_head, llama3 RoPE scaling with original_max_position_embeddings=32 so
the scaling changes some of the 8 frequencies at head_dim 16.

``tiny_mistral``: MQA (4 query heads, 1 KV head), head_dim=16, sliding_window=5,
tied word embeddings.

reference.npz keys:
    input_ids       int32 [2, 12]   row 0 full length, row 1 left-padded (4 x id 0)
    attention_mask  int32 [2, 12]
    position_ids    int32 [2, 12]   clip(cumsum(mask) - 1, 0); padding slots get 0
    logits          float32 [2, 12, 256]  one forward with ids, mask and position_ids.
                    Logits at padding slots (mask == 0) are not meaningful; compare
                    only where attention_mask == 1.
    greedy_ids      int32 [2, 8]    new tokens of model.generate(..., do_sample=False,
                    max_new_tokens=8), eos disabled, pad_token_id=0
    long_input_ids  int32 [1, 40]   no padding
    long_logits     float32 [1, 40, 256]
    inv_freq        float32 [8]     the RoPE inverse frequencies HF uses
    inv_freq_unscaled float32 [8]   theta ** (-2i / head_dim)
    sliding_window_rule str         the window rule (Mistral; "none" for Llama)
    transformers_version / torch_version str

Rebuild (needs Python 3.11 env; CPU only, nothing is fetched from a model hub)::

    python3.11 -m venv /work/venv311
    /work/venv311/bin/pip install torch==2.13.0 transformers safetensors numpy
    HF_HUB_OFFLINE=1 /work/venv311/bin/python scripts/make_tiny_model_fixtures.py

The models are created with fixed seeds; the fixtures were produced with
transformers 5.23.0 / torch 2.13.0+cpu. Note that transformers >= 5 writes the
RoPE settings into config.json as ``rope_parameters`` (``rope_theta`` and the
llama3 keys in one dict) instead of the legacy ``rope_theta`` / ``rope_scaling``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
  LlamaConfig,
  LlamaForCausalLM,
  MistralConfig,
  MistralForCausalLM,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
T = 12
N_PAD = 4
NEW_TOKENS = 8
LONG_T = 40
PAD_ID = 0
VOCAB = 256


def llama_config() -> LlamaConfig:
  return LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    # transformers >= 5 spelling of rope_theta + rope_scaling
    rope_parameters={
      "rope_type": "llama3",
      "rope_theta": 10000.0,
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32,
    },
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=PAD_ID,
    attn_implementation="eager",
  )


def mistral_config() -> MistralConfig:
  return MistralConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=16,
    sliding_window=5,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=PAD_ID,
    attn_implementation="eager",
  )


def init_weights(model: torch.nn.Module, seed: int) -> None:
  """Larger-than-default random init so logits and attention are not flat."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
      if "norm" in name:
        # RMSNorm gains: random around 1
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
      else:
        p.copy_(0.1 * torch.randn(p.shape, generator=g))


def make_inputs(seed: int):
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, VOCAB, size=(2, T)).astype(np.int32)
  mask = np.ones((2, T), dtype=np.int32)
  ids[1, :N_PAD] = PAD_ID
  mask[1, :N_PAD] = 0
  pos = np.clip(np.cumsum(mask, axis=-1) - 1, 0, None).astype(np.int32)
  long_ids = rng.integers(3, VOCAB, size=(1, LONG_T)).astype(np.int32)
  return ids, mask, pos, long_ids


def t(x: np.ndarray) -> torch.Tensor:
  return torch.from_numpy(np.asarray(x)).long()


@torch.no_grad()
def forward_logits(model, ids, mask=None, pos=None) -> np.ndarray:
  out = model(
    input_ids=t(ids),
    attention_mask=None if mask is None else t(mask),
    position_ids=None if pos is None else t(pos),
    use_cache=False,
  )
  return out.logits.float().numpy()


@torch.no_grad()
def greedy_generate(model, ids, mask) -> np.ndarray:
  out = model.generate(
    t(ids),
    attention_mask=t(mask),
    max_new_tokens=NEW_TOKENS,
    min_new_tokens=NEW_TOKENS,
    do_sample=False,
    eos_token_id=None,
    pad_token_id=PAD_ID,
  )
  new = out[:, ids.shape[1] :].numpy().astype(np.int32)
  assert new.shape == (ids.shape[0], NEW_TOKENS), new.shape
  return new


@torch.no_grad()
def greedy_no_cache(model, ids, mask) -> np.ndarray:
  """Cache-free greedy decoding (full recompute each step) as a cross-check of generate()."""
  ids = np.asarray(ids)
  mask = np.asarray(mask)
  new = []
  for _ in range(NEW_TOKENS):
    pos = np.clip(np.cumsum(mask, axis=-1) - 1, 0, None)
    logits = forward_logits(model, ids, mask, pos)
    nxt = logits[:, -1].argmax(-1).astype(np.int32)
    new.append(nxt)
    ids = np.concatenate([ids, nxt[:, None]], axis=1)
    mask = np.concatenate([mask, np.ones((mask.shape[0], 1), mask.dtype)], axis=1)
  return np.stack(new, axis=1)


def report_inv_freq(model, cfg) -> tuple[np.ndarray, np.ndarray]:
  rope = model.model.rotary_emb
  inv = rope.inv_freq.detach().float().numpy()
  theta = cfg.rope_parameters["rope_theta"]
  hd = cfg.head_dim
  unscaled = (1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)).astype(np.float32)
  print(f"  rope_parameters = {cfg.rope_parameters}")
  print("  i   unscaled_inv_freq  hf_inv_freq   wavelen_unscaled  ratio   changed")
  for i, (u, s) in enumerate(zip(unscaled, inv)):
    changed = not np.isclose(u, s, rtol=1e-6, atol=0)
    print(f"  {i}   {u:.6e}      {s:.6e}  {2 * math.pi / u:10.2f}      {u / s:6.3f}  {changed}")
  return inv.astype(np.float32), unscaled


@torch.no_grad()
def check_sliding_window(model, cfg, long_ids) -> str:
  """Establish HF's sliding-window rule empirically (eager attention weights + perturbation)."""
  W = cfg.sliding_window
  L = len(model.model.layers)
  ids = long_ids[:, :20]
  n = ids.shape[1]
  # 1) attention probabilities from eager attention: which keys get nonzero weight?
  out = model(input_ids=t(ids), output_attentions=True, use_cache=False)
  i = np.arange(n)[:, None]
  j = np.arange(n)[None, :]
  expected = (j <= i) & (i - j < W)
  for li, a in enumerate(out.attentions):
    vis = (a[0].numpy() > 0).all(axis=0)  # every head
    invis = (a[0].numpy() == 0).all(axis=0)
    assert np.array_equal(vis, expected), f"layer {li}: visibility != (0 <= i-j < {W})"
    assert np.array_equal(invis, ~expected), f"layer {li}: masked keys get weight"
  print(
    f"  attention weights (all {L} layers, all heads): "
    f"key j visible from query i  <=>  0 <= i - j < {W}"
  )

  # 2) perturbation: last logits vs a changed token d positions back (2 layers => reach 2*(W-1))
  base = forward_logits(model, ids)[0, -1]
  reach = L * (W - 1)
  print(f"  perturbation test, no padding, T={n}, {L} layers, receptive field {reach} tokens back:")
  results = {}
  for d in range(1, n):
    pert = ids.copy()
    pert[0, n - 1 - d] = (pert[0, n - 1 - d] + 17) % VOCAB
    diff = float(np.abs(forward_logits(model, pert)[0, -1] - base).max())
    results[d] = diff
    changed = diff > 0
    assert changed == (d <= reach), (d, diff)
  print("    distance back : max|dlogit| at last position")
  for d, diff in results.items():
    tag = "changed" if diff > 0 else "unchanged"
    print(f"    {d:2d} ({'>= W' if d >= W else '<  W'}) : {diff:.3e}  {tag}")

  # 3) single-layer: the last position reacts only to tokens with d < W
  one = MistralForCausalLM(MistralConfig(**{**cfg.to_dict(), "num_hidden_layers": 1}))
  one.config._attn_implementation = "eager"
  sd = {k: v for k, v in model.state_dict().items() if not k.startswith("model.layers.1.")}
  one.load_state_dict(sd, strict=False)
  one.eval()
  base1 = forward_logits(one, ids)[0, -1]
  seen = []
  for d in range(0, n):
    pert = ids.copy()
    pert[0, n - 1 - d] = (pert[0, n - 1 - d] + 17) % VOCAB
    if np.abs(forward_logits(one, pert)[0, -1] - base1).max() > 0:
      seen.append(d)
  assert seen == list(range(W)), seen
  print(f"  1-layer model: last logits depend on tokens at distances {seen} (= range(W={W}))")

  # 4) the sliding DynamicCache keeps exactly W-1 past tokens
  from transformers import DynamicCache

  cache = DynamicCache(config=cfg)
  model(input_ids=t(ids), past_key_values=cache, use_cache=True)
  kept = cache.layers[0].keys.shape[-2]
  print(f"  DynamicCache after a {n}-token prefill keeps {kept} keys per layer (W - 1 = {W - 1})")
  assert kept == W - 1

  return (
    f"query at cache slot i attends key slot j iff 0 <= i - j < sliding_window (={W}), "
    f"i.e. the W keys j in [i-W+1, i] including itself (transformers masking_utils: "
    f"kv_idx > q_idx - sliding_window, and causal kv_idx <= q_idx); distance is in cache "
    f"slots (with left padding equal to the position distance of real tokens); applied in "
    f"every layer; padding keys additionally masked by attention_mask. During generation the "
    f"DynamicSlidingWindowLayer keeps the last W-1 = {W - 1} keys and the new token makes W."
  )


def build(name: str, cfg, model_cls, seed: int, input_seed: int, out_root: Path) -> None:
  print(f"=== {name} ===")
  torch.manual_seed(seed)
  model = model_cls(cfg)
  init_weights(model, seed)
  if cfg.tie_word_embeddings:
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
  model.eval()
  model.generation_config.pad_token_id = PAD_ID
  model.generation_config.eos_token_id = None
  model.generation_config.bos_token_id = cfg.bos_token_id
  model.generation_config.do_sample = False
  assert model.config._attn_implementation == "eager", model.config._attn_implementation

  inv, unscaled = report_inv_freq(model, cfg)
  ids, mask, pos, long_ids = make_inputs(input_seed)

  logits = forward_logits(model, ids, mask, pos)
  long_logits = forward_logits(model, long_ids)

  # sanity: the padded row's real tokens match the same tokens run unpadded
  unpadded = forward_logits(model, ids[1:, N_PAD:])
  dpad = float(np.abs(unpadded[0] - logits[1, N_PAD:]).max())
  print(f"  left-padded row vs. same tokens unpadded: max|diff| = {dpad:.2e}")
  assert dpad < 1e-4
  print(f"  logits std = {logits[mask.astype(bool)].std():.3f}  (not flat)")

  greedy = greedy_generate(model, ids, mask)
  greedy_ref = greedy_no_cache(model, ids, mask)
  print(f"  greedy_ids (generate):\n{greedy}")
  assert np.array_equal(greedy, greedy_ref), ("generate != cache-free greedy", greedy, greedy_ref)
  print("  generate() == cache-free greedy loop: True")

  if getattr(cfg, "sliding_window", None):
    rule = check_sliding_window(model, cfg, long_ids)
  else:
    rule = "none (full causal attention)"
  print(f"  sliding_window_rule: {rule}")

  out_dir = out_root / name
  if out_dir.exists():
    shutil.rmtree(out_dir)
  out_dir.mkdir(parents=True)
  model.save_pretrained(out_dir, safe_serialization=True)
  np.savez(
    out_dir / "reference.npz",
    input_ids=ids.astype(np.int32),
    attention_mask=mask.astype(np.int32),
    position_ids=pos.astype(np.int32),
    logits=logits.astype(np.float32),
    greedy_ids=greedy.astype(np.int32),
    long_input_ids=long_ids.astype(np.int32),
    long_logits=long_logits.astype(np.float32),
    inv_freq=inv,
    inv_freq_unscaled=unscaled,
    sliding_window_rule=np.array(rule),
    transformers_version=np.array(transformers.__version__),
    torch_version=np.array(torch.__version__),
  )

  # round trip: reload from disk and reproduce the logits exactly
  reloaded = model_cls.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32)
  reloaded.eval()
  d = float(np.abs(forward_logits(reloaded, ids, mask, pos) - logits).max())
  print(f"  reload from {out_dir.relative_to(out_root.parent.parent)}: max|diff| = {d:.1e}")
  assert d == 0.0
  total = 0
  for f in sorted(out_dir.iterdir()):
    total += f.stat().st_size
    print(f"    {f.name:24s} {f.stat().st_size:8d} B")
  print(f"    total                    {total:8d} B")
  assert total < 1_000_000


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures")
  args = ap.parse_args()
  torch.set_num_threads(1)
  print(f"transformers {transformers.__version__}, torch {torch.__version__}")
  build("tiny_llama", llama_config(), LlamaForCausalLM, seed=0, input_seed=100, out_root=args.out)
  build(
    "tiny_mistral", mistral_config(), MistralForCausalLM, seed=1, input_seed=101, out_root=args.out
  )


if __name__ == "__main__":
  main()
