"""What the GPU check needs on an air-gapped GPU machine, and getting it there in transfers.

The GPU machine (/work/shared/REFERENCE.md, "The GPU test machine"): Python 3.12 with torch, CuPy,
CUDA 13 libraries and the *CPU* onnxruntime; no package index; at most 64 MiB per transfer (the
checkout that travels with each command included); it forgets everything 30 s after a command;
15 minutes of GPU time in all, each start included. So the preparation, here, packs everything
the checks need that the machine lacks into one payload (the onnxruntime-gpu wheel, the project's
own wheel, the wheels of its dependencies the machine lacks, the git-ignored minilm model),
splits it into parts that fit a transfer with the checkout beside them, and prints the plan. On
the machine, each command of the plan receives one part (checked against the manifest) into a
stash; the last one reassembles the payload (checked again), installs the wheels into a folder
(``pip install --target``; nothing of the machine's own site-packages changes) and runs the checks.

Standard library only: on the GPU machine this runs before anything of ours is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
TRANSFER_LIMIT = 64 * MIB
DEFAULT_PART = 56 * MIB  # leaves 8 MiB of each transfer for the checkout (about 4 MiB today)
GPU_BUDGET_S = 15 * 60
ORT_GPU = "onnxruntime-gpu==1.31.1"
STASH = Path(os.environ.get("BATCHGATE_GPU_STASH", "/tmp/batchgate-gpu"))

# The GPU machine's image's packages (PEP 503 names); anything the checks import and this lacks
# travels as a wheel. Data, so it lives beside this file.
GPU_MACHINE_HAS = frozenset(
    line.strip()
    for line in (Path(__file__).with_name("gpu_machine_packages.txt")).read_text().splitlines()
    if line.strip() and not line.startswith("#")
)
# Carried even though the machine has them, in the versions tested here: the generated gRPC code
# and grpcio-health-checking / -reflection 1.81.1 need grpcio 1.81.1 and protobuf 6 exactly
# (pyproject.toml); pydantic-core and pytest-asyncio need recent typing-extensions and pytest.
# All small (about 8 MiB together), so no guess about what versions the machine holds.
ALWAYS_CARRY = frozenset(
    {"grpcio", "protobuf", "typing-extensions", "pytest", "pluggy", "iniconfig", "pytest-timeout"}
)
# What the checks import besides the serving dependencies: the stock client and the test runner.
CHECK_REQUIREMENTS = ("tritonclient[grpc]", "pytest", "pytest-asyncio", "pytest-timeout")
# pip download's platform tags for a cp312 manylinux x86-64 machine (glibc >= 2.28: the ORT wheel's).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 * MIB), b""):
            h.update(block)
    return h.hexdigest()


# -- preparation (here) ---------------------------------------------------------------------------


def closure(roots: list[str], python_version: str = "3.12") -> dict[str, str]:
    """{name: installed version} of ``roots`` and everything they need, read from this machine's
    installed metadata, with markers evaluated for the GPU machine's Python on Linux."""
    from importlib import metadata

    from packaging.requirements import Requirement

    env = {"python_version": python_version, "python_full_version": f"{python_version}.0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "os_name": "posix"}  # fmt: skip
    out: dict[str, str] = {}
    todo = [(Requirement(r), "") for r in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
            continue
        name = normalize(req.name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise SystemExit(
                f"{req.name} (needed by the GPU check) is not installed here to read its version"
            ) from None
        seen = name in out
        out[name] = dist.version
        extras = sorted(req.extras)
        if seen and not extras:
            continue
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or not extras:
                todo.append((sub, ""))
            else:
                todo.extend((sub, e) for e in extras)
    return out


def wheels_to_carry(project_requirements: list[str]) -> dict[str, str]:
    """{name: version} the GPU machine lacks (or must have in this exact version)."""
    need = closure([*project_requirements, *CHECK_REQUIREMENTS])
    skip = {"onnxruntime", "onnxruntime-gpu", "cupy-cuda13x", "batchgate"}
    return {n: v for n, v in sorted(need.items())
            if n not in skip and (n not in GPU_MACHINE_HAS or n in ALWAYS_CARRY)}  # fmt: skip


def pip_download(requirements: list[str], dest: Path) -> None:
    """Wheels for the GPU machine's Python (cp312, manylinux x86-64), without their dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest),
           *requirements]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pip download {' '.join(requirements)} failed:\n{proc.stderr[-3000:]}")


@dataclass
class Item:
    path: str  # inside the payload: wheels/<file>.whl, models/minilm/...
    source: Path
    role: str  # "ort" | "project" | "dependency" | "model"


def pack(items: list[Item], payload: Path) -> None:
    """One tar of every item (uncompressed: wheels are zips already, float weights barely shrink)."""
    with tarfile.open(payload, "w", format=tarfile.PAX_FORMAT) as tar:
        for it in items:
            info = tar.gettarinfo(str(it.source), arcname=it.path)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0  # the same inputs give the same payload, byte for byte
            with open(it.source, "rb") as f:
                tar.addfile(info, f)


def split(payload: Path, out: Path, part_bytes: int) -> list[dict]:
    """part-01, part-02, … of at most ``part_bytes`` each, in ``out``; their names, sizes, hashes."""
    if part_bytes < 1 * MIB:
        raise ValueError(f"part size must be at least 1 MiB, got {part_bytes} bytes")
    parts = []
    with open(payload, "rb") as f:
        k = 0
        while True:
            k += 1
            name = f"part-{k:02d}"
            h, n = hashlib.sha256(), 0
            with open(out / name, "wb") as w:
                while n < part_bytes:
                    block = f.read(min(4 * MIB, part_bytes - n))
                    if not block:
                        break
                    w.write(block)
                    h.update(block)
                    n += len(block)
            if n == 0:
                (out / name).unlink()
                break
            parts.append({"name": name, "bytes": n, "sha256": h.hexdigest()})
    return parts


def tree_bytes(root: Path) -> int:
    """Bytes of what travels with every command besides the carried paths: tracked files and
    untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           check=True, capture_output=True).stdout.split(b"\0")  # fmt: skip
    total = 0
    for n in names:
        p = root / os.fsdecode(n)
        if n and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def plan(parts: list[dict], tree: int, out_rel: str, *, start_s: float = 120.0, per_transfer_s: float = 30.0,
         install_s: float = 45.0, budget_s: float = GPU_BUDGET_S) -> dict:  # fmt: skip
    """The device calls, one part each, and the GPU-machine time they cost by these estimates:
    ``start_s`` for the machine's start (a minute or more, by the device notes), ``per_transfer_s``
    for each call's transfer and command, ``install_s`` for reassembly and the installs."""
    calls = []
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        cmd = f"python3 bench/gpu_check.py --receive {out_rel}"
        if last:
            cmd += " --run --out $OUT"
        calls.append({"call": i + 1, "carry": [f"{out_rel}/manifest.json", f"{out_rel}/{p['name']}"],
                      "bytes": p["bytes"] + tree, "fits": p["bytes"] + tree <= TRANSFER_LIMIT, "command": cmd})  # fmt: skip
    prep = start_s + per_transfer_s * len(parts) + install_s
    left = budget_s - prep
    return {"calls": calls, "tree_bytes": tree, "transfer_limit": TRANSFER_LIMIT,
            "estimate_s": {"start": start_s, "transfers": per_transfer_s * len(parts), "install": install_s,
                           "before_checks": prep, "left_for_checks": left, "budget": budget_s},
            "ok": all(c["fits"] for c in calls) and left >= budget_s / 2}  # fmt: skip


def print_plan(manifest: dict, log=print) -> None:
    p = manifest["plan"]
    log(f"payload: {manifest['payload_bytes'] / MIB:.1f} MiB in {len(manifest['parts'])} part(s); "
        f"the checkout travels beside each: {p['tree_bytes'] / MIB:.1f} MiB")  # fmt: skip
    for c in manifest["contents"]:
        log(f"  {c['bytes'] / MIB:8.1f} MiB  {c['path']}  ({c['role']})")
    log("device calls, one after another, each within 30 s of the last (the machine forgets after 30 s):")
    for c in p["calls"]:
        mark = "ok" if c["fits"] else f"OVER {TRANSFER_LIMIT / MIB:.0f} MiB"
        log(
            f"  {c['call']}. {c['bytes'] / MIB:5.1f} MiB [{mark}]  carry={json.dumps(c['carry'])}  {c['command']}"
        )
    e = p["estimate_s"]
    log(f"GPU-machine time, estimated: start {e['start']:.0f}s + transfers {e['transfers']:.0f}s + install "
        f"{e['install']:.0f}s = {e['before_checks']:.0f}s; left for the checks {e['left_for_checks']:.0f}s of "
        f"{e['budget']:.0f}s ({'at least' if p['ok'] else 'LESS than'} half)")  # fmt: skip


def prepare(out: Path, root: Path, *, ort_wheel: Path | None = None, wheel_dir: Path | None = None,
            minilm: Path | None = None, part_bytes: int = DEFAULT_PART, project_requirements: list[str] | None = None,
            log=print) -> dict:  # fmt: skip
    """Fill ``out`` with manifest.json and part-NN (what travels), and return the manifest.

    ``ort_wheel``: the onnxruntime-gpu wheel (else downloaded, once, into out/download);
    ``wheel_dir``: the dependency and project wheels to carry (else built and downloaded);
    ``minilm``: the minilm model folder (config.pbtxt, tokenizer.json, 1/model.onnx), else none.
    """
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*"):
        old.unlink()
    items: list[Item] = []
    download = out / "download"
    if ort_wheel is None:
        download.mkdir(exist_ok=True)
        found = sorted(download.glob("onnxruntime_gpu-1.31.1-cp312-*.whl"))
        if not found:
            log(f"downloading {ORT_GPU} (cp312, manylinux_2_28; about 244 MiB) into {download}")
            pip_download([ORT_GPU], download)
            found = sorted(download.glob("onnxruntime_gpu-1.31.1-cp312-*.whl"))
        if not found:
            raise SystemExit(f"{ORT_GPU} for cp312 manylinux_2_28 is not available from the package index")
        ort_wheel = found[0]
    items.append(Item(f"wheels/{ort_wheel.name}", ort_wheel, "ort"))
    if wheel_dir is None:
        wheel_dir = download / "wheels"
        if wheel_dir.exists():
            shutil.rmtree(wheel_dir)
        wheel_dir.mkdir(parents=True)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(wheel_dir), str(root)], check=True, capture_output=True)  # fmt: skip
        reqs = project_requirements if project_requirements is not None else _project_requirements()
        carry = wheels_to_carry(reqs)
        log(
            f"dependencies the GPU machine lacks (or needs in this version): {', '.join(f'{n}=={v}' for n, v in carry.items())}"
        )
        pip_download([f"{n}=={v}" for n, v in carry.items()], wheel_dir)
    for w in sorted(wheel_dir.glob("*.whl")):
        role = "project" if w.name.startswith("batchgate-") else "dependency"
        items.append(Item(f"wheels/{w.name}", w, role))
    if minilm is not None:
        for f in sorted(p for p in minilm.rglob("*") if p.is_file()):
            items.append(Item(f"models/minilm/{f.relative_to(minilm).as_posix()}", f, "model"))
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        payload = Path(tmp) / "payload.tar"
        pack(items, payload)
        manifest = {
            "format": 1,
            "payload_bytes": payload.stat().st_size,
            "payload_sha256": sha256(payload),
            "contents": [
                {"path": it.path, "bytes": it.source.stat().st_size, "role": it.role} for it in items
            ],
            "parts": split(payload, out, part_bytes),
        }
    try:
        rel = out.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        rel = out.name
        log(f"note: {out} is outside the checkout; the device tool carries paths inside it only")
    manifest["plan"] = plan(manifest["parts"], tree_bytes(root), rel)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print_plan(manifest, log)
    return manifest


def _project_requirements() -> list[str]:
    from importlib import metadata

    return [r for r in metadata.distribution("batchgate").requires or [] if "extra ==" not in r]


# -- the GPU machine ----------------------------------------------------------------------------


def receive(src: Path, stash: Path = STASH, log=print) -> list[str]:
    """Move the parts found in ``src`` into ``stash``, each checked against the manifest; return
    the names still missing. A part that does not match is refused (and not kept)."""
    (stash / "parts").mkdir(parents=True, exist_ok=True)
    manifest_path = src / "manifest.json"
    if manifest_path.exists():
        new = json.loads(manifest_path.read_text())
        old = stash / "manifest.json"
        if old.exists() and json.loads(old.read_text())["payload_sha256"] != new["payload_sha256"]:
            log("a different payload than the stash's: starting over")
            shutil.rmtree(stash)
            (stash / "parts").mkdir(parents=True)
        shutil.copy(manifest_path, stash / "manifest.json")
    if not (stash / "manifest.json").exists():
        raise SystemExit(
            f"no manifest.json in {src} or {stash}: carry {src}/manifest.json with the first part"
        )
    manifest = json.loads((stash / "manifest.json").read_text())
    want = {p["name"]: p for p in manifest["parts"]}
    for f in sorted(src.glob("part-*")):
        p = want.get(f.name)
        if p is None or f.stat().st_size != p["bytes"] or sha256(f) != p["sha256"]:
            raise SystemExit(f"{f}: not the part the manifest names (size or sha256 differ): send it again")
        dest = stash / "parts" / f.name
        if not dest.exists():
            shutil.copy(f, dest)
            log(f"received {f.name} ({p['bytes'] / MIB:.1f} MiB)")
    missing = [n for n in want if not (stash / "parts" / n).exists()]
    log(
        f"stash {stash}: {len(want) - len(missing)} of {len(want)} part(s)"
        + (f"; missing {missing}" if missing else "")
    )
    return missing


def reassemble(stash: Path = STASH) -> Path:
    """The payload from its parts, byte for byte (its sha256 checked); the parts are removed."""
    manifest = json.loads((stash / "manifest.json").read_text())
    payload = stash / "payload.tar"
    h = hashlib.sha256()
    with open(payload, "wb") as w:
        for p in manifest["parts"]:
            with open(stash / "parts" / p["name"], "rb") as f:
                for block in iter(lambda: f.read(4 * MIB), b""):
                    w.write(block)
                    h.update(block)
    if h.hexdigest() != manifest["payload_sha256"]:
        payload.unlink()
        raise SystemExit("the reassembled payload's sha256 differs from the manifest's: parts are corrupt")
    shutil.rmtree(stash / "parts")
    return payload


def install(stash: Path = STASH, python: str = sys.executable, log=print) -> Path:
    """Reassemble, unpack and ``pip install --target`` every carried wheel into stash/site; return it."""
    site = stash / "site"
    if (stash / "installed.json").exists():
        return site
    t = time.perf_counter()
    payload = reassemble(stash)
    unpacked = stash / "payload"
    with tarfile.open(payload) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(unpacked, filter="data")
        else:  # Python < 3.12 without the filter: the manifest's own paths only
            tar.extractall(unpacked)
    payload.unlink()
    wheels = sorted(str(w) for w in (unpacked / "wheels").glob("*.whl"))
    cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site), *wheels]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"installing the carried wheels failed:\n{proc.stderr[-3000:]}")
    (stash / "installed.json").write_text(json.dumps({"wheels": [Path(w).name for w in wheels],
                                                      "seconds": round(time.perf_counter() - t, 1)}))  # fmt: skip
    log(f"installed {len(wheels)} wheel(s) into {site} in {time.perf_counter() - t:.1f}s")
    return site


def work_dir(stash: Path, root: Path) -> Path:
    """A folder with the checkout's tests/ and model_repository/ (and the carried minilm), but no
    batchgate/ folder, which would shadow the installed package of the same name."""
    work = stash / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    for name in ("tests", "model_repository"):
        shutil.copytree(root / name, work / name, ignore=shutil.ignore_patterns("__pycache__"), symlinks=True)
    minilm = stash / "payload" / "models" / "minilm"
    if minilm.is_dir():
        dest = work / "model_repository" / "minilm"
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(minilm, dest)
    return work


def cuda_library_path(python: str = sys.executable) -> str:
    """The lib folders of the nvidia-* wheels (cuBLAS, cuDNN, the CUDA runtime, …) of ``python``,
    for LD_LIBRARY_PATH: onnxruntime-gpu's CUDA provider dlopens them by name."""
    code = ("import nvidia, os; print(os.pathsep.join(sorted({os.path.join(r) for p in nvidia.__path__ "
            "for r, d, f in os.walk(p) if any('.so' in x for x in f)})))")  # fmt: skip
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""
