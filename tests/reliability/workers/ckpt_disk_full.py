"""A save that runs out of disk space, on 2 ranks (ZeRO-1, the tiny model of tests/workers/ckpt_common.py).

Usage:
    torchrun --nproc_per_node 2 ckpt_disk_full.py CKPT_DIR OUT_DIR MODE[,MODE...]

Saves step_1 normally, trains a step, then for each MODE makes the disk "full" and saves step_2,
which must raise on every rank (no rank may hang), then lifts the limit. MODE:

    tmpfs    CKPT_DIR is a small tmpfs mounted by the test; the chief fills it with a filler file
             until the kernel answers ENOSPC (a real full disk).
    rlimit   every rank limits its file size (RLIMIT_FSIZE, SIGXFSZ ignored): writes past the
             limit fail with EFBIG, as a full disk or a quota would fail them.
    rlimit1  only rank 1 is limited: one rank fails while the other writes normally.

Finally a fresh engine loads the latest checkpoint, which must be step_1, and saves step_2.
Each rank writes OUT_DIR/rank<R>.json: {"modes": {MODE: {"error", "error_type", "latest",
"chosen"}}, "loaded_steps", "loaded_state", "saved_after"}.
"""
import json
import os
import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workers"))
import ckpt_common as c  # noqa: E402

import toolkit  # noqa: E402
import toolkit.checkpoint.layout as layout  # noqa: E402

ckpt, out, modes = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
ctx = toolkit.init_distributed()
engine = c.build("zero1")
c.train_step(engine)
toolkit.save_checkpoint(engine, ckpt, steps_completed=1, client_state={"at": 1})
c.train_step(engine)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
filler = ckpt / "filler.bin"
# tmpfs: leave room for toolkit's markers and both ranks' RNG states, not for DeepSpeed's files,
# so that the save fails inside DeepSpeed's collective save, the hardest place to fail.
page = 4096
rng_size = max(f.stat().st_size for f in (ckpt / "step_1" / layout.RNG_DIR).iterdir())
room = 2 * -(-rng_size // page) * page + 3 * page
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process instead of EFBIG
report = {"modes": {}}
for mode in modes:
    record = report["modes"][mode] = {}
    if mode == "tmpfs":
        if ctx.is_chief:
            with open(filler, "wb") as fh:
                try:
                    while True:
                        fh.write(b"\0" * 65536)
                        fh.flush()
                except OSError as err:
                    record["filled"] = f"{err.strerror} after {fh.tell()} bytes"
            os.truncate(filler, max(os.path.getsize(filler) - room, 0))
    elif mode == "rlimit" or (mode == "rlimit1" and ctx.rank == 1):
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))  # every data file of the save is larger
    ctx.barrier()
    try:
        toolkit.save_checkpoint(engine, ckpt, steps_completed=2, client_state={"at": 2})
        record["error"], record["error_type"] = None, None
    except Exception as err:  # noqa: BLE001 - recorded for the test to judge
        record["error"], record["error_type"] = str(err), type(err).__name__
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    ctx.barrier()
    if ctx.is_chief and filler.exists():
        filler.unlink()
    ctx.barrier()
    record["latest"] = (ckpt / layout.LATEST_FILE).read_text().strip()
    info, _ = layout.resolve_tag(layout.scan_dir(ckpt), None)
    record["chosen"] = info.tag if info else None

fresh = c.build("zero1", seed=7)
loaded = toolkit.load_checkpoint(fresh, ckpt)
report["loaded_steps"], report["loaded_state"] = loaded[0], loaded[1]
# The directory takes checkpoints again once there is space.
report["saved_after"] = toolkit.save_checkpoint(fresh, ckpt, steps_completed=2, client_state={"at": 2})
(out / f"rank{ctx.rank}.json").write_text(json.dumps(report))
