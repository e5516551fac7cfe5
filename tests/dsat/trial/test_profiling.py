"""toolkit.dsat.trial.profiling: the pure parts of a trial's memory profile (outputs' bytes, the
ranks' profiles merged) and the resident size where /proc has no such field."""

import resource

import torch

from toolkit.dsat.trial import profiling
from toolkit.dsat.trial.profiling import merge_profiles, rss_bytes


def test_output_bytes_counts_each_storage_once_through_lists_tuples_and_dicts():
    a = torch.zeros(4, 8)             # 128 bytes
    b = torch.zeros(3, dtype=torch.float64)  # 24 bytes
    view = a[1:]                      # a's storage again
    meta = torch.empty(1000, device="meta")  # no memory
    output = {"logits": a, "extra": [b, (view, meta)], "loss": 3.0, "name": "x"}
    seen: set[int] = set()
    assert profiling._output_bytes(output, seen) == 128 + 24
    assert profiling._output_bytes([a, b], seen) == 0  # already counted in this step
    assert profiling._output_bytes(None, set()) == 0


def test_rss_bytes_of_a_field_proc_lacks_is_the_peak_from_getrusage():
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert rss_bytes("NoSuchField") >= peak
    assert 0 < rss_bytes("VmRSS") <= rss_bytes("VmHWM")


def test_merged_profiles_take_the_largest_needs_and_the_smallest_slot():
    assert merge_profiles([]) is None and merge_profiles([None, None]) is None
    one = {"num_params": 10, "trainable_params": 10, "activation_bytes_per_example": 5, "baseline_bytes": 100,
           "peak_bytes": 900, "memory_per_slot": 4000, "device": "cpu"}
    two = dict(one, activation_bytes_per_example=7, peak_bytes=800, memory_per_slot=3000,
               startup_peak_bytes=50)
    merged = merge_profiles([one, None, two])
    assert merged == dict(one, activation_bytes_per_example=7, peak_bytes=900, memory_per_slot=3000,
                          startup_peak_bytes=50)
    assert "startup_peak_bytes" not in one  # the inputs are left as they were
