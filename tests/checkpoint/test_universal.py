"""toolkit.checkpoint.universal: which universal checkpoint to load, and the fix when there is none."""

import pytest

from toolkit.checkpoint.universal import universal_tag
from toolkit.errors import CheckpointError


def test_the_tag_given_or_the_one_latest_universal_names(tmp_path):
    (tmp_path / "step4_universal" / "zero").mkdir(parents=True)
    (tmp_path / "latest_universal").write_text("step4_universal\n")
    assert universal_tag(str(tmp_path), None) == "step4_universal"
    assert universal_tag(str(tmp_path), "step4_universal") == "step4_universal"


def test_no_tag_and_no_pointer_asks_for_the_tag(tmp_path):
    with pytest.raises(CheckpointError, match=r"no tag was given and .*latest_universal does not exist; "
                                              r"pass the tag of the ds_to_universal output folder"):
        universal_tag(str(tmp_path), None)


def test_a_bad_pointer_is_named_with_its_problem(tmp_path):
    (tmp_path / "latest_universal").write_text("../escape")
    with pytest.raises(CheckpointError, match=r"latest_universal does not hold a valid tag name"):
        universal_tag(str(tmp_path), None)


def test_a_folder_without_zero_gives_the_ds_to_universal_command(tmp_path):
    (tmp_path / "step4").mkdir()
    folder = tmp_path / "step4"
    with pytest.raises(CheckpointError, match=(
            rf"{folder} is not a universal checkpoint \(no zero/ folder\); make one with "
            rf"`python -m deepspeed.checkpoint.ds_to_universal --input_folder {folder} "
            rf"--output_folder {folder}_universal --inject_missing_state`")):
        universal_tag(str(tmp_path), "step4")
