"""A local multi-process launcher: N JAX processes on 127.0.0.1, for tests and laptops.

    alpa-lite launch -n 2 --cpu-devices 4 train.py --steps 10

starts `python train.py --steps 10` twice, each process with 4 virtual CPU devices, and
prints their output line by line prefixed with the process index. The script joins the job
with `alpa_lite.runtime.distributed.initialize()`, which reads the coordinator address, process
count and index this launcher puts in the environment. On a real cluster the scheduler
(SLURM, Kubernetes, mpirun) starts the processes instead and `initialize()` finds its peers
through JAX's own cluster detection; nothing here is needed there.

Every process is started in its own session, so stopping the job stops everything the
process started too; `LocalJob` stops all of them when it exits, also on an exception or a
timeout, so no process outlives the job.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence, TextIO

from alpa_lite.runtime import distributed as D

__all__ = ["LocalJob", "ProcessResult", "launch"]

STOP_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL when the job is stopped."""


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """How one process of a job ended.

    Attributes:
      process_id: its index in the job.
      returncode: the exit status; negative: killed by that signal (subprocess's
        convention), None: still running when the job was stopped.
      output: its stdout and stderr, interleaved as written.
      elapsed_s: seconds from the start of the job to its exit.
    """

    process_id: int
    returncode: int | None
    output: str
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        """'process 1: exit 0 after 12.3 s', '... killed by SIGKILL ...'."""
        rc = self.returncode
        if rc is None:
            how = "still running when the job was stopped"
        elif rc < 0:
            how = f"killed by {signal.Signals(-rc).name}"
        else:
            how = f"exit {rc}"
        return f"process {self.process_id}: {how} after {self.elapsed_s:.1f} s"


class LocalJob:
    """`num_processes` copies of `command` joined as one JAX job on this machine.

    Use as a context manager; leaving it stops every process still running:

        with LocalJob([sys.executable, "train.py"], num_processes=2) as job:
            results = job.wait(timeout_s=300)

    Args:
      command: the program and its arguments, e.g. `[sys.executable, "train.py"]`.
      num_processes: processes to start (>= 1).
      cpu_devices: virtual CPU devices per process; None leaves the platform alone (e.g.
        one GPU per process on a GPU machine).
      env: extra environment variables for every process.
      echo: a stream to copy each output line to, prefixed "[p<i>] " (None: keep quiet).
      cwd: working directory of the processes.
    """

    def __init__(self, command: Sequence[str], num_processes: int = 2,
                 cpu_devices: int | None = 4, env: dict[str, str] | None = None,
                 echo: TextIO | None = None, cwd: str | None = None):
        if isinstance(command, str) or not command:
            raise ValueError(f"command must be a non-empty list of strings such as "
                             f"[sys.executable, 'train.py'], got {command!r}")
        checked = [("num_processes", num_processes)]
        if cpu_devices is not None:
            checked.append(("cpu_devices", cpu_devices))
        for name, v in checked:
            D.check_positive_int(name, v)
        self.command = [str(c) for c in command]
        self.num_processes = num_processes
        self.cpu_devices = cpu_devices
        self.extra_env = dict(env or {})
        self.echo = echo
        self.cwd = cwd
        self._procs: list[subprocess.Popen] = []
        self._outputs: list[list[str]] = []
        self._readers: list[threading.Thread] = []
        self._ended: dict[int, float] = {}
        self._t0 = 0.0
        self._lock = threading.Lock()

    # ---- starting and stopping ------------------------------------------------------------

    def __enter__(self) -> "LocalJob":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Starts the processes (once)."""
        if self._procs:
            raise RuntimeError("this job has already been started")
        port = D.free_port("127.0.0.1")
        self._t0 = time.perf_counter()
        try:
            for i in range(self.num_processes):
                env = self._env(i, port)
                p = subprocess.Popen(self.command, env=env, cwd=self.cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, bufsize=1,
                                     errors="replace", start_new_session=True)
                self._procs.append(p)
                self._outputs.append([])
                t = threading.Thread(target=self._read, args=(i, p), daemon=True)
                t.start()
                self._readers.append(t)
        except BaseException:
            self.stop()
            raise

    def _env(self, i: int, port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            D.ENV_COORDINATOR: f"127.0.0.1:{port}",
            D.ENV_NUM_PROCESSES: str(self.num_processes),
            D.ENV_PROCESS_ID: str(i),
            D.ENV_TRANSFER_HOST: "127.0.0.1",
            "PYTHONUNBUFFERED": "1",
        })
        if self.cpu_devices is not None:
            env[D.ENV_CPU_DEVICES] = str(self.cpu_devices)
            env["JAX_PLATFORMS"] = "cpu"
            # A device count forced through XLA_FLAGS (as the test set-up does) would
            # override the per-process count.
            flags = [f for f in env.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count")]
            env["XLA_FLAGS"] = " ".join(flags)
        env.update(self.extra_env)
        return env

    def _read(self, i: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            with self._lock:
                self._outputs[i].append(line)
                if self.echo is not None:
                    self.echo.write(f"[p{i}] {line}")
                    self.echo.flush()

    def kill(self, process_id: int, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to one process (and what it started), e.g. to test a failure."""
        p = self._procs[process_id]
        if p.poll() is None:
            os.killpg(p.pid, sig)

    def stop(self) -> None:
        """Stops every process still running: SIGTERM, then SIGKILL after STOP_GRACE_S."""
        alive = [p for p in self._procs if p.poll() is None]
        for p in alive:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in alive:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for t in self._readers:
            t.join(timeout=5)

    # ---- waiting --------------------------------------------------------------------------

    def poll(self) -> list[int | None]:
        """Each process's exit status so far (None: running)."""
        now = time.perf_counter() - self._t0
        codes = []
        for i, p in enumerate(self._procs):
            rc = p.poll()
            if rc is not None:
                self._ended.setdefault(i, now)
            codes.append(rc)
        return codes

    def wait(self, timeout_s: float | None = None) -> list[ProcessResult]:
        """Waits until every process has ended, or `timeout_s` has passed (then stops them
        all and raises TimeoutError naming those still running, with their last output)."""
        if not self._procs:
            raise RuntimeError("start the job before waiting for it")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(rc is None for rc in self.poll()):
            if deadline is not None and time.monotonic() > deadline:
                running = [i for i, rc in enumerate(self.poll()) if rc is None]
                self.stop()
                tails = "\n".join(f"--- process {i}, last lines:\n{self.tail(i)}"
                                  for i in running)
                raise TimeoutError(f"processes {running} still running after {timeout_s} s; "
                                   f"all were stopped.\n{tails}")
            time.sleep(0.05)
        for t in self._readers:
            t.join(timeout=5)
        return self.results()

    def results(self) -> list[ProcessResult]:
        """How each process ended (or that it is still running)."""
        codes = self.poll()
        now = time.perf_counter() - self._t0
        with self._lock:
            return [ProcessResult(i, rc, "".join(self._outputs[i]), self._ended.get(i, now))
                    for i, rc in enumerate(codes)]

    def output(self, process_id: int) -> str:
        with self._lock:
            return "".join(self._outputs[process_id])

    def tail(self, process_id: int, lines: int = 20) -> str:
        with self._lock:
            return "".join(self._outputs[process_id][-lines:])


def launch(command: Sequence[str], num_processes: int = 2, cpu_devices: int | None = 4,
           timeout_s: float | None = None, echo: TextIO | None = None,
           env: dict[str, str] | None = None) -> list[ProcessResult]:
    """Runs `command` as a `num_processes`-process job and returns how each process ended;
    every process is stopped on return, also on a timeout or an interrupt."""
    with LocalJob(command, num_processes, cpu_devices, env=env, echo=echo) as job:
        return job.wait(timeout_s)


def script_command(script: str, args: Sequence[str] = ()) -> list[str]:
    """`python script args...` with this interpreter; a script that does not exist is
    refused before anything starts."""
    if not os.path.isfile(script):
        raise FileNotFoundError(f"no such script: {script!r}")
    return [sys.executable, script, *args]


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
