"""Starts one process per device group on this host, all in one jax.distributed job.

  python -m moejax.launch --nproc 8 -- scripts/serve.py --model /path/to/DeepSeek-V3 --parallel dp8-ep8
  JAX_PLATFORMS=cpu python -m moejax.launch --nproc 2 --devices-per-process 4 -- scripts/generate.py ...

Each child runs ``python <command...>`` with the variables moejax/parallel/processes.py reads
(MOEJAX_COORDINATOR, MOEJAX_NUM_PROCESSES, MOEJAX_PROCESS_ID) and its devices: on CPU
(JAX_PLATFORMS=cpu) ``--devices-per-process`` host devices; on GPUs the group
[i * K, (i + 1) * K) of this host's GPUs (JAX_LOCAL_DEVICE_IDS, JAX's own variable).

Several hosts (JAX's multi-controller form: one coordinator address, process ids 0..P-1 over all
hosts, process 0 on the coordinator's host): the same command on every host, with
``--nnodes H --node-rank R --coordinator HOST0:PORT``; host R runs processes R*nproc .. R*nproc+nproc-1.

The launcher watches its children (and they die with it, on Linux): SIGTERM / SIGINT go to process 0 (the server drains, then tells
the others to stop); once a child exits with an error the others get ``--grace`` seconds to exit on
their own (process 0 reports a dead peer and stops) and are then killed. The exit status is the
first non-zero one of the children (128 + N for a child killed by signal N), else 0.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time

from moejax.parallel.processes import (
    COORDINATOR_ENV,
    HEARTBEAT_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
)

POLL_S = 0.1
_HOST_DEVICES_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m moejax.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, required=True, help="processes on this host")
    ap.add_argument("--devices-per-process", type=int, default=1,
                    help="devices each process drives (GPUs, or host devices with JAX_PLATFORMS=cpu)")
    ap.add_argument("--coordinator", help="host:port of process 0's coordination service (default: 127.0.0.1 "
                                          "and a free port; required with --nnodes > 1)")
    ap.add_argument("--nnodes", type=int, default=1, help="hosts in the job, each running this launcher")
    ap.add_argument("--node-rank", type=int, default=0, help="this host's index in [0, nnodes)")
    ap.add_argument("--heartbeat-timeout", type=int, default=None,
                    help=f"seconds before JAX aborts the job's processes after one stops heartbeating "
                         f"(${HEARTBEAT_ENV}; default 30)")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds the other children get to exit after one failed, before they are killed")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="-- then the script and its arguments, run with this Python in every process")
    return ap


def check_args(a: argparse.Namespace) -> list[str]:
    """The command to run; ValueError naming the field for anything unusable."""
    for field, v, lo in (("--nproc", a.nproc, 1), ("--devices-per-process", a.devices_per_process, 1),
                         ("--nnodes", a.nnodes, 1), ("--heartbeat-timeout", a.heartbeat_timeout or 1, 1)):
        if v < lo:
            raise ValueError(f"{field} must be >= {lo}, got {v}")
    if not 0 <= a.node_rank < a.nnodes:
        raise ValueError(f"--node-rank must be in [0, {a.nnodes}) (--nnodes), got {a.node_rank}")
    if a.nnodes > 1 and not a.coordinator:
        raise ValueError("--coordinator host:port is required with --nnodes > 1 (process 0's host)")
    if a.coordinator is not None and not re.fullmatch(r"[^\s:]+:[0-9]+", a.coordinator):
        raise ValueError(f"--coordinator must be host:port, got {a.coordinator!r}")
    if not a.grace >= 0:
        raise ValueError(f"--grace must be >= 0 seconds, got {a.grace}")
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        raise ValueError("no command: give the script after --, e.g. -- scripts/serve.py --parallel dp8-ep8")
    return command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(base: dict, a: argparse.Namespace, coordinator: str, local_rank: int) -> dict:
    """The environment of this host's ``local_rank``-th process."""
    env = dict(base)
    env[COORDINATOR_ENV] = coordinator
    env[NUM_PROCESSES_ENV] = str(a.nproc * a.nnodes)
    env[PROCESS_ID_ENV] = str(a.node_rank * a.nproc + local_rank)
    if a.heartbeat_timeout is not None:
        env[HEARTBEAT_ENV] = str(a.heartbeat_timeout)
    k = a.devices_per_process
    if env.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        env["JAX_NUM_CPU_DEVICES"] = str(k)
        flags = _HOST_DEVICES_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={k}"])
    else:
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(local_rank * k + i) for i in range(k))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _die_with_parent() -> None:
    """In a child, before exec: Linux sends it SIGKILL if the launcher dies (killed, so it cannot kill
    its children itself), so no process of the job outlives it. Elsewhere: nothing."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def supervise(procs: list[subprocess.Popen], grace: float) -> int:
    """Waits for every child; after the first failure, kills those still running past ``grace``."""
    first_error, failed_at = 0, None
    while True:
        codes = [p.poll() for p in procs]
        for i, c in enumerate(codes):
            if c not in (None, 0) and not first_error:
                first_error, failed_at = (c if c > 0 else 128 - c), time.monotonic()  # killed by signal s: 128 + s
                how = f"status {c}" if c > 0 else f"signal {-c}"
                print(f"moejax.launch: local process {i} exited with {how}; the others get {grace:g} s to stop",
                      file=sys.stderr, flush=True)
        if all(c is not None for c in codes):
            return first_error
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            return first_error
        time.sleep(POLL_S)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        command = check_args(a)
    except ValueError as e:
        print(f"moejax.launch: {e}", file=sys.stderr)
        return 2
    coordinator = a.coordinator or f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, *command], env=child_env(os.environ, a, coordinator, i),
                              preexec_fn=_die_with_parent)  # noqa: PLW1509 - the launcher has no threads
             for i in range(a.nproc)]
    leader = procs[0] if a.node_rank == 0 else None  # process 0 is this host's first, on host 0

    def forward(sig, _frame):  # the graceful stop goes to the front end; it stops the others
        for p in [leader] if leader is not None else procs:
            if p.poll() is None:
                p.send_signal(sig)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    return supervise(procs, a.grace)


if __name__ == "__main__":
    sys.exit(main())
