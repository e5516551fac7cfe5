"""toolkit.dsat.trial.cpu_info: py-cpuinfo measured once by the runner, answered from its file
inside the trials it starts on this machine, and nowhere else.

The test suite's own cache (tests/site/sitecustomize.py) also answers py-cpuinfo in every process
it starts, so the answer the runner hands out here is marked (``brand_raw``), and a trial that
measured for itself would return the unmarked one. Only ``brand_raw`` differs: the flags DeepSpeed
hashes into its ops' builds stay the machine's, so no op is rebuilt.
"""

import json
import os
import socket
import sys
import time

import cpuinfo
import pytest

from helpers import procutil
from toolkit.dsat.execution.runner import RunnerSettings, TrialRunner
from toolkit.dsat.search.types import TrialSpec
from toolkit.dsat.trial import cpu_info
from toolkit.runtime.trial_env import TRIAL_ENV

# Run as a one-rank trial: what py-cpuinfo answers in a process that imported toolkit, called the
# way DeepSpeed's op builders call it (the name imported at call time).
PROBE = """
import json, os, sys, time
import toolkit
from cpuinfo import get_cpu_info
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("FusedAdamBuilder")
with open(os.path.join(os.path.dirname(os.environ["TOOLKIT_DSAT_TRIAL"]), "probe.json"), "w") as fh:
    json.dump({"brand_raw": get_cpu_info().get("brand_raw"), "simd": builder.simd_width(),
               "env": os.environ.get("TOOLKIT_DSAT_CPUINFO"), "end": time.time()}, fh)
"""


@pytest.fixture
def marked(monkeypatch):
    """This process's py-cpuinfo answers the machine's dictionary with a marked ``brand_raw``."""
    real = cpuinfo.get_cpu_info()
    answer = {**real, "brand_raw": f"toolkit-test-{os.getpid()}"}
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: dict(answer))  # restored after the test
    return real, answer


def test_a_local_trial_answers_from_the_runners_measurement(tmp_path, monkeypatch, marked):
    procutil.clean_launch_env(monkeypatch)
    real, answer = marked
    (tmp_path / "probe.py").write_text(PROBE)
    # poll_s=30: the runner also notices the launcher's exit between two polls (its own concern,
    # tested on this trial to spare a launch): wait() returns at once, not at the next poll
    settings = RunnerSettings(entrypoint=("python3", "probe.py"), model_dir=tmp_path, slots_per_trial=1,
                              max_slots=1, max_concurrent=1, timeout_s=120.0, grace_s=2.0, poll_s=30.0)
    with TrialRunner(settings, output_dir=tmp_path / "out") as runner:
        runner.start(TrialSpec(1, 1, {"stage": 0}), ds_config={}, hparams={})
        results = []
        while not results:
            results = runner.wait(timeout=120)
        returned = time.time()
    stored = tmp_path / "out" / "cpuinfo.json"
    assert json.loads(stored.read_text()) == {"host": socket.gethostname(), "cpu_info": answer}
    probe = json.loads((tmp_path / "out" / "trials" / "trial_1" / "probe.json").read_text())
    assert probe["env"] == str(stored), results[0].error
    assert probe["brand_raw"] == answer["brand_raw"], "the trial measured py-cpuinfo itself"
    assert returned - probe["end"] < 10, "the runner saw the trial's end only at its next poll"
    # the flags DeepSpeed derives are the machine's: the ops' build hashes do not change
    from deepspeed.accelerator import get_accelerator
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: dict(real))
    assert probe["simd"] == get_accelerator().create_op_builder("FusedAdamBuilder").simd_width()


def test_only_a_process_inside_a_trial_answers_from_the_file(tmp_path, marked):
    _, answer = marked
    path = tmp_path / "cpuinfo.json"
    path.write_text(json.dumps({"host": socket.gethostname(), "cpu_info": {**answer, "brand_raw": "file"}}))
    before = cpuinfo.get_cpu_info
    # outside a trial (no TOOLKIT_DSAT_TRIAL), or without a file named: nothing is touched
    assert not cpu_info.install_from_env({cpu_info.CPUINFO_ENV: str(path)})
    assert not cpu_info.install_from_env({TRIAL_ENV: str(tmp_path / "trial.json")})
    assert cpuinfo.get_cpu_info is before
    inside = {cpu_info.CPUINFO_ENV: str(path), TRIAL_ENV: str(tmp_path / "trial.json")}
    assert cpu_info.install_from_env(inside)
    first = cpuinfo.get_cpu_info()
    assert first["brand_raw"] == "file"
    first["flags"].clear()  # each call gets its own copy, as from py-cpuinfo
    assert cpuinfo.get_cpu_info()["flags"] == answer["flags"]


@pytest.mark.parametrize("content", [
    json.dumps({"host": "another-host", "cpu_info": {"arch": "X86_64"}}),   # another machine's answer
    json.dumps({"host": socket.gethostname()}),                              # no answer in it
    '{"host": ',                                                             # cut short
])
def test_a_file_that_is_not_this_hosts_answer_is_ignored(tmp_path, content, marked):
    path = tmp_path / "cpuinfo.json"
    path.write_text(content)
    before = cpuinfo.get_cpu_info
    assert cpu_info.answer_from(path) is None
    assert not cpu_info.install_from_env({cpu_info.CPUINFO_ENV: str(path), TRIAL_ENV: "x"})
    assert cpuinfo.get_cpu_info is before
    assert cpu_info.answer_from(tmp_path / "missing.json") is None


def test_no_answer_is_handed_out_when_py_cpuinfo_fails(tmp_path, monkeypatch):
    def broken():
        raise RuntimeError("no cpuid here")

    monkeypatch.setattr(cpuinfo, "get_cpu_info", broken)
    assert cpu_info.measure_into(tmp_path / "cpuinfo.json") is None
    assert not (tmp_path / "cpuinfo.json").exists() and cpuinfo.get_cpu_info is broken
    monkeypatch.setitem(sys.modules, "cpuinfo", None)  # not installed
    assert cpu_info.measure_into(tmp_path / "cpuinfo.json") is None
    assert not cpu_info.install({"arch": "X86_64"})
