import json

import pytest
from absl import flags

from mjax.config import Config, ConfigError, from_dict, load_config, preset_names
from mjax.config.flags import config_from_flags, define_config_flags
from mjax.parallel.layout import validate_layout

TINY = load_config("tiny")
MOE = dict(num_experts=4, moe_router_topk=2)


def test_every_preset_loads_and_validates():
    names = preset_names()
    for required in ("tiny", "gpt2", "llama3_2_1b", "llama3_2_3b", "llama3_8b", "llama3_70b", "mistral_7b",
                     "qwen2_5_7b", "mixtral_8x7b", "deepseek_moe_16b"):
        assert required in names
    for name in names:
        validate_layout(load_config(name), 1)
    assert load_config("llama3.2-1b").model.num_query_groups == 8  # dotted names resolve to the same files
    assert load_config("mixtral-8x7b").model.num_experts == 8


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="no such preset.*llama3_8b"):
        load_config("llama9")


@pytest.mark.parametrize("overrides, devices, message", [
    (dict(model=dict(num_attention_heads=3)), 1, "hidden_size=128 is not divisible by --model.num_attention_heads=3"),
    (dict(model=dict(num_query_groups=3)), 1, "not a multiple of --model.num_query_groups=3"),
    (dict(parallel=dict(tp=8)), 8, "num_attention_heads=4 is not divisible by --tp=8"),
    (dict(parallel=dict(fsdp=3)), 8, "cannot be split"),
    (dict(parallel=dict(dp=2)), 8, "but 8 are present"),
    (dict(parallel=dict(pp=3)), 3, "num_layers=4 is not divisible by --pp=3"),
    (dict(train=dict(global_batch_size=12)), 8, "global_batch_size=12 is not divisible by the data-parallel size 8"),
    (dict(train=dict(global_batch_size=16, micro_batch_size=4)), 8, "micro_batch_size=4"),
    (dict(model=dict(activation="relu")), 1, "--model.activation='relu' is not one of"),
    (dict(optimizer=dict(lr_warmup_iters=-1)), 1, "lr_warmup_iters must be >= 0"),
    (dict(optimizer=dict(lr_decay_style="wsd")), 1, "needs --lr_wsd_decay_iters"),
    (dict(optimizer=dict(min_lr=1.0)), 1, "min_lr <= --lr"),
    (dict(precision=dict(compute_dtype="float8")), 1, "compute_dtype"),
    (dict(model=dict(position_embedding_type="learned", max_position_embeddings=64)), 1, "exceeds"),
    (dict(execution=dict(remat_policy="selective", remat_save_names=("qkv_proj", "bogus"))), 1, "bogus"),
    (dict(parallel=dict(tp=2, sequence_parallel=True), train=dict(seq_length=127)), 2, "sequence_parallel"),
    (dict(parallel=dict(ep=2)), 2, "--ep=2 splits the experts of an MoE model, and this model has none"),
    (dict(model=MOE, parallel=dict(ep=3)), 3, "--num_experts=4 is not divisible by --ep=3"),
    (dict(model=MOE, parallel=dict(ep=4, tp=2, expert_tensor_parallel_size=1)), 8,
     r"--num_experts=4 is not divisible by --ep=4 x --tp=2 \(--expert_tensor_parallel_size=1\)"),
    (dict(model=MOE, parallel=dict(ep=2, tp=2, expert_tensor_parallel_size=3)), 4,
     "--expert_tensor_parallel_size=3 must be 1 or --tp=2"),
    (dict(model=MOE, parallel=dict(ep=2, moe_token_dispatcher_type="flex")), 2,
     "--moe_token_dispatcher_type='flex' is not one of"),
    (dict(model=dict(MOE, moe_expert_capacity_factor=1.0), parallel=dict(ep=2, moe_token_dispatcher_type="allgather")),
     2, "--moe_expert_capacity_factor needs --moe_token_dispatcher_type=alltoall"),
    (dict(model=MOE, parallel=dict(ep=2), precision=dict(fp8_recipe="tensorwise")), 2,
     "--fp8_recipe=tensorwise with expert parallelism"),
    (dict(model=MOE, execution=dict(moe_alltoall_impl="nccl")), 1, "--moe_alltoall_impl='nccl' is not one of"),
    (dict(model=MOE, parallel=dict(ep=2, moe_token_dispatcher_type="allgather"),
          execution=dict(moe_alltoall_impl="ragged")), 2, "--moe_token_dispatcher_type=allgather has none"),
    (dict(execution=dict(remat_save_names=("fp8_cast",)), precision=dict(fp8_recipe="blockwise")), 1, "fp8_cast"),
    (dict(execution=dict(remat_save_names=("fp8_cast",))), 1, "fp8_cast"),
    (dict(execution=dict(cross_entropy_impl="fused"), precision=dict(fp4_recipe="nvfp4", quantize_output_layer=True)),
     1,
     "--cross_entropy_impl=reference"),
    (dict(precision=dict(fp8_recipe="bogus"), parallel=dict(pp=2)), 2, "--fp8_recipe='bogus' is not one of"),
    (dict(parallel=dict(cp=2), train=dict(seq_length=126)), 2, r"must be divisible by 2 x --cp = 4"),
    (dict(parallel=dict(cp=2, cp_comm_type="ring")), 2, "--cp_comm_type='ring' is not one of"),
    (dict(model=dict(MOE, moe_expert_capacity_factor=1.0, moe_token_drop_policy="position"), parallel=dict(cp=2)), 2,
     "--moe_token_drop_policy=position with --cp=2"),
    (dict(parallel=dict(cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, 3))), 4,
     r"A x R = --cp=4; got \(2, 3\)"),
    (dict(parallel=dict(cp=2, hierarchical_context_parallel_sizes=(2, 1))), 2, r"is for --cp_comm_type=a2a\+p2p"),
    (dict(parallel=dict(cp=8, cp_comm_type="a2a")), 8, "--num_attention_heads=4 must split over --tp x"),
    (dict(parallel=dict(cp=2, cp_comm_type="all_gather"), execution=dict(attention_impl="cudnn")), 2,
     "use --attention_impl=mosaic or pallas"),
    (dict(execution=dict(attention_impl="cudnn", deterministic_mode=True)), 1,
     "--attention_impl=cudnn with --deterministic_mode"),
    (dict(checkpoint=dict(ckpt_step=3)), 1, "--ckpt_step says what to read from --load"),
    (dict(checkpoint=dict(load_params_only=True)), 1, "--load_params_only says"),
])
def test_validation_errors_name_the_flag(overrides, devices, message):
    with pytest.raises(ConfigError, match=message):
        validate_layout(TINY.replace(**overrides), devices)


def test_kv_heads_fewer_than_tp_are_allowed_when_they_divide_it():
    validate_layout(TINY.replace(parallel=dict(tp=4)), 8)  # 2 KV heads replicated over tp=4


def test_dict_round_trip_and_unknown_fields():
    cfg = TINY.replace(execution=dict(remat_save_names=("norm",)))
    assert from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="unknown field model.layers"):
        TINY.replace(model=dict(layers=3))


def test_a_config_saved_under_earlier_names_reads_under_todays():
    cfg = TINY.replace(model=dict(window_size=64), execution=dict(remat_policy="full"),
                       checkpoint=dict(ckpt_step=3, load="/nonexistent"))
    saved = json.loads(json.dumps(cfg.to_dict()))
    saved["model"]["sliding_window"] = saved["model"].pop("window_size")
    saved["model"]["remat_policy"] = saved["execution"].pop("remat_policy")
    saved["checkpoint"]["load_step"] = saved["checkpoint"].pop("ckpt_step")
    assert from_dict(saved) == cfg
    saved["model"]["window_size"] = 32  # both names of one field: which one wins would be a guess
    with pytest.raises(ConfigError, match="both model.sliding_window and model.window_size"):
        from_dict(saved)


def _parse(argv):
    define_config_flags()
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["prog", *argv])
    try:
        return config_from_flags()
    finally:
        flags.FLAGS.unparse_flags()


def test_flags_override_fields_with_dotted_names_and_aliases(tmp_path):
    cfg = _parse(["--config=tiny", "--model.num_layers=3", "--train_iters=7", "--lr=0.01", "--fp16",
                  "--data_path=0.3 a 0.7 b", "--model.num_query_groups=none", "--execution.scan_layers=false",
                  "--mock_data", "--train_iters=7"])
    assert cfg.model.num_layers == 3 and cfg.train.train_iters == 7 and cfg.optimizer.lr == 0.01
    assert cfg.precision.compute_dtype == "float16"
    assert cfg.data.data_path == ("0.3", "a", "0.7", "b")
    assert cfg.model.num_query_groups is None and cfg.execution.scan_layers is False and cfg.data.mock_data is True
    assert _parse(["--nosequence_parallel"]).parallel.sequence_parallel is False
    path = tmp_path / "c.json"
    path.write_text(json.dumps(Config().replace(train=dict(seed=5)).to_dict()))
    assert _parse([f"--config={path}", "--seed=6"]).train.seed == 6


def test_bad_flag_values_are_config_errors():
    with pytest.raises(ConfigError, match="--train_iters='ten' is not a valid int"):
        _parse(["--train_iters=ten"])
    with pytest.raises(ConfigError, match="set the same field"):
        _parse(["--train_iters=3", "--train.train_iters=4"])
    with pytest.raises(ConfigError, match="choose one"):
        _parse(["--bf16", "--fp16"])


def test_cudnn_attention_is_refused_under_deterministic_ops_from_xla_flags(monkeypatch):
    cudnn = TINY.replace(execution=dict(attention_impl="cudnn"))
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    with pytest.raises(ConfigError, match="--attention_impl=cudnn with deterministic ops in XLA_FLAGS"):
        validate_layout(cudnn, 1)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    try:
        validate_layout(cudnn, 1)
    except ConfigError as e:  # off a GPU, cuDNN is refused for that, not for the flags
        assert "XLA_FLAGS" not in str(e), e
