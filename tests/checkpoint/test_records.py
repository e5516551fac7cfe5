"""Record and pointer parsing (toolkit/checkpoint/records.py): damaged input is a clear error or an
ignored pointer, never a crash or a tag taken from garbage. Pure."""

import pytest

from toolkit.checkpoint import records
from toolkit.errors import CheckpointError


def test_a_record_over_the_bound_or_not_an_object_is_damaged():
    with pytest.raises(CheckpointError, match=r"cannot read s3://b-1/x/run.json: larger than \d+ MiB; the "
                                              "file is damaged"):
        records.parse_record(b" " * (records.MAX_RECORD + 1), "s3://b-1/x/run.json")
    with pytest.raises(CheckpointError, match=r"run.json holds list, expected a JSON object"):
        records.parse_record(b"[1]", "run.json")
    assert records.parse_record(b'{"run_id": "r1"}', "run.json") == {"run_id": "r1"}


@pytest.mark.parametrize("raw, expected", [
    (b"step_3\n", ("step_3", None)),
    (b"", (None, "latest is empty; ignored")),
    (b" \n", (None, "latest is empty; ignored")),
    (b"\xff\xfe", (None, "latest does not hold a valid tag name; ignored")),   # not UTF-8
    (b"../etc", (None, "latest does not hold a valid tag name; ignored")),
])
def test_a_pointer_names_a_safe_tag_or_is_ignored(raw, expected):
    assert records.parse_pointer(raw, "latest") == expected
