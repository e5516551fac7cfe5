"""DeepSpeed's multinode runner with a pdsh command whose every word is quoted: ``python -m`` this module.

DeepSpeed's ``PDSHRunner.get_cmd`` joins exports, ``cd`` and the script's arguments, half-quoted,
into the line each host's shell runs, so ``;`` or ``$(...)`` in them ran there.
:class:`QuotedPDSHRunner` builds that line with
:func:`~toolkit.dsat.execution.multihost_argv.pdsh_remote_command`, and its kill command stops only
this trial's launchers; the rest is DeepSpeed's runner. Started by dsat's runner (``via="pdsh"``);
nothing imports it. How: docs/design-dsat-runner.md#across-hosts.
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
