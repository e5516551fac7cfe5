"""DeepSpeed's multinode runner whose pdsh command quotes every word: ``python -m`` this module.

DeepSpeed's ``PDSHRunner.get_cmd`` joins ``export K=V;`` (values double-quoted only when they
hold unusual characters, so ``$(...)`` and backquotes still ran), ``cd MODEL_DIR;`` and the
script's arguments (double-quoted only when they hold a space) into the one line pdsh has each
host's shell run: an entrypoint argument ``--note=a;touch${IFS}X`` ran ``touch`` on the host.
:class:`QuotedPDSHRunner` builds that line with
:func:`toolkit.dsat.execution.multihost_argv.pdsh_remote_command` instead; everything else is DeepSpeed's
runner unchanged (its options, hostfile, ssh check, exported variables, ``DS_ENV_FILE``).
Its kill command on SIGTERM stops only this trial's launchers
(:func:`~toolkit.dsat.execution.multihost_argv.build_remote_kill_argv`), not every DeepSpeed launcher of
the hosts. dsat's trial runner starts it (:func:`~toolkit.dsat.execution.multihost_argv.build_multihost_argv`
with ``via="pdsh"``); nothing imports it.

Example::

    python -m toolkit.dsat.execution.pdsh_launch --hostfile trial_7/hostfile --include w0:0,1@w1:0,1 \\
        --master_addr w0 --master_port 29512 --launcher pdsh --force_multi --no_local_rank train.py --x
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any

from deepspeed.launcher import runner as ds_runner
from deepspeed.launcher.constants import PDSH_MAX_FAN_OUT
from deepspeed.launcher.multinode_runner import PDSHRunner

from toolkit.dsat.execution.multihost_argv import build_remote_kill_argv, pdsh_remote_command

__all__ = ["QuotedPDSHRunner", "main"]


class QuotedPDSHRunner(PDSHRunner):
    """DeepSpeed's pdsh runner with every word of the remote line quoted. Launcher process only."""

    def parse_user_args(self) -> list[str]:
        return list(self.args.user_args)  # quoted in get_cmd, not half-quoted here

    def add_export(self, key: str, var: str) -> None:
        self.exports[key.strip()] = var.rstrip("\r\n")  # a DS_ENV_FILE line keeps its newline

    def get_cmd(self, environment: dict[str, str], active_resources: dict[str, Any]
                ) -> tuple[list[str], list[str], dict[str, str]]:
        """(pdsh argv, this trial's kill argv, pdsh's environment)."""
        args = self.args
        environment["PDSH_RCMD_TYPE"] = "ssh"
        if args.ssh_port is not None:
            extra = environment.get("PDSH_SSH_ARGS_APPEND", "")
            environment["PDSH_SSH_ARGS_APPEND"] = f"{extra} -p {args.ssh_port}".strip()
        hosts = list(active_resources)
        pdsh = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", ",".join(hosts),
                *shlex.split(args.launcher_args)]
        launch = [sys.executable, "-u", "-m", "deepspeed.launcher.launch",
                  f"--world_info={self.world_info_base64}", f"--master_addr={args.master_addr}",
                  f"--master_port={args.master_port}"]
        launch += [flag for flag, on in (("--no_python", args.no_python), ("--module", args.module),
                                         ("--no_local_rank", args.no_local_rank)) if on]
        if args.save_pid:
            launch += ["--save_pid", str(os.getpid())]
        if args.enable_each_rank_log:
            launch.append(f"--enable_each_rank_log={args.enable_each_rank_log}")
        line = pdsh_remote_command(launch, [self.user_script, *self.user_arguments], cwd=os.path.abspath("."),
                                   exports=self.exports, source=args.venv_script)
        kill = build_remote_kill_argv(hosts, master_port=int(args.master_port))
        return pdsh + [line], kill, environment


def main(argv: list[str] | None = None) -> None:
    """DeepSpeed's runner (``deepspeed.launcher.runner.main``) with :class:`QuotedPDSHRunner`."""
    ds_runner.PDSHRunner = QuotedPDSHRunner  # main() looks the class up here
    ds_runner.main(argv)


if __name__ == "__main__":
    main()
