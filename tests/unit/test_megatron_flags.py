"""Megatron-LM's command-line spellings reach the same Config as mjax's own flags; a bad flag is one line, exit 2."""

import pytest
from absl import flags

from mjax.cli.common import parse_flags
from mjax.config.flags import config_from_flags, define_config_flags
from mjax.config.megatron import translate

FLAGS = flags.FLAGS


@pytest.fixture
def parse():
    """argv (without the program name) -> the Config the command line gives; absl's global flags are reset after."""
    define_config_flags()

    def run(*argv):
        FLAGS.unparse_flags()
        parse_flags(["prog", *argv])
        return config_from_flags()

    yield run
    FLAGS.unparse_flags()


@pytest.mark.parametrize("argv", [["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size=2"]])
def test_tensor_parallel_size_both_spellings(parse, argv):
    assert parse(*argv).parallel.tp == 2


def test_megatron_parallel_and_model_flags(parse):
    cfg = parse("--pipeline-model-parallel-size", "2", "--num-layers", "3", "--recompute-activations",
                "--normalization", "LayerNorm", "--context-parallel-size=1", "--tensor-model-parallel-size", "2")
    assert (cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.cp) == (2, 2, 1)
    assert cfg.model.num_layers == 3
    assert cfg.execution.remat_policy == "selective"
    assert cfg.model.normalization == "layernorm"


def test_recompute_granularity_full(parse):
    assert parse("--recompute-granularity", "full").execution.remat_policy == "full"


def test_data_path_takes_every_value_up_to_the_next_flag(parse):
    cfg = parse("--data-path", "0.3", "a", "0.7", "b", "--train-iters", "5")
    assert cfg.data.data_path == ("0.3", "a", "0.7", "b")
    assert cfg.train.train_iters == 5


def test_switches_of_a_gpt2_style_model(parse):
    gpt2 = parse("--config=gpt2")
    assert (gpt2.model.activation, gpt2.model.add_bias_linear) == ("gelu", True)  # what the switches change
    cfg = parse("--config=gpt2", "--swiglu", "--disable-bias-linear")
    assert (cfg.model.activation, cfg.model.add_bias_linear) == ("swiglu", False)


def test_no_prefix_turns_an_mjax_boolean_off(parse):
    assert parse().checkpoint.async_save is True
    assert parse("--no-async-save").checkpoint.async_save is False
    assert parse("--no-progress").logging.progress is False


def test_hyphenated_mjax_flags_in_both_forms(parse):
    cfg = parse("--micro-batch-size=2", "--global-batch-size", "8", "--lr-warmup-iters", "3")
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.optimizer.lr_warmup_iters) == (2, 8, 3)


def test_group_query_attention_is_implied_by_num_query_groups(parse, capsys):
    assert parse("--group-query-attention", "--num-query-groups", "2").model.num_query_groups == 2
    assert parse("--group-query-attention", "--model.num_query_groups=2").model.num_query_groups == 2
    with pytest.raises(SystemExit) as e:
        parse("--group-query-attention")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--group-query-attention" in err and "--num_query_groups" in err and err.count("\n") == 1


@pytest.mark.parametrize("flag, named", [("--no-such-flag=3", "no-such-flag"),
                                         ("--use-mcore-models", "use-mcore-models"),  # Megatron, no mjax meaning
                                         ("--train_iter=3", "train_iters")])  # the close mjax flag is suggested
def test_an_unknown_flag_exits_2_with_one_line_naming_it(parse, capsys, flag, named):
    with pytest.raises(SystemExit) as e:
        parse(flag)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1 and "Traceback" not in err


def test_translate_leaves_values_and_mjax_flags_alone():
    is_flag = {"tp", "lr", "data_path", "async_save"}.__contains__
    is_bool = {"async_save"}.__contains__
    argv, implied = translate(["prog", "--lr", "0.1", "--tp=2", "--data-path", "x", "--no-async-save", "rest"],
                              is_flag, is_bool)
    assert argv == ["prog", "--lr", "0.1", "--tp=2", "--data_path=x", "--noasync_save", "rest"]
    assert implied == []
