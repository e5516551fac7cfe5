"""A training-loop stand-in for tests/test_preemption.py: sleep per step, ask should_preempt() every step.

    torchrun --nproc_per_node 2 preempt_loop.py OUT_DIR [--check-every N] [--check-interval S] ...
    (--call-every N: ask only every N steps; --signal-after S: the last rank signals itself)
    torchrun --nproc_per_node 2 preempt_loop.py OUT_DIR --phase "OPTIONS" --phase "OPTIONS" ...

Writes OUT_DIR/pid<rank> at start, OUT_DIR/progress<rank> (steps completed) after every step,
OUT_DIR/stop<rank>.json when should_preempt() says stop, and OUT_DIR/result<rank>.json at the end;
exits 0 when the loop stopped cleanly. With --phase, one launch runs one loop per phase, one after
the other, each with its own options, its own watcher and its own files in OUT_DIR/phase<i>.
"""
import argparse
import json
import os
import shlex
import signal
import time
from pathlib import Path

import toolkit
from toolkit.preemption import DEFAULT_SIGNALS, _ignore_repeated_stop, watch_preemption


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # readers never see a half-written file


def loop_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--check-every", type=int, default=0, help="0: adaptive")
    parser.add_argument("--check-interval", type=float, default=0.25)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--sleep", type=float, default=0.005, help="seconds per step")
    parser.add_argument("--call-every", type=int, default=1, help="call should_preempt() every N steps")
    parser.add_argument("--signal-after", type=int, default=0,
                        help="rank 1 (the last rank) sends itself SIGTERM after this step; 0: never")
    return parser


def run_loop(ctx, out: Path, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    before = {sig: signal.getsignal(sig) for sig in DEFAULT_SIGNALS}
    seen_at = stopped_at = None
    step = 0
    with watch_preemption(ctx, check_every=args.check_every or None,
                          check_interval=args.check_interval) as preemption:
        installed = all(signal.getsignal(sig) is not before[sig] for sig in DEFAULT_SIGNALS)
        write(out / f"pid{ctx.rank}", str(os.getpid()))
        while step < args.max_steps:
            if seen_at is None and preemption.received_signal is not None:
                seen_at = step
            if step % args.call_every == 0 and preemption.should_preempt():
                stopped_at = step
                # Written before close(), so that the record exists whatever the launcher does next.
                write(out / f"stop{ctx.rank}.json", json.dumps({"stopped_at": step, "seen_at": seen_at}))
                break
            time.sleep(args.sleep)
            step += 1
            write(out / f"progress{ctx.rank}", str(step))
            if args.signal_after and step == args.signal_after and ctx.rank == ctx.world_size - 1:
                os.kill(os.getpid(), signal.SIGTERM)
    # Put back; after an agreed stop a default SIGTERM/SIGUSR1 stays ignored (a repeated stop, which
    # the deepspeed launcher sends, must not kill the rank between its save and its exit).
    expected = {sig: _ignore_repeated_stop if preemption.preempted and before[sig] == signal.SIG_DFL
                and sig in (signal.SIGTERM, signal.SIGUSR1) else before[sig] for sig in DEFAULT_SIGNALS}
    restored = all(signal.getsignal(sig) == expected[sig] for sig in DEFAULT_SIGNALS)
    # A blocking collective after close: it only completes if the ranks left the loop in step.
    final_steps = ctx.all_gather_object(step)
    received = preemption.received_signal
    write(out / f"result{ctx.rank}.json", json.dumps({
        "rank": ctx.rank, "world_size": ctx.world_size, "stopped_at": stopped_at, "seen_at": seen_at,
        "received": received.name if received else None, "installed": installed, "restored": restored,
        "final_steps": final_steps, "preempted": preemption.preempted,
        "after_close": preemption.should_preempt(),
    }))


parser = loop_options(argparse.ArgumentParser())
parser.add_argument("out", type=Path)
parser.add_argument("--phase", action="append", default=[], help="one loop's options, quoted")
parser.add_argument("--local_rank", type=int, help="added by the deepspeed launcher; unused")
cli = parser.parse_args()

ctx = toolkit.init_distributed()
if cli.phase:
    for i, options in enumerate(cli.phase):
        phase_args = loop_options(argparse.ArgumentParser()).parse_args(shlex.split(options))
        run_loop(ctx, cli.out / f"phase{i}", phase_args)
else:
    run_loop(ctx, cli.out, cli)
