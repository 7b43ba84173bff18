"""The wheels the GPU machine's image lacks, for its CPython 3.12 on manylinux x86_64.

The image (docs/gpu-check.md) has torch, triton, numpy, pyyaml, xxhash, aiofiles,
prometheus-client, rich, hypothesis, pytest and pytest-timeout, but not highspy, redis-py or
pytest-asyncio, nor (as far as anyone has seen) grpcio-health-checking and grpcio-reflection.
Its grpcio and protobuf versions are unknown, and the checked-in stubs need protobuf >= 6.31.1,
< 7 (``kvtier_pb2.py`` validates its runtime) and grpcio >= 1.78.0 (``kvtier_pb2_grpc.py``), so
the versions CI runs (constraints.txt) travel too, with pytest and the packages it needs
(pytest-asyncio 1.5 needs pytest >= 8.4; the image's is unknown). torch, triton and numpy never
travel: the image's CUDA builds must stay.

``prepare`` downloads them with ``pip download --no-deps --only-binary=:all:`` for the target
interpreter and writes ``manifest.json`` (file, sha256, bytes); ``verify`` checks a wheelhouse
against the list and the manifest; ``install`` puts it into a target folder with
``pip install --no-index --no-deps --target`` (the folder then goes first on ``PYTHONPATH``).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO / ".gpu-wheels"
MANIFEST = "manifest.json"
LIMIT_BYTES = 64 << 20  # the device tool's limit on the tree plus carried folders
MARGIN_BYTES = 4 << 20  # room for files added to the tree before the run

TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

# Distribution -> version: the versions this repository's CI tests with (constraints.txt and
# the dev environment), so the GPU run sees the same stubs, placer and test plugins.
WHEELS: dict[str, str] = {
    "grpcio": "1.78.0",
    "grpcio-health-checking": "1.78.0",
    "grpcio-reflection": "1.78.0",
    "protobuf": "6.33.6",
    "highspy": "1.16.0",
    "redis": "8.1.0",
    "pytest": "9.2.0",
    "pluggy": "1.7.0",
    "iniconfig": "2.3.1",
    "packaging": "26.4",
    "pygments": "2.21.0",
    "pytest-asyncio": "1.5.0",
    "pytest-timeout": "2.4.0",
    "typing-extensions": "4.16.0",
}
NEVER_CARRIED = ("torch", "triton", "numpy")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True, slots=True)
class WheelFile:
    name: str  # canonical distribution name
    version: str
    file: str
    sha256: str
    size_bytes: int


def parse_wheel_name(file: str) -> tuple[str, str, str]:
    """``(canonical name, version, 'python-abi-platform' tags)`` of a wheel's file name."""
    parts = file.removesuffix(".whl").split("-")
    if not file.endswith(".whl") or len(parts) not in (5, 6):
        raise ValueError(f"{file!r} is not a wheel file name (name-version-py-abi-platform.whl)")
    return canonical(parts[0]), parts[1], "-".join(parts[-3:])


def tags_fit_target(tags: str) -> bool:
    """Whether a wheel's tags install on CPython 3.12, manylinux x86_64."""
    py, abi, plat = tags.split("-")
    py_ok = any(
        p in ("py3", "cp312") or (p.startswith("cp3") and abi == "abi3") for p in py.split(".")
    )
    abi_ok = any(a in ("none", "cp312", "abi3") for a in abi.split("."))
    plat_ok = any(p == "any" or p in TARGET_PLATFORMS for p in plat.split("."))
    return py_ok and abi_ok and plat_ok


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of what the device tool sends: tracked and untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    total = 0
    for name in out.decode().split("\0"):
        p = repo / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def prepare(dest: Path = DEFAULT_DIR, pip: tuple[str, ...] = ()) -> list[WheelFile]:
    """Download every wheel of :data:`WHEELS` for the target into ``dest`` (replaced whole)
    and write its manifest; raises if the tree plus the wheels exceed the carry limit."""
    pip = pip or (sys.executable, "-m", "pip")
    platform_args = [a for p in TARGET_PLATFORMS for a in ("--platform", p)]
    staging = dest.with_name(dest.name + ".partial")  # a failed download leaves dest as it was
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    cmd = [
        *pip,
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        TARGET_PYTHON,
        "--implementation",
        "cp",
        *platform_args,
        "--dest",
        str(staging),
        "--quiet",
        *(f"{n}=={v}" for n, v in WHEELS.items()),
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    write_manifest(staging)
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    problems = verify(dest)
    if problems:
        raise RuntimeError("the wheelhouse just built is incomplete: " + "; ".join(problems))
    check_size(dest)
    return _describe(dest)


def check_size(dest: Path) -> tuple[int, int]:
    wheels_b, tree_b = folder_bytes(dest), tree_bytes()
    total = wheels_b + tree_b
    print(
        f"wheelhouse {wheels_b / 2**20:.1f} MiB + tree {tree_b / 2**20:.1f} MiB = "
        f"{total / 2**20:.1f} MiB (limit {LIMIT_BYTES >> 20} MiB, "
        f"{MARGIN_BYTES >> 20} MiB kept free)"
    )
    if total > LIMIT_BYTES - MARGIN_BYTES:
        raise RuntimeError(
            f"tree + wheelhouse = {total} bytes, over {LIMIT_BYTES - MARGIN_BYTES} "
            f"({LIMIT_BYTES >> 20} MiB less {MARGIN_BYTES >> 20} MiB): the device tool would "
            "refuse to send it"
        )
    return wheels_b, tree_b


def _describe(folder: Path) -> list[WheelFile]:
    out = []
    for p in sorted(folder.glob("*.whl")):
        name, version, _ = parse_wheel_name(p.name)
        out.append(WheelFile(name, version, p.name, sha256_of(p), p.stat().st_size))
    return out


def _manifest_doc(wheels: list[WheelFile]) -> dict[str, object]:
    return {
        "python": TARGET_PYTHON,
        "platforms": list(TARGET_PLATFORMS),
        "wheels": [{f: getattr(w, f) for f in WheelFile.__slots__} for w in wheels],
    }


def write_manifest(folder: Path) -> None:
    """(Re)write ``folder``'s manifest from the wheels in it (used by tests' fake houses)."""
    (folder / MANIFEST).write_text(json.dumps(_manifest_doc(_describe(folder)), indent=1))


def verify(folder: Path, *, hashes: bool = True) -> list[str]:
    """Problems that would stop the run, each naming the wheel and what is wrong; ``[]`` when
    the wheelhouse holds exactly one fitting wheel of every pinned distribution, as listed."""
    if not (folder / MANIFEST).is_file():
        return [f"no {MANIFEST} in {folder} (run scripts/gpu-check --prepare here first)"]
    try:
        listed = [WheelFile(**w) for w in json.loads((folder / MANIFEST).read_text())["wheels"]]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{folder / MANIFEST} is not a wheelhouse manifest: {e}"]
    problems = []
    by_name: dict[str, list[WheelFile]] = {}
    for w in listed:
        by_name.setdefault(w.name, []).append(w)
        path = folder / w.file
        if not path.is_file():
            problems.append(f"{w.file} is in the manifest but not in {folder}")
        elif hashes and sha256_of(path) != w.sha256:
            problems.append(f"{w.file} does not match its sha256 in the manifest")
        if not tags_fit_target(parse_wheel_name(w.file)[2]):
            problems.append(f"{w.file} does not install on CPython {TARGET_PYTHON} x86_64")
        if w.name in NEVER_CARRIED:
            problems.append(f"{w.file}: {w.name} must come from the image, never the wheelhouse")
    for name, version in WHEELS.items():
        got = by_name.get(canonical(name), [])
        if len(got) != 1 or got[0].version != version:
            have = ", ".join(w.version for w in got) or "none"
            problems.append(f"{name}=={version} needed, wheelhouse has {have}")
    extra = {p.name for p in folder.glob("*.whl")} - {w.file for w in listed}
    problems += [f"{f} is in {folder} but not in the manifest" for f in sorted(extra)]
    return problems


def install(
    folder: Path, target: Path, *, for_target_platform: bool
) -> subprocess.CompletedProcess[str]:
    """``pip install --no-index --no-deps --target`` every wheel of the manifest.

    ``for_target_platform``: install as for CPython 3.12 manylinux (pip's platform options),
    which proves on a machine with another Python that pip accepts every wheel for the GPU
    machine's; the result is then not importable here."""
    files = [str(folder / w["file"]) for w in json.loads((folder / MANIFEST).read_text())["wheels"]]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--quiet",
        "--target",
        str(target),
    ]
    if for_target_platform:
        cmd += ["--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation", "cp"]
        cmd += [a for p in TARGET_PLATFORMS for a in ("--platform", p)]
    return subprocess.run([*cmd, *files], capture_output=True, text=True, timeout=120, check=False)
