"""Hosts and slots across machines (toolkit.launch.hosts): hostfile and Slurm parsing, which
hosts are this machine, and where a trial is placed. Pure; no process."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toolkit.errors import ConfigError
from toolkit.launch.hosts import (
    Host,
    expand_slurm_counts,
    expand_slurm_nodelist,
    format_include,
    is_local_host,
    parse_hostfile,
    place_trial,
    read_hostfile,
    slurm_hosts,
)

HOSTFILE = "# two hosts\nworker-0 slots=2\nworker-1 slots=2   # the second\n\n"


# ---------------------------------------------------------------- hostfile
def test_hostfile_is_parsed_like_deepspeed_does():
    from deepspeed.launcher.runner import _parse_hostfile

    hosts = parse_hostfile(HOSTFILE)
    assert hosts == (Host("worker-0", 2), Host("worker-1", 2))
    plain = "worker-0 slots=2\nworker-1 slots=2\n"
    assert dict(_parse_hostfile(plain.splitlines())) == {h.name: h.slots for h in parse_hostfile(plain)}


def test_hostfile_errors_name_the_file_and_every_bad_line(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb slot=3\na slots=1\nc slots=0\nd slots=x\n")
    with pytest.raises(ConfigError) as err:
        read_hostfile(path)
    assert err.value.problems == [
        f"hostfile {path}, line 2: 'b slot=3' is not 'HOSTNAME slots=N' (e.g. 'worker-0 slots=8')",
        f"hostfile {path}, line 3: host 'a' is already given on line 1; give each host once",
        f"hostfile {path}, line 4: slots='0' for 'c'; expected an integer >= 1",
        f"hostfile {path}, line 5: slots='x' for 'd'; expected an integer >= 1"]
    path.write_text("# only a comment\n")
    with pytest.raises(ConfigError, match="no host; expected lines like"):
        read_hostfile(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        read_hostfile(tmp_path / "missing")


# ---------------------------------------------------------------- Slurm (variables only: no Slurm here)
@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("gpu-a[1-2],gpu-b7", ["gpu-a1", "gpu-a2", "gpu-b7"]),
    ("host1,host2", ["host1", "host2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("rack[1-2]-x", ["rack1-x", "rack2-x"]),
])
def test_slurm_nodelist_expansion(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "node[", "node[3-1]", "node[a-b]", "n[1-2"])
def test_bad_slurm_nodelist_is_named(bad):
    with pytest.raises(ConfigError, match="cannot be parsed"):
        expand_slurm_nodelist(bad)


def test_slurm_counts_and_allocation():
    assert expand_slurm_counts("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ConfigError, match="'2\\(3\\)' cannot be parsed"):
        expand_slurm_counts("2(3)")
    env = {"SLURM_JOB_NODELIST": "node[01-03,7]", "SLURM_TASKS_PER_NODE": "2(x3),1",
           "SLURM_JOB_CPUS_PER_NODE": "16(x4)"}
    assert slurm_hosts(env) == (Host("node01", 2), Host("node02", 2), Host("node03", 2), Host("node7", 1))
    assert slurm_hosts({**env, "SLURM_GPUS_PER_NODE": "a100:4"})[0] == Host("node01", 4)
    assert slurm_hosts({"SLURM_JOB_NODELIST": "a,b", "SLURM_JOB_CPUS_PER_NODE": "8(x2)"}) == (Host("a", 8),
                                                                                              Host("b", 8))
    assert slurm_hosts({}) is None
    with pytest.raises(
        ConfigError, match="gives 2 count\\(s\\) but SLURM_JOB_NODELIST='node\\[1-3\\]' names 3"
    ):
        slurm_hosts({"SLURM_JOB_NODELIST": "node[1-3]", "SLURM_TASKS_PER_NODE": "2(x2)"})
    with pytest.raises(ConfigError, match="pass --hostfile instead"):
        slurm_hosts({"SLURM_JOB_NODELIST": "node1"})


def test_local_hosts():
    names = frozenset({"localhost", "box"})
    assert all(is_local_host(h, names=names) for h in ("localhost", "127.0.0.1", "127.0.0.2", "::1", "box"))
    assert not any(is_local_host(h, names=names) for h in ("worker-0", "10.0.0.1", "box2"))
    assert is_local_host(__import__("socket").gethostname())


# ---------------------------------------------------------------- placement
def test_placement_prefers_one_host_then_fewest_hosts():
    free = {"a": (0, 1, 2, 3), "b": (0, 1), "c": (1,)}
    assert place_trial(free, 2) == {"b": (0, 1)}              # the fullest host that fits
    assert place_trial(free, 1) == {"c": (1,)}
    assert place_trial(free, 4) == {"a": (0, 1, 2, 3)}
    assert place_trial(free, 5) == {"a": (0, 1, 2, 3), "b": (0,)}   # the roomiest hosts first
    assert place_trial(free, 6) == {"a": (0, 1, 2, 3), "b": (0, 1)}
    assert place_trial(free, 8) is None
    assert place_trial({"a": (0, 1, 2), "b": (0, 1, 2), "c": (0,)}, 4, uniform=True) == {
        "a": (0, 1),
        "b": (0, 1),
    }
    assert place_trial({"a": (0, 1, 2), "b": (0,)}, 4, uniform=True) is None
    assert format_include({"a": (0, 1), "b": (2,)}) == "a:0,1@b:2"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=5), st.integers(1, 12), st.booleans())
def test_placement_properties(counts, slots, uniform):
    free = {f"h{i}": tuple(range(c)) for i, c in enumerate(counts)}
    placed = place_trial(free, slots, uniform=uniform)
    if placed is None:
        assert uniform or sum(counts) < slots
        return
    assert sum(len(ids) for ids in placed.values()) == slots
    assert all(set(ids) <= set(free[h]) and len(set(ids)) == len(ids) for h, ids in placed.items())
    assert list(placed) == [h for h in free if h in placed]  # rank order follows the hostfile
    if uniform:
        assert len({len(ids) for ids in placed.values()}) == 1
    if any(c >= slots for c in counts):
        assert len(placed) == 1
