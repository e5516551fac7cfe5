"""Determined's checkpoint_storage section (toolkit.config.checkpoint_storage): every problem named by its
key, nothing for what a storage root can be made of; the trial's storage_root raises the same. Pure."""

from pathlib import Path

import pytest

from toolkit.compat.determined.storage import storage_root
from toolkit.config.checkpoint_storage import checkpoint_storage_problems, keep_count_problem
from toolkit.errors import ConfigError

GOOD = [None, "ckpts", "file:///mnt/ckpt", "s3://bucket/exp1", "gs://bucket", {"save_trial_latest": 2},
        {"type": "shared_fs", "host_path": "/mnt", "storage_path": "ckpt"}, {"storage_path": "ckpt"},
        {"type": "directory", "container_path": "/ckpt"}, {"type": "s3", "bucket": "bucket", "prefix": "exp"},
        {"type": "shared_fs", "host_path": "", "storage_path": "ckpt", "save_trial_best": 0}]


@pytest.mark.parametrize("storage", GOOD)
def test_what_a_root_can_be_made_of_has_no_problem(storage):
    assert checkpoint_storage_problems(storage) == []
    storage_root(storage, output_dir=Path("out"), base_dir=Path("base"))


@pytest.mark.parametrize("storage, fragments", [
    ("http://host/x", ["checkpoint_storage='http://host/x': expected a local or shared directory"]),
    ("s3://", ["checkpoint_storage='s3://'"]),
    (5, ["checkpoint_storage=5: expected a path or a mapping"]),
    ({"type": "azure", "container": "c"}, ["checkpoint_storage.type='azure'"]),
    ({"type": "nfs", "host_path": "/x"}, ["checkpoint_storage.type='nfs': expected shared_fs, directory"]),
    ({"type": "directory"}, ["checkpoint_storage.container_path=None: expected a directory path"]),
    ({"type": "shared_fs", "host_path": 5, "storage_path": "x"}, ["checkpoint_storage.host_path=5"]),
    ({"type": "shared_fs"}, ["checkpoint_storage.host_path=None: expected a directory path"]),
    ({"type": "s3"}, ["bucket"]),
    ({"type": "gcs", "bucket": "b"}, ["checkpoint_storage='gs://b': expected gs://BUCKET/PREFIX"]),
    ({"storage_path": "x", "save_trial_latest": -1, "save_trial_best": "2"},
     ["checkpoint_storage.save_trial_latest=-1: expected an integer >= 0",
      "checkpoint_storage.save_trial_best='2': expected an integer >= 0"]),
])
def test_each_problem_names_its_key_and_the_trial_refuses_the_same(storage, fragments):
    problems = checkpoint_storage_problems(storage)
    assert len(problems) >= len(fragments) and all(any(f in p for p in problems) for f in fragments), problems
    with pytest.raises(ConfigError) as err:
        storage_root(storage, output_dir=Path("out"), base_dir=Path("base"))
    assert err.value.problems == problems
    assert keep_count_problem("save_trial_latest", 0) is None
