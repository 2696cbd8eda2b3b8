"""Importing a test module never imports torch, transformers or sentence-transformers: only the
tests that compare with them (the ``reference`` extra) import them, inside the test or its fixture,
so ``pip install -e '.[cpu,test]'`` runs every other test (issue 56) and no module's collection pays
for torch.

One child process imports every module under tests/ with those packages blocked by a finder first
on ``sys.meta_path`` (as if not installed: libraries that probe for torch take their path without
it). A module is reported when an import statement of a test module asks for one of them (caught
or not; ``pytest.importorskip`` at module level included), or when its import fails for one of
them (``from safetensors.torch import ...`` asks through the library)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

BLOCKED = ("torch", "transformers", "sentence_transformers")

# Run in the child: argv[1] the folder whose modules are imported, argv[2] their package name.
CHECK = r"""
import importlib, json, sys
from pathlib import Path

folder, package = Path(sys.argv[1]).resolve(), sys.argv[2]
BLOCKED = set(sys.argv[3].split(","))
asked = {}  # module file -> blocked names its own import statements asked for


def importer():
    # The frame whose statement asked: importlib's own frames skipped, and pytest's when the
    # statement is pytest.importorskip.
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith("<frozen importlib") or name == importlib.__file__ or "/_pytest/" in name):
            return name
        frame = frame.f_back
    return ""


class Block:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in BLOCKED:
            return None
        where = importer()
        if Path(where).resolve().is_relative_to(folder):
            asked.setdefault(str(Path(where).resolve().relative_to(folder)), set()).add(top)
        raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)


sys.meta_path.insert(0, Block())
assert not BLOCKED & set(sys.modules), "imported before the finder"
failed, imported = {}, []
for path in sorted(folder.glob("*.py")):
    module = f"{package}.{path.stem}"
    try:
        importlib.import_module(module)
        imported.append(path.name)
    except ImportError as exc:
        if exc.name and exc.name.partition(".")[0] in BLOCKED:
            asked.setdefault(path.name, set()).add(exc.name.partition(".")[0])
        else:
            failed[path.name] = repr(exc)
    except BaseException as exc:  # a module that does not import is reported, not skipped
        failed[path.name] = repr(exc)
print(json.dumps({"asked": {k: sorted(v) for k, v in asked.items()}, "failed": failed,
                  "imported": imported, "loaded": sorted(BLOCKED & set(sys.modules))}))
"""


def check(folder: Path, package: str, cwd: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, str(folder), package, ",".join(BLOCKED)],
        cwd=cwd, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_test_module_imports_a_reference_library():
    got = check(ROOT / "tests", "tests", ROOT)
    modules = sorted(p.name for p in (ROOT / "tests").glob("*.py"))
    assert got["asked"] == {}, (
        "these test modules import a reference library when imported; import it inside the test "
        "or fixture that compares with it (pytest.importorskip there): " + json.dumps(got["asked"])
    )
    assert got["failed"] == {}
    assert got["imported"] == modules and got["loaded"] == []


def test_the_check_sees_each_way_a_module_can_import_them(tmp_path):
    """The child's finder on modules made to break the rule, and one that keeps it: a check that
    saw nothing would pass the suite above."""
    pkg = tmp_path / "fake_tests"
    pkg.mkdir()
    (pkg / "test_top.py").write_text("import torch\n")
    (pkg / "test_from.py").write_text("from transformers import AutoModel\n")
    caught = "try:\n    import sentence_transformers\nexcept ImportError:\n    pass\n"
    (pkg / "test_caught.py").write_text(caught)
    (pkg / "test_skip.py").write_text("import pytest\n\ntorch = pytest.importorskip('torch')\n")
    (pkg / "test_through.py").write_text("from safetensors.torch import save_file\n")
    (pkg / "test_helper_user.py").write_text("from fake_tests.helper import x\n")
    (pkg / "helper.py").write_text("import torch\nx = 1\n")
    (pkg / "test_inside.py").write_text("def test_x():\n    import torch\n")
    got = check(pkg, "fake_tests", tmp_path)
    assert got["asked"] == {
        "helper.py": ["torch"], "test_caught.py": ["sentence_transformers"],
        "test_from.py": ["transformers"], "test_helper_user.py": ["torch"], "test_skip.py": ["torch"],
        "test_through.py": ["torch"], "test_top.py": ["torch"],
    }, got  # fmt: skip
    assert "test_inside.py" in got["imported"] and got["loaded"] == []
