"""The argument parser of ``python -m toolkit.dsat {binary,random,asha} CONFIG MODEL_DIR``.

Every flag has a help line with its default and unit. The argparse types parse a flag's syntax
only; its range is checked once, by the settings it goes into, whose messages name the flag.
Autotuner process only. Example::

    args = build_parser().parse_args(["binary", "deepspeed.yaml", "."])
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

from toolkit.dsat.contract import METRICS
from toolkit.dsat.execution.multihost_argv import MULTIHOST_LAUNCHERS
from toolkit.dsat.execution.settings import WINDOW_STEPS_FACTOR
from toolkit.dsat.search.confirm import CONFIRM_MEASUREMENTS
from toolkit.dsat.search.offload import OFFLOAD_MODES

__all__ = ["build_parser", "parse_bytes"]


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _stage(text: str) -> int:
    if text not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a ZeRO stage: expected 0, 1, 2 or 3")
    return int(text)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"512MiB"``, ``"2G"`` or a plain number of bytes (the settings check its range)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: expected e.g. 8GiB, 512MiB or 1000000")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value >= 2**63:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a size this machine could have (over 2**63 "
                                         "bytes)")
    return int(value)


def _global_batch(text: str) -> str | int:
    if text in ("keep", "free"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected keep, free or a number of samples") from None


def prog() -> str:
    """How dsat was started, for its usage line: ``dsat`` (the installed console script) or
    ``python -m toolkit.dsat``."""
    return "dsat" if sys.argv and os.path.basename(sys.argv[0]) == "dsat" else "python -m toolkit.dsat"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one sub-command per search method)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("config", type=Path,
                        help="experiment YAML (entrypoint, resources.slots_per_trial; the DeepSpeed config: "
                             "hyperparameters.deepspeed_config, the entrypoint's --deepspeed_config, or the "
                             "one the script gives deepspeed.initialize)")
    common.add_argument("model_dir", type=Path,
                        help="directory holding the entrypoint and the DeepSpeed JSON")
    _add_search_flags(common.add_argument_group("search"))
    _add_limit_flags(common.add_argument_group("trials and resources"))
    h = common.add_argument_group("hosts (default: this machine alone, or the Slurm allocation's nodes)")
    h.add_argument("--hostfile", type=Path, default=None, metavar="PATH",
                   help="DeepSpeed hostfile ('HOST slots=N' per line): the hosts and slots trials run on; "
                        "a trial larger than one host's slots spans hosts (default: none)")
    h.add_argument("--multihost-launcher", choices=MULTIHOST_LAUNCHERS, default=None,
                   help="starts a trial on other hosts: DeepSpeed's runner (pdsh, openmpi, mvapich, mpich, "
                        "impi) or srun (default: srun inside a Slurm allocation, else pdsh)")
    h.add_argument("--ssh-port", type=_integer, default=None, metavar="PORT",
                   help="ssh port of the hosts, for pdsh (default: ssh's own)")
    o = common.add_argument_group("outputs")
    o.add_argument("--output-dir", type=Path, default=None, metavar="PATH",
                   help="where the search is recorded (default: MODEL_DIR/dsat_output)")
    o.add_argument("--resume", action="store_true",
                   help="continue the search recorded in --output-dir (default: off)")
    o.add_argument("--quiet", action="store_true",
                   help="show only the search's lines, not the trials' ranks' (each trial's trial.log holds "
                        "them either way; default: off)")
    o.add_argument("--run-full-experiment", action="store_true",
                   help="after the search, run the entrypoint with the best config for searcher.max_length "
                        "steps (default: off)")
    description = "DeepSpeed autotuner: find the fastest DeepSpeed config that fits."
    parser = argparse.ArgumentParser(prog=prog(), description=description)
    _add_methods(parser, common)
    return parser


def _add_search_flags(g: argparse._ArgumentGroup) -> None:
    """What is searched and how it is judged."""
    g.add_argument("--max-trials", type=_integer, default=50, metavar="N",
                   help="trials in all, the profiling trials included (default: %(default)s)")
    g.add_argument("--confirm", type=_integer, default=2, metavar="N",
                   help="after the search, re-run the N best configurations one after the other until "
                        f"each has {CONFIRM_MEASUREMENTS} trials (a later one only while a measurement of it "
                        "beats the best median so far) and pick the best by the median, so that the best "
                        f"was measured more than once; at most {CONFIRM_MEASUREMENTS - 1} x N re-runs, not "
                        "counted in --max-trials; 0: the best single measurement (default: %(default)s)")
    g.add_argument("--metric", choices=METRICS, default="FLOPS_per_gpu",
                   help="what the best trial maximises (FLOPS_per_gpu, throughput in samples/s) or minimises "
                        "(forward, backward, latency in ms per step) (default: %(default)s)")
    g.add_argument("--zero-stages", type=_stage, nargs="+", default=[1, 2, 3], metavar="STAGE",
                   help="ZeRO stages searched (default: 1 2 3)")
    g.add_argument("--global-batch", type=_global_batch, default=None, metavar="{keep,free,N}",
                   help="keep: every trial keeps the DeepSpeed config's train_batch_size (micro-batches that "
                        "divide it / data-parallel size, accumulation derived); N: the same with "
                        "train_batch_size N samples; free: micro-batch x accumulation x data-parallel size, "
                        "Determined's behaviour (default: keep when the config sets an integer "
                        "train_batch_size, else free)")
    g.add_argument("--offload", choices=OFFLOAD_MODES, default="auto",
                   help="auto: when the memory model or the trials say no stage fits micro-batch 1, search "
                        "offload_optimizer (stages 2, 3) then offload_param (stage 3) to the CPU; never; "
                        "always: every trial offloads (default: %(default)s)")
    g.add_argument("--no-own-config", action="store_true",
                   help="do not measure your DeepSpeed config as written after the search (default: when no "
                        "trial of the search ran it, one more trial, not counted in --max-trials, whose "
                        "measurement the closing lines give beside the best's)")
    g.add_argument("--random-seed", type=_integer, default=42, metavar="N",
                   help="seed of the search's random draws (default: %(default)s)")
    g.add_argument("--start-profile-step", type=_integer, default=3, metavar="STEP",
                   help="first timed step of a trial, as steps_completed (default: %(default)s)")
    g.add_argument("--end-profile-step", type=_integer, default=5, metavar="STEP",
                   help="last timed step; the trial ends after it unless --timed-window needs more "
                        "(default: %(default)s)")
    g.add_argument("--timed-window", type=_number, default=3.0, metavar="SECONDS",
                   help="seconds the timed steps span at least: a trial whose profile steps are shorter "
                        f"times more of them, up to {WINDOW_STEPS_FACTOR}x as many more (the loop must run "
                        "them; a loop that ends earlier reports those it timed); 0: the profile steps only "
                        "(default: %(default)s s)")


def _add_limit_flags(g: argparse._ArgumentGroup) -> None:
    """How many trials run at once, and their limits."""
    g.add_argument("--max-concurrent-trials", type=_integer, default=16, metavar="N",
                   help="trials running at once (default: %(default)s)")
    g.add_argument("--max-slots", type=_integer, default=None, metavar="N",
                   help="slots (processes) in use at once (default: the hostfile's or Slurm's slots, else "
                        "the GPUs of this machine, else its CPU cores)")
    g.add_argument("--trial-timeout", type=_number, default=600.0, metavar="SECONDS",
                   help="a trial running longer is killed with all its processes; no trial is launched whose "
                        "predicted time (the profiling trials' start-up, and their step times' line in the "
                        "micro-batch) exceeds it (default: %(default)s seconds)")
    g.add_argument("--memory-per-slot", type=parse_bytes, default=None, metavar="SIZE",
                   help="CPU only: memory budget per slot in bytes, or e.g. 4GiB, 512MiB; a trial process "
                        "whose peak resident size (VmHWM) goes above it is killed and recorded as "
                        "out-of-memory (default: (80%% of the memory "
                        "available now - 2 GiB reserved for the system and the autotuner) / --max-slots)")
    g.add_argument("--no-merge-config", action="store_true",
                   help="inside a trial, do not merge the trial's tuned keys (micro-batch, accumulation, "
                        "global batch, zero_optimization) over the config the script gives "
                        "deepspeed.initialize: only check that its engine runs the trial's config, and stop "
                        "the search at the first that does not (default: merge)")
    g.add_argument("--launcher", choices=("torchrun", "deepspeed"), default=None,
                   help="starts a trial whose slots are all on this machine (default: the launcher the "
                        "entrypoint's Determined wrapper stands for: deepspeed for python3 -m "
                        "determined.launch.deepspeed, torchrun for determined.launch.torch_distributed; "
                        "else torchrun)")


def _add_methods(parser: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    """One sub-command per search method, with the common flags and its own."""
    methods = parser.add_subparsers(dest="method", required=True, metavar="{binary,random,asha}")
    range_help = ("bisect the micro-batch on [1, FACTOR x the memory model's largest micro-batch] "
                  "(default: %(default)s)")
    binary = methods.add_parser("binary", parents=[common],
                                help="each ZeRO config's best micro-batch: the throughput peak "
                                     "bracketed on a log scale, the memory boundary bisected")
    binary.add_argument("--search-range-factor", type=_number, default=1.0, metavar="FACTOR", help=range_help)
    binary.add_argument("--bisect-tolerance", type=_number, default=0.25, metavar="FRACTION",
                        help="stop bisecting the memory boundary once the open range above the largest "
                             "fitting micro-batch f is within this fraction of f (for throughput and "
                             "FLOPS_per_gpu only when f is the config's best so far: else the search "
                             "brackets the throughput peak below it) (0: bisect to the last unit; "
                             "default: %(default)s)")
    rand = methods.add_parser("random", parents=[common], help="random ZeRO configs with early stopping")
    rand.add_argument("--trials-per-random-config", type=_integer, default=5, metavar="N",
                      help="trials per ZeRO config (default: %(default)s)")
    rand.add_argument("--early-stopping", type=_integer, default=None, metavar="N",
                      help="stop after N trials in a row without improvement (default: never)")
    asha = methods.add_parser("asha", parents=[common], help="ASHA over lines of binary search")
    asha.add_argument("--max-rungs", type=_integer, default=5, metavar="N",
                      help="rungs of successive halving (default: %(default)s)")
    asha.add_argument("--min-binary-search-trials", type=_integer, default=3, metavar="N",
                      help="trials of a config at rung 0 (default: %(default)s)")
    asha.add_argument("--asha-early-stopping", type=_integer, default=0, metavar="N",
                      help="rungs skipped at the start: rung r allows min-binary-search-trials x "
                           "divisor^(N + r) trials (default: %(default)s)")
    asha.add_argument("--divisor", type=_integer, default=2, metavar="N",
                      help="the top 1/N of a rung is promoted (default: %(default)s)")
    asha.add_argument("--search-range-factor", type=_number, default=1.0, metavar="FACTOR", help=range_help)
