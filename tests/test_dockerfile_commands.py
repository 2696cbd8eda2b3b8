"""Every command a Dockerfile runs that can run here, run as the image would run it.

tests/test_helm.py reads the Dockerfiles for what a build needs; this file runs what they run:
the build stages' smoke checks (``python -c …``, ``! pip show …``), parsed out of the RUN lines,
the entrypoint with ``--help`` (and its default CMD), and the HEALTHCHECK command against a live
server. A RUN command this file does not know fails the test, so a new one gets a decision
(replay it here, or say why it cannot run) instead of going unchecked: a smoke import of a
module that moved once broke both image builds while every parse-only test passed.

"As the image would": the package is this checkout's wheel installed (not editable) into a fresh
venv, and each build-stage command runs in a copy of that stage's WORKDIR as its COPY lines fill
it. Both matter: in the image the sources' ``batchgate/`` folder sits in the working directory
of the smoke import and shadows the installed package unless the import is told not to look
there (``python -P``), which an editable install here would hide.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import onnxruntime as ort
import pytest

from tests.helpers import free_ports
from tests.test_helm import ROOT, _copy_sources, parse_dockerfile

DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
HAS_CUDA_EP = "CUDAExecutionProvider" in ort.get_available_providers()


class Image:
    """The wheel in a fresh venv: its python and bin stand for the image's /opt/batchgate/venv."""

    def __init__(self, tmp: Path) -> None:
        wheels = tmp / "wheels"
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
             str(ROOT)],
            check=True, capture_output=True,
        )  # fmt: skip
        (wheel,) = wheels.glob("batchgate-*.whl")
        venv = tmp / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        self.bin = venv / "bin"
        self.python = self.bin / "python"
        site = subprocess.run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        # The dependencies come from this venv's site-packages as a plain path (its editable-install
        # hook is not run there), so the only batchgate the fresh venv imports is the wheel's.
        deps = [p for p in sys.path if p.endswith("site-packages")] or [sysconfig.get_paths()["purelib"]]
        Path(site, "_deps.pth").write_text("\n".join(deps) + "\n")
        subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(self.python), "install", "--no-deps", "-q", str(wheel)],
            check=True, capture_output=True,
        )  # fmt: skip
        self.tmp = tmp

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        base = {
            k: v for k, v in os.environ.items() if not k.startswith(("BATCHGATE_", "PYTHON", "VIRTUAL_ENV"))
        }
        return {**base, "PATH": f"{self.bin}:{base.get('PATH', '')}", **(extra or {})}

    def workdir(self, dockerfile: str, stage_index: int) -> Path:
        """The stage's WORKDIR as its COPY lines (from the build context) leave it."""
        stage = parse_dockerfile(ROOT / dockerfile)[1][stage_index]
        where = self.tmp / f"{dockerfile}-{stage_index}"
        if where.exists():
            return where
        where.mkdir()
        for op, arg in stage.instructions:
            if op != "COPY":
                continue
            srcs, dest, flags = _copy_sources(arg)
            if "from" in flags or dest.startswith("/"):
                continue  # another stage's output, or outside WORKDIR: not what the smoke checks see
            for src in srcs:
                target = where / dest / (Path(src).name if dest.endswith("/") else "")
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(ROOT / src, target)
        return where

    def resolve(self, words: list[str]) -> list[str]:
        """The image's PATH puts the venv first."""
        head = words[0]
        if head in ("python", "python3"):
            return [str(self.python), *words[1:]]
        found = shutil.which(head, path=str(self.bin))
        assert found, f"{head} is not installed in the image's venv ({self.bin})"
        return [found, *words[1:]]

    def installed(self, dist: str) -> bool:
        cmd = [sys.executable, "-m", "pip", "--python", str(self.python), "show", "--quiet", dist]
        return subprocess.run(cmd, capture_output=True).returncode == 0


# Its wheel is built in the checkout's build/, as tests/test_packaging.py's is (tests/parallel.py).
pytestmark = pytest.mark.holds("build")


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Image:
    return Image(tmp_path_factory.mktemp("image"))


def run_commands(dockerfile: str) -> list[tuple[int, list[str]]]:
    """(stage index, words) for each ``&&``-joined command of each RUN (shell form); redirections
    dropped."""
    _, stages = parse_dockerfile(ROOT / dockerfile)
    out = []
    for i, stage in enumerate(stages):
        for run in stage.all("RUN"):
            cmd: list[str] = []
            for w in [*shlex.split(run), "&&"]:
                if w == "&&":
                    if cmd:
                        out.append((i, cmd))
                    cmd = []
                elif not (w.startswith(("2>", ">")) or w == "/dev/null"):
                    cmd.append(w)
    return out


def classify(cmd: list[str]) -> tuple[str, str]:
    """(what, arg): "python" (arg: its -c code), "absent" (arg: the dist of a `! pip show` guard),
    or "skip" (arg: why it cannot run here). Anything else is "unknown" and fails the test."""
    head = cmd[0]
    if head in ("python", "python3") and "-c" in cmd and cmd.index("-c") == len(cmd) - 2:
        return "python", cmd[-1]
    if head == "!" and cmd[1:4] == ["pip", "show", "--quiet"] and len(cmd) == 5:
        return "absent", cmd[4]
    if head in ("pip", "python", "python3") and "install" in cmd:
        return "skip", "the package install: this checkout's wheel in a fresh venv stands in for it"
    if head in ("python", "python3") and cmd[1:3] == ["-m", "venv"]:
        return "skip", "the image's virtualenv: the fresh venv stands in for it"
    if head in ("apt-get", "rm", "groupadd", "useradd"):
        return "skip", "image system setup (packages, users): not this machine's to change"
    if head == "if" and "prepare-minilm" in cmd:
        return "skip", "BAKE_MINILM downloads pinned weights; tests/test_minilm.py builds minilm"
    return "unknown", " ".join(cmd)


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_run_command_is_known(dockerfile):
    kinds = [classify(cmd) for _, cmd in run_commands(dockerfile)]
    unknown = [arg for what, arg in kinds if what == "unknown"]
    assert not unknown, f"{dockerfile} runs commands this test neither replays nor skips: {unknown}"
    # The image must smoke-import the server: without one, a moved module breaks only at run time.
    code = [arg for what, arg in kinds if what == "python"]
    assert any("batchgate.gateway" in c for c in code), f"{dockerfile}: no smoke import of the server"


def _smoke_cases():
    for dockerfile in DOCKERFILES:
        for stage, cmd in run_commands(dockerfile):
            what, arg = classify(cmd)
            if what in ("python", "absent"):
                yield pytest.param(dockerfile, stage, cmd, id=f"{dockerfile}:{what}:{arg[:50]}")


@pytest.mark.parametrize("dockerfile, stage, cmd", list(_smoke_cases()))
def test_build_smoke_command(image, dockerfile, stage, cmd):
    what, arg = classify(cmd)
    gpu_image = dockerfile == "Dockerfile.cuda"
    if what == "absent":
        # The guard that the other onnxruntime flavour is not installed: meaningful only in an
        # environment of the image's own flavour.
        if gpu_image != image.installed("onnxruntime-gpu"):
            pytest.skip(f"{dockerfile}'s flavour is not installed here; `! pip show {arg}` guards that image")
        assert not image.installed(arg), f"{arg} is installed beside this flavour's onnxruntime"
        return
    proc = subprocess.run(
        image.resolve(cmd), cwd=image.workdir(dockerfile, stage), env=image.env(),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if "CUDAExecutionProvider" in arg and not HAS_CUDA_EP:
        # The CPU wheel here: the image's check must refuse it (that is its job), by its assertion.
        assert proc.returncode != 0 and "AssertionError" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, f"{dockerfile}: `{shlex.join(cmd)}` fails here:\n{proc.stderr[-2000:]}"


def _final(dockerfile: str):
    return parse_dockerfile(ROOT / dockerfile)[1][-1]


def _exec_form(arg: str) -> list[str]:
    assert arg.lstrip().startswith("["), f"exec form (JSON) expected, got {arg!r}"
    return json.loads(arg)


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_entrypoint_and_cmd_help(image, dockerfile, tmp_path):
    final = _final(dockerfile)
    entry = _exec_form(final.all("ENTRYPOINT")[-1])
    cmd = _exec_form(final.all("CMD")[-1])
    for words in (entry + ["--help"], entry + cmd + ["--help"]):
        proc = subprocess.run(
            image.resolve(words), cwd=tmp_path, env=image.env(), capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, f"{dockerfile}: {words} exits {proc.returncode}:\n{proc.stderr[-2000:]}"
        assert "usage:" in proc.stdout


def _healthcheck(dockerfile: str) -> list[str]:
    (arg,) = _final(dockerfile).all("HEALTHCHECK")[-1:]
    rest = arg[arg.index(" CMD ") + 5 :].strip()  # after the options (--interval=… …)
    return _exec_form(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_healthcheck_against_a_live_server(image, dockerfile, server, tmp_path):
    def check(env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            image.resolve(_healthcheck(dockerfile)), cwd=tmp_path, env=image.env(env),
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip

    ok = check({"BATCHGATE_HTTP_PORT": str(server.http_port)})
    assert ok.returncode == 0, f"{dockerfile}: HEALTHCHECK fails against a ready server:\n{ok.stderr[-2000:]}"
    # The plaintext metrics port wins when set (TLS on the service ports): point it at nothing.
    (dead,) = free_ports(1)
    bad = check({"BATCHGATE_HTTP_PORT": str(server.http_port), "BATCHGATE_METRICS_PORT": str(dead)})
    assert bad.returncode != 0, f"{dockerfile}: HEALTHCHECK passes with nothing listening on its port"


def test_compose_healthcheck_against_a_live_server(image, server, tmp_path):
    """compose.yaml's own healthcheck command, its port (the compose env's BATCHGATE_HTTP_PORT)
    pointed at the live server's."""
    import yaml

    gw = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["batchgate"]
    test = gw["healthcheck"]["test"]
    assert test[0] == "CMD", test
    port = str(gw["environment"]["BATCHGATE_HTTP_PORT"])
    words = [w.replace(f"127.0.0.1:{port}/", f"127.0.0.1:{server.http_port}/") for w in test[1:]]
    assert words != test[1:], f"compose's healthcheck does not ask port {port}: {test}"
    proc = subprocess.run(
        image.resolve(words), cwd=tmp_path, env=image.env(), capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
