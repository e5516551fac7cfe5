"""A rough time left for people (toolkit.launch.progress), shared by dsat's and toolkit.run's progress
lines: the mean trial over the slots, with the trials still running counted. Pure."""

from toolkit.launch.progress import format_duration, remaining_text, time_left


def test_time_left_is_the_mean_trial_over_the_slots_and_says_so_for_people():
    assert time_left([], remaining=3, concurrency=1) is None
    assert time_left([10.0, 30.0], remaining=3, concurrency=2, running=[5.0, 40.0]) == (60 + 15) / 2
    assert [format_duration(s) for s in (3, 89.6, 90, 5399, 5400)] == [
        "3 s", "90 s", "1.5 min", "90.0 min", "1.5 h"]
    assert remaining_text([60.0], remaining=1, concurrency=1) == "up to 1 more trial, about 60 s left"
