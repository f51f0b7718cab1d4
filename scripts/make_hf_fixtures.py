"""Builds the tiny Hugging Face reference fixtures of the conversion tests (needs torch + transformers).

The test suite never imports torch: it converts these directories and compares against the logits saved here.
Run it from a Python 3.11 venv outside the repo (a CPU torch wheel exists for 3.11; 3.12 would pull CUDA):

    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/hfref
    /tmp/hfref/bin/pip install torch==2.13.0 transformers safetensors numpy tokenizers
    /tmp/hfref/bin/python scripts/make_hf_fixtures.py             # writes tests/fixtures/hf/<name>/

Each fixture is an HF model directory (config.json + safetensors, one sharded with an index) with random weights
and a `reference.npz`: `tokens` int32 [2, 24], `logits` float32 [2, 24, vocab] (HF, fp32, eager attention) and
`loss` (HF's shifted next-token loss on `tokens`). Weights saved in bf16 are exactly the ones the reference ran.

    /tmp/hfref/bin/python scripts/make_hf_fixtures.py --check_export=DIR --reference=tests/fixtures/hf/NAME
loads DIR (e.g. written by `convert_checkpoint.py --direction=mjax_to_hf`) with transformers and checks that its
logits match the fixture's reference: proof that transformers loads what mjax exports.
"""

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
BATCH, SEQ, VOCAB = 2, 24, 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
              max_position_embeddings=128, rms_norm_eps=1e-5)

# name -> (architecture, config kwargs, dtype saved, options)
FIXTURES = {
    # Llama 3.1-style: GQA 4/2, llama3 RoPE scaling (original 16 positions so the scaling bites at seq 24),
    # untied, bf16, sharded with an index, a tokenizer, and the legacy rope_theta/rope_scaling config keys.
    "llama3_gqa": ("LlamaForCausalLM", dict(
        COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16)),
        torch.bfloat16, dict(shard="40KB", tokenizer=True, legacy_rope=True)),
    # Llama 2/3.2-style: MHA, tied embeddings, head_dim 32 != hidden / heads, fp16.
    "llama_tied_mha": ("LlamaForCausalLM", dict(
        COMMON, num_attention_heads=4, num_key_value_heads=4, head_dim=32, tie_word_embeddings=True,
        rope_theta=10000.0), torch.float16, {}),
    # Mistral: MQA 4/1, sliding window 8 < sequence 24 so the window changes the logits.
    "mistral_swa": ("MistralForCausalLM", dict(
        COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
        tie_word_embeddings=False, rope_theta=10000.0), torch.bfloat16, {}),
    # Qwen2/2.5 small: QKV bias, tied embeddings, GQA 4/2.
    "qwen2_tied": ("Qwen2ForCausalLM", dict(
        COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0,
        use_sliding_window=False), torch.bfloat16, {}),
    # GPT-2: LayerNorm, learned positions, gelu_new, Conv1D weights, fused c_attn, all biases, tied.
    "gpt2": ("GPT2LMHeadModel", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     n_inner=128, activation_function="gelu_new", tie_word_embeddings=True,
                                     bos_token_id=0, eos_token_id=0),
             torch.float32, {}),
}


def randomize(model, seed: int):
    """Every parameter random (HF init leaves biases at zero and norms at one, which would hide mapping bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_norm = p.ndim == 1 and ("norm" in name or ".ln_" in name)
            p.copy_(1.0 + 0.1 * noise if is_norm and name.endswith("weight") else 0.08 * noise)


def reference(model, tokens):
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens).long(), labels=torch.from_numpy(tokens).long())
    return out.logits.float().numpy(), float(out.loss)


def make_tokenizer(directory: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog", "hello world, mjax converts checkpoints"] * 4
    tok.train_from_iterator(text, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


def to_legacy_rope(directory: Path):
    """Rewrites transformers-5 `rope_parameters` as the `rope_theta` + `rope_scaling` keys most Hub configs have."""
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    path.write_text(json.dumps(cfg, indent=2))


def build(name: str, seed: int):
    arch, kwargs, dtype, opts = FIXTURES[name]
    cls = getattr(transformers, arch)
    config = cls.config_class(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomize(model, seed)
    model = model.to(dtype)  # the saved weights; the reference runs these exact values in fp32
    out = ROOT / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, max_shard_size=opts.get("shard", "50GB"))
    if opts.get("legacy_rope"):
        to_legacy_rope(out)
    if opts.get("tokenizer"):
        make_tokenizer(out)
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    # The reference is what transformers' own loader makes of the saved directory, run in fp32. (Not the model in
    # memory: `.to(bfloat16)` also rounded its RoPE inv_freq buffer, which a fresh load recomputes in fp32.)
    reloaded = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    saved = dict(model.float().named_parameters())
    for pname, p in reloaded.named_parameters():
        assert torch.equal(p, saved[pname]), f"{name}: {pname} changed through save/load"
    logits, loss = reference(reloaded, tokens)
    np.savez_compressed(out / "reference.npz", tokens=tokens, logits=logits, loss=np.float32(loss))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name:16s} {arch:20s} {str(dtype):15s} loss {loss:.4f}  {size / 1024:.0f} KiB")


def check_export(directory: str, fixture: str):
    ref = np.load(Path(fixture) / "reference.npz")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    logits, loss = reference(model, ref["tokens"])
    err = float(np.abs(logits - ref["logits"]).max())
    print(f"{directory}: {type(model).__name__} max |logits - reference| = {err:.3g}, "
          f"loss {loss:.6f} vs {float(ref['loss']):.6f}")
    if err > 1e-4:
        raise SystemExit(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="fixture names to rebuild (default: all)")
    parser.add_argument("--check_export", help="an HF directory to load with transformers and compare")
    parser.add_argument("--reference", help="with --check_export: the fixture directory holding reference.npz")
    args = parser.parse_args()
    if args.check_export:
        return check_export(args.check_export, args.reference)
    for i, name in enumerate(FIXTURES):
        if not args.only or name in args.only:
            build(name, seed=1000 + i)
    total = sum(f.stat().st_size for f in ROOT.rglob("*") if f.is_file())
    print(f"total {total / 1024:.0f} KiB under {ROOT}")


if __name__ == "__main__":
    main()
