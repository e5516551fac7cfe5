"""Run the reliability suite (tests/reliability) and print one line per category: tried, survived, lost.

    .venv/bin/python scripts/reliability.py               # the full run (about 20 min on 2 CPU cores)
    .venv/bin/python scripts/reliability.py --seed 7      # the same random moments again
    .venv/bin/python scripts/reliability.py --short       # only the parts CI runs (bash scripts/test.sh)

The full run sets ``TOOLKIT_RELIABILITY_FULL=1``: 20 SIGTERMs at random moments of the example's
training (start-up, saves, steps), 10 SIGKILLs during saves, the chaos stage matrix (for each ZeRO
stage 0-3, 20 runs stopped by a SIGTERM at a random step, each resumed and compared bitwise with
an uninterrupted run: 80 resumes, tallied as "exact resume, ZeRO 0-3"), three dsat searches with
injected faults, the disk-full cases, the bad-input table, 600 fuzzing examples per property and the
security checks. Exit status 0 only when pytest passed and no category lost anything.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("preemption chaos (SIGTERM)", "crash during save (SIGKILL)", "exact resume, ZeRO 0-3",
         "disk full during save", "dsat fault injection", "bad input", "fuzzing", "security")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the random moments (default: a new one, printed)")
    parser.add_argument("--short", action="store_true", help="only the short parts (what CI runs)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds before the whole run is stopped")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, e.g. -k chaos (after --)")
    return parser.parse_args(argv)


def table(lines: list[dict]) -> list[str]:
    """Sum the report lines per category, in a fixed order, as printable rows."""
    sums: dict[str, list] = collections.OrderedDict()
    for category in ORDER:
        sums[category] = [0, 0, 0, []]
    for line in lines:
        row = sums.setdefault(line["category"], [0, 0, 0, []])
        row[0] += line["tried"]
        row[1] += line["survived"]
        row[2] += line["lost"]
        if line.get("detail"):
            row[3].append(line["detail"])
    rows = [f"{'category':30s} {'tried':>6s} {'survived':>9s} {'lost':>5s}  detail"]
    for category, (tried, survived, lost, detail) in sums.items():
        rows.append(f"{category:30s} {tried:6d} {survived:9d} {lost:5d}  {'; '.join(detail)}")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    venv = ROOT / ".venv"
    env = dict(os.environ)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(venv / "torch_extensions"))
    env["TOOLKIT_RELIABILITY_SEED"] = str(seed)
    if args.short:
        env.pop("TOOLKIT_RELIABILITY_FULL", None)
    else:
        env["TOOLKIT_RELIABILITY_FULL"] = "1"
    python = venv / "bin" / "python" if (venv / "bin" / "python").exists() else Path(sys.executable)
    with tempfile.TemporaryDirectory(prefix="toolkit-reliability-") as tmp:
        report = Path(tmp) / "report.jsonl"
        env["TOOLKIT_RELIABILITY_REPORT"] = str(report)
        argv_ = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/reliability",
                 *args.pytest_args]
        kind = "short" if args.short else "full"
        print(f"reliability suite ({kind}), seed {seed}: {' '.join(argv_)}", flush=True)
        started = time.monotonic()
        try:
            code = subprocess.run(argv_, cwd=ROOT, env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = 124
            print(f"stopped after {args.timeout:.0f} s", flush=True)
        wall = time.monotonic() - started
        lines = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    print()
    print(f"reliability suite ({'short' if args.short else 'full'}), seed {seed}, wall time {wall:.0f} s, "
          f"pytest exit status {code}")
    for row in table(lines):
        print(row)
    for line in lines:
        for note in line.get("notes") or []:
            print(f"  lost in {line['test']}: {note}")
    lost = sum(line["lost"] for line in lines)
    return 0 if code == 0 and lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
