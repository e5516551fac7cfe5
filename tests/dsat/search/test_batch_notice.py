"""The global batch the user's config implies, against the best config's (issue 26 item 3): pure logic."""

from __future__ import annotations

import shlex

import pytest

from toolkit.dsat.search.batch import (
    GlobalBatch,
    global_batch_change,
    implied_global_batch,
    rerun_command,
)

MBS, GAS, TBS = "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"
ARGV = ["binary", "deepspeed.yaml", ".", "--max-trials", "8"]


@pytest.mark.parametrize("config, dp, implied", [
    ({MBS: 8}, 2, 16),                       # HelloDeepSpeed's: micro-batch x 1 x dp
    ({MBS: 4, GAS: 2}, 2, 16),
    ({MBS: 4, GAS: "auto"}, 3, 12),          # accumulation "auto" is 1, as dsat's trials take it
    ({TBS: 64, MBS: 4, GAS: 8}, 2, 64),      # an integer train_batch_size is the batch
    ({TBS: 64}, 4, 64),
    ({TBS: "auto", MBS: 2}, 2, 4),
    ({TBS: "auto", MBS: "auto"}, 2, None),   # implies none
    ({MBS: True}, 2, None),                  # a bool is not a micro-batch
    ({GAS: 4}, 2, None),
])
def test_what_the_users_config_implies(config, dp, implied):
    assert implied_global_batch(config, data_parallel_size=dp) == implied


def test_the_rerun_command_sets_the_batch_and_a_new_output_dir():
    def rerun(*args):
        return shlex.split(rerun_command(list(args), global_batch="16", output_dir="/o/ut-batch16"))[3:]

    tail = ["--global-batch", "16", "--output-dir", "/o/ut-batch16"]
    assert rerun(*ARGV) == ARGV + tail
    # the given ones replaced, however written (argparse takes unambiguous prefixes); --resume dropped
    assert rerun(*ARGV, "--global-batch", "free", "--output-dir", "/o/ut") == ARGV + tail
    assert rerun(*ARGV, "--global-batch=free", "--output-dir=/o/ut", "--resume") == ARGV + tail
    assert rerun(*ARGV, "--glob", "free", "--out", "/o/ut", "--res") == ARGV + tail
    assert rerun("binary", "my exp.yaml", ".", "--offload", "never") == \
        ["binary", "my exp.yaml", ".", "--offload", "never"] + tail
    assert rerun_command(["random", "d.yaml", "."], global_batch="keep", output_dir="o").startswith(
        "python -m toolkit.dsat random d.yaml . --global-batch keep")


def test_free_with_only_a_micro_batch_says_old_new_factor_and_the_command():
    # The HelloDeepSpeed port's best: 1090 samples per step where its config implies 8 x 1 x 2 = 16.
    change = global_batch_change({MBS: 8}, {TBS: 1090, MBS: 545, GAS: 1}, policy=GlobalBatch("free"),
                                 data_parallel_size=2, argv=ARGV + ["--global-batch", "free"],
                                 output_dir="/runs/dsat_output")
    assert (change.user, change.best, change.changed) == (16, 1090, True)
    assert change.factor == pytest.approx(68.125)
    notice = change.notice()
    assert notice is not None and "\n" not in notice  # one line: the last the run prints
    assert notice.startswith("global batch changed from 16 to 1090 samples per step (68.1x; ")
    assert "micro-batch 545 x gradient_accumulation_steps 1 x data-parallel size 2, --global-batch free" \
        in notice
    command = ("python -m toolkit.dsat binary deepspeed.yaml . --max-trials 8 --global-batch 16 "
               "--output-dir /runs/dsat_output-batch16")
    assert notice.endswith(f"To tune within 16: {command}")
    recorded = change.to_json()
    assert recorded == {"user_train_batch_size": 16, "factor": 68.125, "changed": True, "notice": notice,
                        "command": command}


def test_a_smaller_batch_and_an_integer_train_batch_size_to_keep():
    # --global-batch free on a config that sets train_batch_size 64: the command keeps it by name.
    change = global_batch_change({TBS: 64, MBS: 4, GAS: 8}, {TBS: 8, MBS: 4, GAS: 1},
                                 policy=GlobalBatch("free"), data_parallel_size=2, argv=ARGV, output_dir="o")
    assert change.factor == 0.125
    notice = change.notice()
    assert notice is not None and "from 64 to 8 samples per step (0.125x; " in notice
    assert notice.endswith("--global-batch keep --output-dir o-batch64")
    # --global-batch 32 (fixed) against the 16 the config implies: said too, with the flag that chose it
    fixed = global_batch_change({MBS: 8}, {TBS: 32, MBS: 4, GAS: 4}, policy=GlobalBatch("fixed", 32),
                                data_parallel_size=2, argv=ARGV, output_dir="o")
    assert "from 16 to 32 samples per step (2x; 32 = micro-batch 4 x gradient_accumulation_steps 4 x " \
           "data-parallel size 2, --global-batch 32;" in (fixed.notice() or "")


def test_no_notice_when_the_batch_is_the_users():
    keep = global_batch_change({TBS: 64, MBS: 4, GAS: 8}, {TBS: 64, MBS: 16, GAS: 2},
                               policy=GlobalBatch("keep", 64), data_parallel_size=2, argv=ARGV,
                               output_dir="o")
    assert not keep.changed and keep.notice() is None
    assert keep.to_json() == {"user_train_batch_size": 64, "factor": 1.0, "changed": False, "notice": None,
                              "command": None}
    # free, and the best happens to run the user's own micro-batch and accumulation
    same = global_batch_change({MBS: 8}, {TBS: 16, MBS: 8, GAS: 1}, policy=GlobalBatch("free"),
                               data_parallel_size=2, argv=ARGV, output_dir="o")
    assert same.notice() is None


def test_a_config_that_implies_no_batch_still_hears_the_best_ones():
    change = global_batch_change({TBS: "auto", MBS: "auto"}, {TBS: 12, MBS: 6, GAS: 1},
                                 policy=GlobalBatch("free"), data_parallel_size=2, argv=ARGV, output_dir="o")
    assert change.user is None and change.factor is None and change.command is None and not change.changed
    assert change.notice() == (
        "global batch: the best config trains with train_batch_size 12 = micro-batch 6 x "
        "gradient_accumulation_steps 1 x data-parallel size 2, --global-batch free; your DeepSpeed config "
        "implies none (no integer train_batch_size or train_micro_batch_size_per_gpu)")


def test_the_first_line_of_a_free_search_names_the_implied_batch():
    assert GlobalBatch("free").describe(16).endswith(
        "the learning rate may need retuning; your config implies 16, which --global-batch 16 keeps)")
    assert GlobalBatch("free").describe().endswith("the learning rate may need retuning)")
    assert GlobalBatch("keep", 64).describe(64).startswith("global batch: keep train_batch_size=64")
