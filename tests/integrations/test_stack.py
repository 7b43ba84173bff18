"""``kvtierd stack`` as a user runs it: the documented command line, the real model, Ctrl-C."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks._support.servers import get_json, post, post_stream
from kvtierd.errors import ConfigError, UnavailableError
from kvtierd.integrations import stack as stack_module
from kvtierd.integrations import stack_cli
from kvtierd.integrations.cpu_dtype import choose_dtype, cpu_flags, given_dtype
from kvtierd.integrations.stack import Stack, StackConfig

KVTIERD = str(Path(sys.executable).with_name("kvtierd"))
KVTIERCTL = str(Path(sys.executable).with_name("kvtierctl"))


class StackProcess:
    """``kvtierd stack ...`` in the background; its stdout read line by line."""

    def __init__(self, *argv: str) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [KVTIERD, "stack", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def wait_for(self, needle: str, timeout_s: float = 420) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            self.lines.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no {needle!r} in the stack's output:\n{''.join(self.lines)}")

    def rest(self, timeout_s: float = 120) -> str:
        out, _ = self.proc.communicate(timeout=timeout_s)
        return "".join(self.lines) + out

    def kill(self) -> None:
        """Stop the stack as Ctrl-C does, so that it stops its parts (each in a session of its
        own: a SIGKILL of the stack alone left the daemon, vLLM and the router running)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _listed_port(text: str, part: str) -> int:
    """The port of ``part`` in the stack's "kvtierd stack: PART http://HOST:PORT" line."""
    for line in text.splitlines():
        words = line.split()
        if words[:3] == ["kvtierd", "stack:", part] and words[3].startswith("http://"):
            return int(words[3].rsplit(":", 1)[1])
    raise AssertionError(f"no {part} line in:\n{text}")


def answers(url: str, port: int) -> bool:
    try:
        get_json(f"http://127.0.0.1:{port}/health")
    except OSError:
        return False
    return True


@pytest.mark.vllm
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_documented_command_serves_the_real_model_and_stops_on_ctrl_c(
    real_model: Path, tmp_path: Path
) -> None:
    # Port 0: the router binds any free port and reports it, vLLM gets one the stack offers.
    stack = StackProcess("--model", "smollm2", "--work-dir", str(tmp_path), "--port", "0",
                         "--vllm-port", "0", "--chunk-size", "16",
                         "--no-prefix-caching", "--daemon-log-level", "debug")  # fmt: skip
    try:
        stack.wait_for("kvtierd stack: ready")
        text = "".join(stack.lines)
        assert f"unix:{tmp_path / 'kvtierd.sock'}" in text
        assert f"kvtierd stack: vLLM dtype {choose_dtype(cpu_flags()).dtype} (" in text, text
        port, vllm_port = _listed_port(text, "router"), _listed_port(text, "vllm")
        assert port not in (0, vllm_port) and vllm_port != 0
        _the_printed_request_works(stack, port)
        doc = " ".join(["Paris is the capital of France and its largest city."] * 20)
        question = f"{doc}\nWhat is the capital of France?"
        body = {"model": "smollm2", "max_tokens": 12, "temperature": 0.0,
                "messages": [{"role": "user", "content": question}]}  # fmt: skip
        first, _ = post(f"http://127.0.0.1:{port}/v1/chat/completions", body)
        second, _ = post(f"http://127.0.0.1:{port}/v1/chat/completions", body)
        assert "Paris" in first["choices"][0]["message"]["content"]
        # vLLM's prefix cache is off: the second prompt's KV came back from the daemon
        assert second["choices"][0]["message"] == first["choices"][0]["message"]
        status = subprocess.run(
            [KVTIERCTL, "--socket", str(tmp_path / "kvtierd.sock"), "status", "--json"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        daemon = json.loads(status.stdout)
        # every chunk of the prompt was read back (with vLLM's prefix cache on: only a lookup)
        assert daemon["objects"] > 1 and daemon["hits"] == daemon["objects"], daemon
        _streamed_requests_report_their_timing(port, "smollm2", tmp_path / "kvtierd.sock")
        # --daemon-log-level debug: the daemon says what it did with the contexts and why
        log = (tmp_path / "daemon.log").read_text()
        assert "DEBUG kvtierd.engine.executor: plan operation place on" in log, log[-2000:]
        stack.proc.send_signal(signal.SIGINT)
        out = stack.rest()
        assert stack.proc.returncode == 0, out
        assert "kvtierd stack: stopped" in out and "Traceback" not in out
        assert not answers("router", port) and not answers("vllm", vllm_port)
        assert not (tmp_path / "kvtierd.sock").exists()  # the daemon shut down cleanly
    finally:
        stack.kill()


def _the_printed_request_works(stack: StackProcess, port: int) -> None:
    """Issue 41: the stack served the model under its path, so the docs' ``"model":
    "smollm2"`` answered 404. It serves ``--model smollm2`` as ``smollm2`` and prints a request
    that works: sent here as printed."""
    line = stack.wait_for("kvtierd stack: try: curl", timeout_s=10)
    command = shlex.split(line.split("try: ", 1)[1])
    url, body = command[2], json.loads(command[command.index("-d") + 1])
    assert url == f"http://127.0.0.1:{port}/v1/completions" and body["model"] == "smollm2"
    answer, _ = post(url, body)
    assert answer["model"] == "smollm2" and answer["choices"][0]["text"], answer


def _streamed_requests_report_their_timing(port: int, model: str, socket: Path) -> None:
    """Issue 13.3: the router times streamed requests and reports them (prefill samples for
    the daemon's TTFT model); a client that did not ask for usage gets no usage event."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    for i, words in enumerate((30, 60)):  # new documents: misses, computed in full
        prompt = " ".join([f"Document {i} says the river is {words} miles long."] * words)
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
        events, _ = post_stream(url, body)
        assert events[-1] == "[DONE]"
        assert all(e == "[DONE]" or e["choices"] for e in events), events[-3:]
    asked = {"model": model, "prompt": "One more question.", "max_tokens": 2,
             "stream_options": {"include_usage": True}}  # fmt: skip
    events, _ = post_stream(url, asked)
    assert events[-2]["usage"]["prompt_tokens"] > 0  # the client asked: it gets the usage
    deadline = time.monotonic() + 60
    while True:  # reports go in the background
        s = json.loads(subprocess.run(
            [KVTIERCTL, "--socket", str(socket), "status", "--json"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout)  # fmt: skip
        if s.get("prefill_samples", 0) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert s.get("prefill_samples", 0) >= 2, s


def test_bad_arguments_are_one_clear_line(tmp_path: Path) -> None:
    r = subprocess.run(
        [KVTIERD, "stack", "--model", str(tmp_path / "none"), "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2
    assert "is neither a checkpoint folder nor one of smollm2" in r.stderr
    r = subprocess.run(
        [KVTIERD, "stack", "--model", str(tmp_path), "--chunk-size", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "chunk_size must be >= 1" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run(
        [KVTIERD, "stack", "--model", str(tmp_path), "--daemon-log-level", "loud"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and "invalid choice: 'loud'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    with pytest.raises(ConfigError, match="daemon_log_level must be one of debug, info, warning"):
        StackConfig(model=tmp_path, work_dir=tmp_path, daemon_log_level="loud")


AVX2_EPYC = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2 sha_ni"  # no bf16
ZEN4 = AVX2_EPYC + " avx512f avx512bw avx512_bf16"
SAPPHIRE_RAPIDS = ZEN4 + " amx_bf16 amx_tile amx_int8"


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        (AVX2_EPYC, "float32"),
        (AVX2_EPYC + " avx512f avx512bw avx512_vnni", "float32"),  # AVX-512 without BF16
        (ZEN4, "bfloat16"),  # AVX-512 BF16, no AMX
        (AVX2_EPYC + " amx_bf16", "bfloat16"),
        ("", "float32"),  # no flags known (not Linux, another architecture)
    ],
)
def test_vllm_dtype_is_chosen_by_the_cpu_s_flags(flags: str, dtype: str) -> None:
    choice = choose_dtype(flags.split())
    assert (choice.dtype, choice.given) == (dtype, False)
    if dtype == "float32":
        assert "neither avx512_bf16 nor amx_bf16" in choice.reason
    else:
        assert "the CPU has " in choice.reason


def test_amx_tiles_mean_float32_where_the_kvtierd_connector_reads_the_kv() -> None:
    """With AMX tiles vLLM keeps bf16 KV in its AMX block layout, which the kvtierd CPU
    connector refuses (LMCache then fails to start: seen on this project's Xeon, issue 25)."""
    choice = choose_dtype(SAPPHIRE_RAPIDS.split())
    assert choice.dtype == "float32" and "amx_tile" in choice.reason
    assert choose_dtype(SAPPHIRE_RAPIDS.split(), connector=False).dtype == "bfloat16"


@pytest.mark.parametrize(
    "args",
    [("--dtype=bfloat16",), ("--dtype", "bfloat16"), ("--dtype", "half", "--dtype=bfloat16")],
)
def test_a_dtype_among_vllm_s_arguments_wins(args: tuple[str, ...]) -> None:
    choice = choose_dtype(AVX2_EPYC.split(), args)
    assert (choice.dtype, choice.given) == ("bfloat16", True)
    assert given_dtype(("--max-num-seqs", "8")) is None


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx2 fma\n")  # fmt: skip
    assert cpu_flags(info) == {"fpu", "avx2", "fma"}
    assert cpu_flags(tmp_path / "absent") == frozenset()


def _vllm_dtype_args(cmd: list[str]) -> list[str]:
    return [a for i, a in enumerate(cmd) if a.startswith("--dtype") or cmd[i - 1] == "--dtype"]


@pytest.mark.parametrize(
    ("flags", "dtype"), [(AVX2_EPYC, "float32"), (ZEN4, "bfloat16"), (SAPPHIRE_RAPIDS, "float32")]
)
def test_the_stack_starts_vllm_in_the_chosen_dtype(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flags: str, dtype: str
) -> None:
    monkeypatch.setattr(stack_module, "cpu_flags", lambda: frozenset(flags.split()))
    monkeypatch.setattr(stack_module, "cuda_available", lambda: False)
    cmd = Stack(StackConfig(model=tmp_path, work_dir=tmp_path)).vllm_command()
    assert _vllm_dtype_args(cmd) == ["--dtype", dtype]
    given = StackConfig(model=tmp_path, work_dir=tmp_path, vllm_args=("--dtype=float16",))
    assert _vllm_dtype_args(Stack(given).vllm_command()) == ["--dtype=float16"]
    configured = StackConfig(model=tmp_path, work_dir=tmp_path, dtype="float32")
    assert _vllm_dtype_args(Stack(configured).vllm_command()) == ["--dtype", "float32"]
    alone = StackConfig(model=tmp_path, work_dir=tmp_path, backend="none")  # no connector
    want = "float32" if flags == AVX2_EPYC else "bfloat16"
    assert _vllm_dtype_args(Stack(alone).vllm_command()) == ["--dtype", want]


def test_the_stack_prints_its_dtype_choice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvtierd stack`` says which dtype it chose and why before starting anything (here the
    start fails at once: the daemon's config file does not exist)."""
    monkeypatch.setattr(stack_module, "cpu_flags", lambda: frozenset(AVX2_EPYC.split()))
    monkeypatch.setattr(stack_module, "cuda_available", lambda: False)
    code = stack_cli.main(["--model", str(tmp_path), "--work-dir", str(tmp_path / "work"),
                              "--config", str(tmp_path / "absent.yaml")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1
    assert "kvtierd stack: vLLM dtype float32 (the CPU has neither avx512_bf16 nor amx_bf16" in out


def test_ports_must_be_0_to_65535(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="router_port must be 0 \\(any free port\\) to 65535"):
        StackConfig(model=tmp_path, work_dir=tmp_path, router_port=70000)


FAKE_VLLM = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
try:
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
except OSError as e:
    sys.exit(f"ERROR: [Errno 98] {e}")  # vLLM's words when its port is taken
server.serve_forever()
"""


class _FakeVllmStack(Stack):
    """The stack with a few-line HTTP server in vLLM's place, started on the port the stack
    offers, failing as vLLM does when that port is taken."""

    def vllm_command(self) -> list[str]:
        return [sys.executable, "-c", FAKE_VLLM, str(self.vllm_port)]


def test_vllm_on_port_0_is_started_again_when_its_port_was_taken(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM cannot bind port 0 and say which port it got: the stack offers it a free port,
    which another process can take before vLLM binds it (the router's "address already in
    use" of issue 25). Then vLLM exits at once and the stack offers another."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        offers = [taken.getsockname()[1]]
        real_free_port = stack_module.free_port

        def offer(host: str) -> int:
            return offers.pop(0) if offers else real_free_port(host)

        monkeypatch.setattr(stack_module, "free_port", offer)
        config = StackConfig(model=tmp_path, work_dir=tmp_path, backend="none", vllm_port=0)
        with _FakeVllmStack(config) as stack:
            assert stack.vllm_port not in (0, taken.getsockname()[1])
            assert get_json_ok(f"{stack.vllm_url}/health")
        assert "Address already in use" in (tmp_path / "vllm.log").read_text()
        # a port the user chose is not changed: taken, the start fails
        fixed = StackConfig(model=tmp_path, work_dir=tmp_path / "fixed", backend="none",
                            vllm_port=taken.getsockname()[1])  # fmt: skip
        with pytest.raises(UnavailableError, match="vllm exited with 1 while starting"):
            _FakeVllmStack(fixed).start(timeout_s=30)


def get_json_ok(url: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return bool(r.status == 200)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_a_part_stops_when_the_stack_is_killed_outright(tmp_path: Path) -> None:
    """A stack killed with SIGKILL (or by the OOM killer) runs no clean-up: its parts must
    stop on their own, not keep their ports and memory."""
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, subprocess, sys, time\n"
         "from kvtierd.integrations.stack import stopped_with_parent\n"
         # a caller that ignores SIGTERM: its children inherit that through exec
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "child = subprocess.Popen(stopped_with_parent([sys.executable, '-c', "
         "'import time; time.sleep(120)']), start_new_session=True)\n"
         "print(child.pid, flush=True)\n"
         "time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        time.sleep(0.5)  # the child has exec'd its command
        with open(f"/proc/{child}/cmdline", "rb") as f:
            assert b"time.sleep(120)" in f.read()
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child), "the part outlived its stack"
    finally:
        parent.kill()
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (not a zombie awaiting its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_stack_s_daemon_profiles_with_the_model_it_serves(tmp_path: Path) -> None:
    """Without --config the stack writes the daemon's config, and its policy names the model
    vLLM serves as profiling.model_dir (issue 39): the daemon it starts says so in status."""
    from benchmarks._support.daemon_proc import DaemonProcess
    from kvtierd.cli.main import main

    model = tmp_path / "SmolLM2-135M-Instruct"  # read only once a context is profiled
    model.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    config = Stack(StackConfig(model=model, work_dir=work, cpu="64MiB", ssd="256MiB"))
    path = config.write_daemon_config()
    daemon = DaemonProcess(path, str(work / "kvtierd.sock"), work / "daemon.log").start()
    try:
        out = tmp_path / "status.json"
        with out.open("w") as f, contextlib.redirect_stdout(f):
            assert main(["status", "--json", "--socket", daemon.socket_path]) == 0
        quality = json.loads(out.read_text())["quality"]
        assert (quality["model_dir"], quality["model_dir_from"]) == (str(model), "policy")
        assert not quality["prior_only"]
        assert "quality profiles: prior only" not in daemon.logs()
    finally:
        daemon.kill()


def test_vllm_serves_a_short_model_name(tmp_path: Path) -> None:
    """vLLM's ``--served-model-name``: the config's name and the checkpoint's path (which
    the benchmarks' requests name); none without a name; one among the vLLM arguments goes as
    it is, once. ``kvtierd stack --model smollm2`` names it ``smollm2``."""
    model = tmp_path / "SmolLM2-135M-Instruct"

    def served(cmd: list[str]) -> list[str]:
        flag = "--served-model-name"
        return [a for i, a in enumerate(cmd) if a.startswith(flag) or cmd[i - 1] == flag]

    short = Stack(StackConfig(model=model, work_dir=tmp_path, served_name="smollm2"))
    assert served(short.vllm_command()) == ["--served-model-name", "smollm2"]
    command = short.vllm_command()
    at = command.index("--served-model-name")
    assert command[at : at + 3] == ["--served-model-name", "smollm2", str(model)]
    assert "smollm2" in short.example_request() and short.served_name == "smollm2"
    plain = Stack(StackConfig(model=model, work_dir=tmp_path))
    assert served(plain.vllm_command()) == [] and plain.served_name == str(model)
    given = StackConfig(model=model, work_dir=tmp_path, served_name="x",
                        vllm_args=("--served-model-name=mine",))  # fmt: skip
    assert served(Stack(given).vllm_command()) == ["--served-model-name=mine"]
    assert Stack(given).served_name == "mine"
    assert stack_cli._short_name("smollm2") == "smollm2"
    assert stack_cli._short_name(str(model)) == "SmolLM2-135M-Instruct"
