"""Pipeline stage layouts (mjax/config/pipeline_layout.py) against hand-counted Megatron splits: the layout string's
syntax, the layers of every (virtual) stage for each flag, the tables that move stored layers to their slots
(mjax/parallel/pipeline_placement.py), and one clear error naming the flag for every split that does not add up."""

import re

import numpy as np
import pytest

from mjax.config import ConfigError, load_config
from mjax.config.pipeline_layout import parse_layout, stage_layout
from mjax.config.sections import ParallelConfig
from mjax.config.validate import validate
from mjax.parallel.pipeline_placement import _block_tables, needs_placement, placement


@pytest.mark.parametrize("text, stages", [
    ("E|tt|tt|L", ["E", "tt", "tt", "L"]),
    ("Et*3|(tt|)*2,t|L", ["Ettt", "tt", "tt", "t", "L"]),  # Megatron's docs example, shortened; "," is cosmetic
    ("E((t|)*2t|)*2L", ["Et", "t", "t", "t", "t", "t", "L"]),  # groups nest
    ("E|*2tL", ["E", "", "tL"]),  # empty stages
    ("Ett|(|)*0ttL", ["Ett", "ttL"]),
])
def test_layout_string_reads_as_megatron_writes_it(text, stages):
    assert parse_layout(text) == [list(s) for s in stages]


SPLITS = [  # (flags, num_layers, layers of each virtual stage v = c pp + s), counted by hand from Megatron's rules
    (dict(pp=4, vpp=2), 16, (2,) * 8),
    (dict(pp=2, decoder_first_pipeline_num_layers=3), 7, (3, 4)),
    (dict(pp=4, decoder_last_pipeline_num_layers=1), 7, (2, 2, 2, 1)),
    (dict(pp=4, decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=2), 10, (2, 3, 3, 2)),
    # device 0 holds 2 layers, device 1 holds 4, each split over 2 chunks: v0 = (s0, c0), v1 = (s1, c0), ...
    (dict(pp=2, vpp=2, decoder_first_pipeline_num_layers=2), 6, (1, 2, 1, 2)),
    (dict(pp=1, decoder_first_pipeline_num_layers=5), 5, (5,)),
    (dict(pp=2, account_for_embedding_in_pipeline_split=True), 7, (3, 4)),
    (dict(pp=4, account_for_loss_in_pipeline_split=True), 7, (2, 2, 2, 1)),
    (dict(pp=4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True), 6,
     (1, 2, 2, 1)),
    (dict(pp=2, vpp=2, account_for_embedding_in_pipeline_split=True), 7, (1, 2, 2, 2)),
    (dict(pp=4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True), 2,
     (0, 1, 1, 0)),
    (dict(pp=4, pipeline_model_parallel_layout="E|ttt|tttt|L"), 7, (0, 3, 4, 0)),
    (dict(pp=2, vpp=2, pipeline_model_parallel_layout="Et|tt|tt|ttL"), 7, (1, 2, 2, 2)),
    (dict(pp=2, vpp=2, pipeline_model_parallel_layout="Ett|ttt||tL"), 6, (2, 3, 0, 1)),
    (dict(pp=2, pipeline_model_parallel_layout="Ettt|tmmL"), 4, (3, 1)),  # the m's (MTP depths) hold no layer
]


@pytest.mark.parametrize("flags, num_layers, counts", SPLITS)
def test_each_flag_gives_megatrons_split(flags, num_layers, counts):
    layout = stage_layout(ParallelConfig(**flags), num_layers)
    assert layout.counts == counts
    # Layers are numbered in virtual-stage order, every layer exactly once.
    held = [i for v in range(len(counts)) for i in layout.layers(v % layout.pp, v // layout.pp)]
    assert held == list(range(num_layers))


def test_interleaved_uneven_chunks_hold_megatrons_layer_ids():
    """Megatron's offsets for pp2 vpp2 with 2 layers on device 0 (get_transformer_layer_offset): device 0 runs
    layers [0] and [3], device 1 runs [1, 2] and [4, 5]."""
    layout = stage_layout(ParallelConfig(pp=2, vpp=2, decoder_first_pipeline_num_layers=2), 6)
    assert [list(layout.layers(s, c)) for s in range(2) for c in range(2)] == [[0], [3], [1, 2], [4, 5]]
    assert max(layout.counts) == 2 and not layout.even


def test_placement_tables_move_every_stored_layer_to_its_slot_once():
    """Dense model, 8 layers over pp4 as "E|tttt|tttt|L": slots per device 4, devices 0 and 3 run only masked slots.
    Stored blocks of 2 layers: device 1 gets layers 0, 1 from device 0 and keeps 2, 3; device 2 keeps 4, 5."""
    layout = stage_layout(ParallelConfig(pp=4, pipeline_model_parallel_layout="E|tttt|tttt|L"), 8)
    plan = placement(layout, (False,) * 8)
    np.testing.assert_array_equal(plan.sources["layers"], [[-1] * 4, [0, 1, 2, 3], [4, 5, 6, 7], [-1] * 4])
    np.testing.assert_array_equal(plan.real[:, 0], [[False] * 4, [True] * 4, [True] * 4, [False] * 4])
    send, take = _block_tables(plan.sources["layers"], 2, 4)
    assert send.shape == (4, 4, 2)  # at most 2 layers between any pair of devices
    pool = lambda s: [2 * s, 2 * s + 1] + [int(send[d, s, k]) + 2 * d for d in range(4) for k in range(2)]  # noqa
    for s in range(4):  # each real slot finds its stored layer in the pool [own block, what each device sent]
        for q, i in enumerate(plan.sources["layers"][s]):
            if i >= 0:
                assert pool(s)[take[s, q]] == i


def test_moe_slots_follow_the_models_first_layers():
    """An MoE model whose layers alternate dense / MoE from layer 0 (--moe_layer_freq=2), 6 layers as pp2 (2, 4):
    slot j has layer j's kind, so each device holds 2 dense and 2 MoE slots, and device 0's second pair is masked."""
    pattern = (False, True) * 3
    plan = placement(stage_layout(ParallelConfig(pp=2, decoder_first_pipeline_num_layers=2), 6), pattern)
    np.testing.assert_array_equal(plan.sources["layers"], [[0, -1], [1, 2]])  # index in the dense stack
    np.testing.assert_array_equal(plan.sources["moe_layers"], [[0, -1], [1, 2]])


ERRORS = [
    (dict(pp=3, decoder_first_pipeline_num_layers=3), 8, "decoder_first_pipeline_num_layers=3 leaves 5 .* not split "
     "evenly over the other 2"),
    (dict(pp=2, decoder_first_pipeline_num_layers=0), 4, "decoder_first_pipeline_num_layers=0 must be positive"),
    (dict(pp=2, vpp=2, decoder_first_pipeline_num_layers=3), 8, "=3 is not divisible by --vpp=2"),
    (dict(pp=2, decoder_first_pipeline_num_layers=7), 7, "leaves 0 of the --model.num_layers=7 layers for the 1 other"),
    (dict(pp=2, decoder_first_pipeline_num_layers=4, decoder_last_pipeline_num_layers=4), 7, "leaves -1"),
    (dict(pp=2, decoder_last_pipeline_num_layers=3, account_for_loss_in_pipeline_split=True), 7,
     "drop --account_for_embedding_in_pipeline_split and --account_for_loss_in_pipeline_split"),
    (dict(pp=2, pipeline_model_parallel_layout="Ett|ttL", decoder_first_pipeline_num_layers=2), 4,
     "places every layer itself; drop --decoder_first_pipeline_num_layers"),
    (dict(pp=2, account_for_embedding_in_pipeline_split=True), 6, "account_for_embedding_in_pipeline_split: "
     "--model.num_layers=6 \\+ 1 = 7 is not divisible by --pp=2"),
    (dict(pp=3), 4, "num_layers=4 is not divisible by --pp=3 x --vpp=1"),
    (dict(pp=2, pipeline_model_parallel_layout="E|tx|L"), 2, "cannot read 'x'"),
    # Megatron may put the MTP depths in a stage of their own; mjax runs them with the loss
    (dict(pp=2, pipeline_model_parallel_layout="Etm|tL"), 2, "the multi-token-prediction depths m run where the loss"),
    (dict(pp=2, vpp=2, pipeline_model_parallel_layout="Et|t|t|mtL"), 4, "go together at the end of the last stage"),
    (dict(pp=2, pipeline_model_parallel_layout="E(tt|ttL"), 4, "cannot read '\\('.*repeat count"),
    (dict(pp=2, pipeline_model_parallel_layout="Et|t|tL"), 3, "has 3 stages, not a multiple of --pp=2"),
    (dict(pp=2, pipeline_model_parallel_layout="Et|tt|tt|ttL"), 7, "= --pp=2 x 2 virtual stages per device; set "
     "--vpp=2"),
    (dict(pp=2, pipeline_model_parallel_layout="tE|tL"), 2, "the embedding E must be there once, first"),
    (dict(pp=2, pipeline_model_parallel_layout="Et|Lt"), 2, "the loss L must be there once, last"),
    (dict(pp=2, pipeline_model_parallel_layout="Et|ttL"), 4, "places 3 transformer layers \\(t\\), and "
     "--model.num_layers=4"),
]


@pytest.mark.parametrize("flags, num_layers, message", ERRORS)
def test_a_split_that_does_not_add_up_names_the_flag(flags, num_layers, message):
    with pytest.raises(ConfigError, match=message):
        stage_layout(ParallelConfig(**flags), num_layers)


def test_validation_runs_the_split_and_takes_stages_of_any_dense_moe_pattern():
    tiny = load_config("tiny")
    with pytest.raises(ConfigError, match=re.escape("pipeline_model_parallel_layout='E|tt|L' has 3 stages")):
        validate(tiny.replace(parallel=dict(pp=2, pipeline_model_parallel_layout="E|tt|L")))
    validate(tiny.replace(model=dict(num_layers=7), parallel=dict(pp=2, decoder_first_pipeline_num_layers=3)))
    moe = dict(num_layers=4, num_experts=4, moe_router_topk=2, moe_first_dense_layers=1)  # dense, MoE, MoE, MoE
    for parallel in (dict(pp=2), dict(pp=2, decoder_first_pipeline_num_layers=1), dict(pp=2, vpp=2)):
        validate(tiny.replace(model=moe, parallel=parallel))


@pytest.mark.parametrize("flags, pattern, kinds, dense, moe", [
    # DeepSeek's dense first layers: stage 0 D M, stage 1 M M -> slots D M M; device 1 skips the dense slot
    (dict(pp=2), "DMMM", "DMM", [[0], [-1]], [[0, -1], [1, 2]]),
    # dense first layers on their own stage (Megatron's balancing of V3): D D | M M M -> slots D D M M M
    (dict(pp=2, decoder_first_pipeline_num_layers=2), "DDMMM", "DDMMM", [[0, 1], [-1, -1]], [[-1] * 3, [0, 1, 2]]),
    # interleaved chunks v = c pp + s: (0, 0) D M, (1, 0) M M, (0, 1) M M, (1, 1) M M
    (dict(pp=2, vpp=2), "DMMMMMMM", "DMM", [[0, -1], [-1, -1]], [[0, -1, 3, 4], [1, 2, 5, 6]]),
])
def test_stages_of_different_dense_moe_patterns_share_one_slot_sequence(flags, pattern, kinds, dense, moe):
    """The slots are a common supersequence of the stages' kinds (shortest for these patterns); each stage's layers take the first slots of
    their kind in order, the others are skipped (-1). sources: each slot's index in its stack (dense / MoE)."""
    layout = stage_layout(ParallelConfig(**flags), len(pattern))
    plan = placement(layout, tuple(k == "M" for k in pattern))
    assert "".join("M" if k else "D" for k in plan.kinds) == kinds
    np.testing.assert_array_equal(plan.sources["layers"], dense)
    np.testing.assert_array_equal(plan.sources["moe_layers"], moe)
    assert needs_placement(layout, tuple(k == "M" for k in pattern))
    assert needs_placement(layout, (True,) * len(pattern)) == (not layout.even)  # all-MoE: only uneven stages


def test_megatron_spellings_of_the_layout_flags_reach_the_config():
    from absl import flags  # noqa: PLC0415

    from mjax.cli.common import parse_flags  # noqa: PLC0415
    from mjax.config.flags import config_from_flags, define_config_flags  # noqa: PLC0415

    define_config_flags()
    try:
        for argv, want in (
                (["--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers=2"],
                 dict(decoder_first_pipeline_num_layers=3, decoder_last_pipeline_num_layers=2)),
                (["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"],
                 dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)),
                (["--pipeline-model-parallel-layout", "Et*3|(tt|)*2,t|L"],
                 dict(pipeline_model_parallel_layout="Et*3|(tt|)*2,t|L"))):
            flags.FLAGS.unparse_flags()
            parse_flags(["prog", "--pipeline-model-parallel-size", "2", *argv])
            p = config_from_flags().parallel
            assert {k: getattr(p, k) for k in want} == want
    finally:
        flags.FLAGS.unparse_flags()
