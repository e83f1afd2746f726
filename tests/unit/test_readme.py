"""The README stays true: its Quick start holds two commands, and its Python example runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    match = re.search(rf"^## {title}\n(.*?)(?=^## )", README, flags=re.S | re.M)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def test_quick_start_has_the_two_commands():
    block = re.search(r"```bash\n(.*?)```", _section("Quick start"), flags=re.S)
    assert block
    commands = [ln.split("#")[0].strip() for ln in block.group(1).splitlines() if ln.strip()]
    assert commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    for script in ("demo.sh", "test.sh"):
        assert (ROOT / "scripts" / script).is_file()
    assert 'flexdispatch" demo' in (ROOT / "scripts" / "demo.sh").read_text()
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_python_example_runs():
    code = re.search(r"```python\n(.*?)```", README, flags=re.S)
    assert code
    namespace: dict = {}
    exec(compile(code.group(1), "README.md", "exec"), namespace)
    out = namespace["out"]
    assert out.output.shape == namespace["hidden"].shape
    assert namespace["layer"].dispatcher.stats.dispatch_calls == 1


def test_every_moved_module_path_still_imports_as_its_new_module():
    import importlib
    import sys
    import warnings

    import flexdispatch

    table = _section("Renamed in 0.1")
    for old, new in flexdispatch._MOVED.items():
        assert f"`{old}`" in table and f"`{new}`" in table, old
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new)
        assert module.__spec__.name == new  # NOTE: its own spec, not the old path's
        assert any(
            issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught
        )
    try:
        importlib.import_module("flexdispatch.no_such_module")
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("the moved-path finder answered for a path that never existed")


def test_every_flexdispatch_name_the_readme_documents_imports():
    import importlib

    renamed = _section("Renamed in 0.1")
    body = README.replace(renamed, "")
    missing = []
    for ref in sorted(set(re.findall(r"`(flexdispatch(?:\.[A-Za-z_]\w*)+)", body))):
        parts = ref.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                for name in parts[i:]:
                    obj = getattr(obj, name)
                break
            except (ImportError, AttributeError):
                continue
        else:
            missing.append(ref)
    assert not missing, missing
