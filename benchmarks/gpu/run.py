"""The run: each step in its own process group with its own timeout, under one deadline.

Steps (docs/gpu-check.md): ``env`` (the image's versions and device, first, in seconds),
``wheelhouse`` (verify the manifest, install into a temporary site that goes first on
``PYTHONPATH``), ``imports`` (every module the steps use resolves, the gRPC stubs accept the
protobuf/grpcio they get), then the GPU steps ``kernels``, ``pytest-gpu``, ``codec``,
``daemon``, ``throughput``. Without CUDA the GPU steps are SKIPs with the reason, pytest only
collects the gpu tests, and the wheelhouse is installed as for CPython 3.12 manylinux (pip's
platform options) to prove pip accepts it there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from benchmarks.gpu import wheelhouse
from benchmarks.gpu.pytest_gpu import (
    GPU_TEST_FILES,
    PYTEST_ARGS,
    collected_count,
    junit_checks,
    verbose_checks,
)
from benchmarks.gpu.record import FAIL, PASS, SKIP, Check, load_checks
from benchmarks.gpu.report import Report, StepResult

REPO = wheelhouse.REPO
# What the steps import, beyond the standard library: all must resolve where the run runs.
MODULES = (
    "torch",
    "triton",
    "numpy",
    "yaml",
    "xxhash",
    "aiofiles",
    "prometheus_client",
    "rich",
    "grpc",
    "google.protobuf",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
    "highspy",
    "redis.asyncio.cluster",
    "pytest",
    "pytest_asyncio",
    "pytest_timeout",
    "kvtierd.rpc.kvtier_pb2_grpc",
    "kvtierd.server.app",
    "kvtierd.storage.gpu",
    "kvtierd.client.device",
    "kvtierd.kernels.chunk_codec",
    "kvtierd.policies.exact",
    "benchmarks._support.daemon_proc",
    "benchmarks.gpu.probe",
    "benchmarks.gpu.kernels_check",
    "benchmarks.gpu.throughput",
    "benchmarks.gpu.daemon_check",
    "benchmarks.gpu.ipc_reader",
    "benchmarks.gpu.codec_check",
    "benchmarks.gpu.pytest_gpu",
)


@dataclass(frozen=True, slots=True)
class GpuStep:
    name: str
    module: str
    timeout_s: float
    goal: str


GPU_STEPS = (
    GpuStep(
        "kernels",
        "benchmarks.gpu.kernels_check",
        150,
        "every Triton kernel = its torch reference (bit-equal or the stated tolerance) at "
        "the test size and 32 layers x 8 heads x 128, 8k and 32k tokens, bf16",
    ),
    GpuStep(
        "codec",
        "benchmarks.gpu.codec_check",
        60,
        "chunk codec int8/int4 on CUDA: bytes bit-equal to the CPU reference, decode "
        "within one bf16 ulp",
    ),
    GpuStep(
        "daemon",
        "benchmarks.gpu.daemon_check",
        90,
        "gpu+cpu+ssd daemon: put/get byte-exact, CUDA IPC read from a second process, "
        "lease/release, gpu->cpu eviction under pressure",
    ),
    GpuStep(
        "throughput",
        "benchmarks.gpu.throughput",
        100,
        "gather, quantize and score kernels >= 80% of the device's copy bandwidth at 32k tokens",
    ),
    GpuStep("pytest-gpu", "", 200, "every gpu-marked test passes"),
)


class StoppedError(Exception):
    """SIGTERM/SIGINT: the report is written with what is known, then the run exits."""


class Runner:
    def __init__(self, out: Path, wheels: Path, budget_s: float, quick: bool) -> None:
        self.report = Report(out)
        self.wheels, self.quick = wheels, quick
        self.deadline = time.monotonic() + budget_s
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.site = self.work / "site"
        out.mkdir(parents=True, exist_ok=True)
        self.log: IO[str] = open(out / "gpu-check.log", "a")  # noqa: SIM115 (closed at exit)
        self.env = os.environ | {
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "LMCACHE_TRACK_USAGE": "false",
        }
        self.cuda = False

    # -- running one process -------------------------------------------------------------

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def spawn(
        self, cmd: list[str], timeout_s: float, env: dict[str, str]
    ) -> tuple[int | None, bool, str]:
        """Run ``cmd`` in its own process group, its output into the log and onto stdout;
        ``(returncode, timed_out, last lines)``. The group is killed at the timeout (a
        daemon the step started goes with it)."""
        self.say(f"$ {' '.join(cmd)}  (timeout {timeout_s:.0f} s)")
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        lines: list[str] = []

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.say(line.rstrip("\n"))
                lines.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except StoppedError:
            _kill_group(proc)
            raise
        finally:
            if proc.poll() is None:
                _kill_group(proc)
            reader.join(5)
        return (None if timed_out else proc.returncode), timed_out, "".join(lines)

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def begin(self, name: str, goal: str) -> StepResult:
        # Recorded before it runs: a run killed outright (SIGKILL at the device's timeout)
        # still says which step it was in; end() replaces this with the step's result.
        step = StepResult(name, goal, FAIL, reason="running: the run ended during this step")
        self.report.steps.append(step)
        self.report.write()
        step.status, step.reason = SKIP, ""
        self.say(f"\n== {name}: {goal}")
        return step

    def end(self, step: StepResult, t0: float) -> None:
        step.seconds = round(time.monotonic() - t0, 2)
        self.say(
            f"== {step.name}: {step.status} in {step.seconds:.1f} s: {step.figure} {step.reason}"
        )
        self.report.write()

    # -- the steps -----------------------------------------------------------------------

    def env_step(self) -> None:
        step, t0 = (
            self.begin(
                "env",
                "print the image's python, torch, triton, CUDA device, "
                "protobuf and grpcio (before the wheelhouse)",
            ),
            time.monotonic(),
        )
        result = self.work / "env.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu.probe", "--result", str(result)]
        rc, timed_out, _ = self.spawn(cmd, min(90, self.remaining_s()), self.env)
        step.checks, figures = load_checks(result)
        self.report.env = figures
        self.cuda = bool(figures.get("cuda"))
        self.report.mode = "cuda" if self.cuda else "no-cuda"
        step.settle(rc, timed_out, 90)
        step.figure = step.checks[0].figure if step.checks else step.figure
        self.end(step, t0)

    def wheelhouse_step(self) -> None:
        step, t0 = (
            self.begin(
                "wheelhouse",
                f"{self.wheels} complete (manifest, sha256, one "
                "wheel per pinned distribution) and installed",
            ),
            time.monotonic(),
        )
        problems = wheelhouse.verify(self.wheels)
        step.checks.append(
            Check(
                "manifest",
                FAIL if problems else PASS,
                f"{len(problems)} problems",
                "; ".join(problems)[:1500],
            )
        )
        here_is_target = sys.version_info[:2] == (3, 12)
        if not problems:
            done = wheelhouse.install(
                self.wheels, self.site, for_target_platform=not here_is_target
            )
            how = "into the run's site" if here_is_target else "as for CPython 3.12 manylinux"
            step.checks.append(
                Check(
                    "pip install --no-index",
                    PASS if done.returncode == 0 else FAIL,
                    f"exit {done.returncode}",
                    f"{how}; {done.stderr[-800:]}".strip("; "),
                )
            )
            if done.returncode == 0 and here_is_target:
                self.env["PYTHONPATH"] = f"{self.site}{os.pathsep}{REPO}"
        step.settle(0, False, 0)
        step.figure = (
            f"{wheelhouse.folder_bytes(self.wheels) / 2**20:.1f} MiB, "
            f"{len(list(self.wheels.glob('*.whl')))} wheels"
            if self.wheels.is_dir()
            else "absent"
        )
        self.end(step, t0)

    def imports_step(self) -> None:
        step, t0 = (
            self.begin(
                "imports",
                "every module the steps import resolves (and the gRPC "
                "stubs accept the protobuf/grpcio they get)",
            ),
            time.monotonic(),
        )
        code = (
            "import importlib, importlib.metadata as md, sys\n"
            f"bad = []\nfor m in {MODULES!r}:\n"
            "    try: importlib.import_module(m)\n"
            "    except Exception as e: bad.append(f'{m}: {type(e).__name__}: {e}')\n"
            "print('effective: protobuf', md.version('protobuf'), 'grpcio', md.version('grpcio'),"
            " 'pytest', md.version('pytest'))\n"
            "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n"
        )
        rc, timed_out, tail = self.spawn(
            [sys.executable, "-c", code], min(90, self.remaining_s()), self.env
        )
        ok = rc == 0
        step.figure = f"{len(MODULES)} modules" + (" resolve" if ok else ": some do not resolve")
        effective = [line for line in tail.splitlines() if line.startswith("effective:")]
        step.figure += f" ({effective[0]})" if effective else ""
        step.checks.append(
            Check(
                "import",
                PASS if ok else FAIL,
                f"{len(MODULES)} modules",
                "" if ok else tail[-1500:],
            )
        )
        step.settle(0, timed_out, 90)
        self.end(step, t0)

    def pytest_step(self, gpu: GpuStep) -> None:
        step, t0 = self.begin(gpu.name, gpu.goal), time.monotonic()
        env = self.env | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "TRITON_INTERPRET": "0"}
        junit = self.report.out / "pytest-gpu.xml"
        cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, *GPU_TEST_FILES]
        if not self.cuda:
            rc, timed_out, tail = self.spawn(
                [*cmd, "-q", "--collect-only"], min(90, self.remaining_s()), env
            )
            count = collected_count(tail)
            step.status = FAIL if rc or timed_out or not count else SKIP
            step.figure = f"{count} gpu tests collected"
            step.reason = (
                "no CUDA on this machine: collected only" if step.status == SKIP else tail[-800:]
            )
            return self.end(step, t0)
        timeout = min(gpu.timeout_s, self.remaining_s() - 5)
        if timeout < 15:
            step.reason = f"the run's time budget is spent ({self.remaining_s():.0f} s left)"
            return self.end(step, t0)
        rc, timed_out, output = self.spawn([*cmd, "-v", f"--junitxml={junit}"], timeout, env)
        # pytest writes its junit file at the end; killed before, its -v lines still tell.
        step.checks = junit_checks(junit) or verbose_checks(output)
        step.settle(rc, timed_out, timeout)
        counts = {s: sum(c.status == s for c in step.checks) for s in (PASS, FAIL, SKIP)}
        step.figure = f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped"
        if counts[SKIP] and step.status == PASS:
            step.status, step.reason = FAIL, "gpu tests skipped on a CUDA machine"
        self.end(step, t0)

    def gpu_step(self, gpu: GpuStep) -> None:
        if gpu.name == "pytest-gpu":
            return self.pytest_step(gpu)
        step, t0 = self.begin(gpu.name, gpu.goal), time.monotonic()
        if not self.cuda:
            step.reason = "no CUDA on this machine (torch.cuda.is_available() is False)"
            return self.end(step, t0)
        timeout = min(gpu.timeout_s, self.remaining_s() - 5)
        if timeout < 15:
            step.reason = f"the run's time budget is spent ({self.remaining_s():.0f} s left)"
            return self.end(step, t0)
        result = self.work / f"{gpu.name}.json"
        cmd = [sys.executable, "-m", gpu.module, "--result", str(result)]
        cmd += ["--quick"] if self.quick else []
        # --quick keeps the caller's TRITON_INTERPRET (1: the harness under the interpreter)
        interpret = os.environ.get("TRITON_INTERPRET", "0") if self.quick else "0"
        rc, timed_out, _ = self.spawn(cmd, timeout, self.env | {"TRITON_INTERPRET": interpret})
        step.checks, figures = load_checks(result)
        if gpu.name == "throughput":
            self.report.env["throughput"] = figures
        step.settle(rc, timed_out, timeout)
        self.end(step, t0)

    def run(self, only: set[str]) -> int:
        def stop(signum: int, _frame: object) -> None:
            raise StoppedError(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        try:
            self.env_step()
            self.wheelhouse_step()
            self.imports_step()
            for gpu in GPU_STEPS:
                if not only or gpu.name in only:
                    self.gpu_step(gpu)
            self.report.finished = True
        except StoppedError as e:
            self.report.stopped = f"stopped by {e}"
            if self.report.steps:
                last = self.report.steps[-1]
                last.status, last.reason = FAIL, f"stopped by {e} while running"
        finally:
            self.report.write()
            self.summary()
            shutil.rmtree(self.work, ignore_errors=True)
        return self.report.exit_code()

    def summary(self) -> None:
        self.say(f"\n== summary ({self.report.mode}; {self.report.out}/gpu-check.md)")
        for s in self.report.steps:
            self.say(f"{s.status:4} {s.name:11} {s.seconds:6.1f} s  {s.figure}  {s.reason}"[:400])


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
