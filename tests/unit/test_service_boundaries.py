"""Services are siblings: no service imports another's code (contracts two services need live in
shared/), and the router, the trigger and the expander load without torch (and without
kernels/), so their images need neither. The benchmarks depend on relaygr/ one way: bench/ may
import relaygr, relaygr (the CLI, the launcher, the demo) never imports bench."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
RELAYGR = ROOT / "relaygr"

# Installed first thing in a fresh interpreter: any import of torch, triton or kernels/ fails, as
# it would where they are not installed.
BLOCK = """
import sys

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"torch", "triton", "kernels"}:
            raise ImportError(f"{name} is not installed here (blocked by the test)")
        return None

sys.meta_path.insert(0, _Blocked())
"""


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code (absolute names)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_service_imports_another_service() -> None:
    crossings = []
    for path in sorted(SERVICES.rglob("*.py")):
        own = path.relative_to(SERVICES).parts[0]
        for module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] != own:
                crossings.append(f"{path.relative_to(ROOT)} imports {module}")
    assert crossings == []


def test_relaygr_does_not_import_bench() -> None:
    crossings = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted(RELAYGR.rglob("*.py"))
        for module in sorted(imported_modules(path))
        if module.split(".")[0] == "bench"
    ]
    assert crossings == []


def test_the_import_check_sees_a_crossing(tmp_path: Path) -> None:
    """The check above would catch one, however it is written (nested, from-import)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from services.ranker import wire\n")
    assert "services.ranker.wire" in imported_modules(module)


def run_blocked(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_blocker_blocks_torch() -> None:
    result = run_blocked("import torch")
    assert result.returncode != 0
    assert "blocked by the test" in result.stderr


@pytest.mark.parametrize(
    "modules",
    [
        ("services.router.service", "services.router.__main__"),
        ("services.trigger.service", "services.trigger.__main__"),
        ("services.expander.server", "services.expander.__main__"),
    ],
    ids=["router", "trigger", "expander"],
)
def test_service_imports_without_torch(modules: tuple[str, ...]) -> None:
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += (
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'triton', 'kernels'})\n"
        "assert not loaded, loaded\n"
    )
    result = run_blocked(code)
    assert result.returncode == 0, result.stderr
