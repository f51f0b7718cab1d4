"""Builds the tiny Hugging Face reference fixtures of the conversion tests (needs torch + transformers).

The test suite never imports torch: it converts these directories and compares against the logits saved here.
Run it from a Python 3.11 venv outside the repo (a CPU torch wheel exists for 3.11; 3.12 would pull CUDA):

    /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/hfref
    /tmp/hfref/bin/pip install torch==2.13.0 transformers safetensors numpy tokenizers absl-py
    /tmp/hfref/bin/python -m tools.make_hf_fixtures             # writes tests/fixtures/hf/<name>/
    /tmp/hfref/bin/python -m tools.make_hf_fixtures --only=mixtral  # rebuilds only the fixtures named

The MoE fixtures were made with transformers 5.24.0 (which saves experts one tensor per expert, as the Hub has them).

Each fixture is an HF model directory (config.json + safetensors, two sharded with an index) with random weights
and a `reference.npz`: `tokens` int32 [2, 24], `logits` float32 [2, 24, vocab] (HF, fp32, eager attention and
expert loop) and `loss` (HF's shifted next-token loss on `tokens`). Weights saved in bf16 are exactly the ones the
reference ran.
A mixture-of-experts fixture also holds what its router did, over the B*T tokens flattened batch-major, for the
MoE layers `router_layers` int32 [L]: `router_logits` float32 [L, B*T, experts] (the gate's logits, before
softmax / sigmoid), `router_ids` int32 [L, B*T, top_k] (the chosen experts, ascending) and `router_weights`
float32 [L, B*T, top_k] (their final weights, scaling included, in the order of `router_ids`). The build checks
that routing against a NumPy restatement of each family's rule (`route`), that every expert is chosen, and that
no choice is within float noise of a tie.

    /tmp/hfref/bin/python -m tools.make_hf_fixtures --check_export=DIR --reference=tests/fixtures/hf/NAME
loads DIR (e.g. written by `convert_checkpoint.py --direction=mjax_to_hf`) with transformers and checks that its
logits match the fixture's reference: proof that transformers loads what mjax exports. It fails on any weight
transformers reports missing, unexpected or misshapen, and for an MoE fixture says how many tokens were routed
differently.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from absl import app, flags

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
BATCH, SEQ, VOCAB = 2, 24, 300
# The plain PyTorch paths: eager attention and the per-expert loop (transformers' default MoE path is grouped_mm).
EAGER = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
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
    # -- mixtures of experts; their `reference.npz` also holds the routing of every MoE layer (see the top) --
    # Mixtral: 4 experts top-2, softmax renormalised over the top-k, GQA 4/2, no sliding window, sharded.
    "mixtral": ("MixtralForCausalLM", dict(
        COMMON, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False, rope_theta=1000000.0),
        torch.bfloat16, dict(shard="60KB")),
    # Qwen1.5/2-MoE: 3 layers, the middle one dense (mlp_only_layers), 4 experts top-2 not renormalised, a shared
    # expert scaled by sigmoid(shared_expert_gate), QKV bias.
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(
        COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[1], qkv_bias=True, use_sliding_window=False,
        tie_word_embeddings=False, rope_theta=1000000.0), torch.bfloat16, {}),
    # Qwen3-MoE: per-head RMSNorm of q and k (weights [head_dim]), head_dim 32 != hidden / heads, 8 experts top-2
    # renormalised, no shared expert.
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(
        COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1000000.0),
        torch.bfloat16, {}),
    # OLMoE: RMSNorm over the whole q and k projections (weights [heads * head_dim], [kv_heads * head_dim]), not per
    # head; 6 experts top-2 not renormalised; GQA 4/2 (OLMoE itself is MHA) so the two norm widths differ; fp32.
    "olmoe": ("OlmoeForCausalLM", dict(
        COMMON, num_attention_heads=4, num_key_value_heads=2, intermediate_size=8, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False, rope_theta=10000.0,
        pad_token_id=None, eos_token_id=0), torch.float32, {}),
    # DeepSeek-V2: MLA without q LoRA (as V2-Lite), interleaved RoPE on the rope dims; layer 0 dense; 8 experts in
    # 4 groups, softmax, group-limited greedy (best expert per group picks 2 groups) top-3, not renormalised,
    # routed_scaling_factor 2; 2 shared experts. Router weight kept fp32 as transformers keeps it.
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(
        COMMON, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=16, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        norm_topk_prob=False, routed_scaling_factor=2.0, first_k_dense_replace=1, tie_word_embeddings=False,
        rope_theta=10000.0), torch.bfloat16, {}),
    # DeepSeek-V3: MLA with q LoRA, interleaved RoPE, YaRN (factor 4 over 32 original positions; mscale and
    # mscale_all_dim differ so both the cos/sin factor and the softmax-scale factor are != 1), legacy rope keys;
    # 3 layers, layer 0 dense; 8 experts in 4 groups, sigmoid scores + random e_score_correction_bias for the choice
    # (group score = sum of its best 2), 2 groups, top-3, renormalised, routed_scaling_factor 2.5; 1 shared expert;
    # no MTP layer. Router weight and bias kept fp32 as transformers keeps them, the rest bf16.
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        COMMON, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=3, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, first_k_dense_replace=1, num_mtp_layers=0, tie_word_embeddings=False,
        rope_theta=10000.0, rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                              beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)),
        torch.bfloat16, dict(legacy_rope=True)),
}


def randomize(model, seed: int):
    """Every parameter random (HF init leaves biases at zero and norms at one, which would hide mapping bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_norm = p.ndim == 1 and ("norm" in name or ".ln_" in name)
            p.copy_(1.0 + 0.1 * noise if is_norm and name.endswith("weight") else 0.08 * noise)
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias is a (saved) buffer, zero at init
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def keep_fp32(model):
    """Puts back in fp32 what transformers keeps there whatever the dtype (DeepSeek's router), as its saves do."""
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    for module_name, module in model.named_modules():
        for tensor_name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if any(f"{module_name}.{tensor_name}".endswith("." + k) for k in keep):
                t.data = t.data.float()


def reference(model, tokens):
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens).long(), labels=torch.from_numpy(tokens).long())
    return out.logits.float().numpy(), float(out.loss)


def moe_gates(model) -> dict:
    """{layer index: router module} of the decoder layers whose MLP is a mixture of experts."""
    layers = getattr(model.base_model, "layers", [])  # GPT-2 names its blocks `h` (and has no experts)
    return {i: layer.mlp.gate for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")}


def reference_with_routing(model, tokens):
    """`reference` plus {MoE layer: (router logits [B*T, E], top-k weights [B*T, k], top-k ids [B*T, k])}."""
    captured = {}
    hooks = [gate.register_forward_hook(lambda module, args, out, i=i: captured.__setitem__(i, out))
             for i, gate in moe_gates(model).items()]
    try:
        logits, loss = reference(model, tokens)
    finally:
        for hook in hooks:
            hook.remove()
    routing = {i: (out[0].float().numpy(), out[1].float().numpy(), out[2].numpy()) for i, out in captured.items()}
    return logits, loss, dict(sorted(routing.items()))


def route(config, router_logits, bias=None, n_group=None):
    """NumPy (float64) restatement of a family's routing rule: (ids [N, k] ascending, their weights, margin).

    margin: the smallest gap over tokens between the last choice score taken and the best one left out (and, with
    groups, between the last group kept and the best one dropped), i.e. how far float noise is from a flip. A
    softmax router chooses by its logits (same order as the probabilities), where the float noise is.
    """
    n, experts = router_logits.shape
    k, logits = config.num_experts_per_tok, router_logits.astype(np.float64)
    sigmoid_scoring = config.model_type == "deepseek_v3"  # V3: sigmoid, bias only in the choice; else softmax
    if sigmoid_scoring:
        scores = 1.0 / (1.0 + np.exp(-logits))
        choice = scores + (0.0 if bias is None else bias)
    else:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        choice = logits
    margins = []
    grouped = sigmoid_scoring or getattr(config, "topk_method", None) == "group_limited_greedy"
    n_group = n_group or getattr(config, "n_group", None) or 1
    if grouped and n_group > 1:
        by_group = choice.reshape(n, n_group, experts // n_group)
        # V3 ranks a group by the sum of its best 2 choice scores, V2 by its best score.
        group_score = np.sort(by_group, -1)[..., -2:].sum(-1) if sigmoid_scoring else by_group.max(-1)
        ranked = np.sort(group_score, -1)[:, ::-1]
        margins.append(ranked[:, config.topk_group - 1] - ranked[:, config.topk_group])
        kept = group_score >= ranked[:, config.topk_group - 1:config.topk_group]  # [N, groups]
        choice = np.where(np.repeat(kept, experts // n_group, -1), choice, -np.inf)
    order = np.argsort(-choice, -1)
    ranked = np.take_along_axis(choice, order, -1)
    margins.append(ranked[:, k - 1] - ranked[:, k])
    ids = np.sort(order[:, :k], -1)
    weights = np.take_along_axis(scores, ids, -1)
    if config.model_type == "mixtral" or config.norm_topk_prob:  # Mixtral always renormalises over the top-k
        weights /= weights.sum(-1, keepdims=True)
    weights *= getattr(config, "routed_scaling_factor", 1.0)
    return ids, weights, float(np.min(margins))


def check_routing(name: str, model, routing: dict) -> dict:
    """Asserts HF's routing is `route`'s, uses every expert and has no near-tie; returns the arrays to save."""
    config, gates = model.config, moe_gates(model)
    saved = dict(router_layers=[], router_logits=[], router_ids=[], router_weights=[])
    for layer, (logits, weights, ids) in routing.items():
        bias = getattr(gates[layer], "e_score_correction_bias", None)
        bias = None if bias is None else bias.double().numpy()
        want_ids, want_weights, margin = route(config, logits, bias)
        order = np.argsort(ids, -1)
        ids, weights = np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)
        assert np.array_equal(ids, want_ids), f"{name} layer {layer}: HF routing differs from `route`"
        err = float(np.abs(weights - want_weights).max())
        assert err < 1e-5, f"{name} layer {layer}: router weights differ from `route` by {err:.3g}"
        used = np.unique(ids).size
        assert used == logits.shape[1], f"{name} layer {layer}: only {used}/{logits.shape[1]} experts chosen"
        # fp32 router logits differ from float64 ones by ~2e-6 here: a choice 50x closer than that could flip.
        assert margin > 1e-4, f"{name} layer {layer}: a routing choice is a near-tie (margin {margin:.3g})"
        if bias is not None:  # the correction bias must change some choice, or a converter dropping it passes
            assert not np.array_equal(route(config, logits, 0.0 * bias)[0], ids), f"{name}: bias changes nothing"
        if getattr(config, "n_group", None) and config.n_group > 1:
            assert not np.array_equal(route(config, logits, bias, n_group=1)[0], ids), f"{name}: groups change nothing"
        print(f"{name} layer {layer}: {used} experts used, routing margin {margin:.2g}, weights vs float64 {err:.2g}")
        for key, value in zip(saved, (layer, logits, ids, weights)):
            saved[key].append(value)
    return dict(router_layers=np.array(saved["router_layers"], np.int32),
                router_logits=np.stack(saved["router_logits"]).astype(np.float32),
                router_ids=np.stack(saved["router_ids"]).astype(np.int32),
                router_weights=np.stack(saved["router_weights"]).astype(np.float32))


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
    keep_fp32(model)
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
    reloaded = cls.from_pretrained(out, **EAGER).eval()
    saved = model.float().state_dict()
    for pname, p in reloaded.state_dict().items():
        assert torch.equal(p, saved[pname]), f"{name}: {pname} changed through save/load"
    rope = getattr(config, "rope_parameters", None)
    assert getattr(reloaded.config, "rope_parameters", None) == rope, f"{name}: RoPE changed through save/load"
    logits, loss, routing = reference_with_routing(reloaded, tokens)
    extra = check_routing(name, reloaded, routing) if routing else {}
    np.savez_compressed(out / "reference.npz", tokens=tokens, logits=logits, loss=np.float32(loss), **extra)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name:16s} {arch:20s} {str(dtype):15s} loss {loss:.4f}  {size / 1024:.0f} KiB")


def check_export(directory: str, fixture: str):
    ref = np.load(Path(fixture) / "reference.npz")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, **EAGER, output_loading_info=True)
    problems = {kind: sorted(map(str, keys)) for kind, keys in info.items() if keys}
    if problems:  # transformers would run with random weights in place of the missing ones
        raise SystemExit(f"{directory}: transformers does not load it cleanly: {problems}")
    want = json.loads((Path(fixture) / "config.json").read_text())["architectures"][0]
    if type(model).__name__ != want:
        raise SystemExit(f"{directory}: loads as {type(model).__name__}, the fixture is a {want}")
    logits, loss, routing = reference_with_routing(model.eval(), ref["tokens"])
    want_routing = zip(ref["router_layers"], ref["router_ids"]) if "router_ids" in ref else []
    for layer, want_ids in want_routing:
        if int(layer) not in routing:
            raise SystemExit(f"{directory}: layer {layer} is not a mixture of experts, as it is in {fixture}")
        ids = np.sort(routing[int(layer)][2], -1)
        print(f"  layer {layer}: {int((ids != want_ids).any(-1).sum())}/{len(ids)} tokens routed differently")
    err = float(np.abs(logits - ref["logits"]).max())
    print(f"{directory}: {type(model).__name__} max |logits - reference| = {err:.3g}, "
          f"loss {loss:.6f} vs {float(ref['loss']):.6f}")
    if err > 1e-4:
        raise SystemExit(1)


flags.DEFINE_list("only", [], "Fixture names to rebuild (default: all).")
flags.DEFINE_string("check_export", None, "An HF directory to load with transformers and compare.")
flags.DEFINE_string("reference", None, "With --check_export: the fixture directory holding reference.npz.")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.check_export:
        return check_export(FLAGS.check_export, FLAGS.reference)
    for i, name in enumerate(FIXTURES):
        if not FLAGS.only or name in FLAGS.only:
            build(name, seed=1000 + i)
    total = sum(f.stat().st_size for f in ROOT.rglob("*") if f.is_file())
    print(f"total {total / 1024:.0f} KiB under {ROOT}")


if __name__ == "__main__":
    app.run(main)
