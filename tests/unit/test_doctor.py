"""``flexdispatch doctor``: the backend decision for hypothetical topologies, the probes (with
stand-in modules for what this CPU machine lacks), and the command line.

Shape letters: H hidden · R ranks · L ranks per node · N = R / L nodes.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flexdispatch.cli import main
from flexdispatch.dispatch.select import BACKENDS
from flexdispatch.doctor import (
    SCHEMA,
    HostFacts,
    probe_cuda,
    probe_deep_ep,
    probe_nccl,
    probe_nvshmem,
    resolve_topology,
    run_doctor,
    would_select,
)

# --------------------------------------------------------------------------- the decision


def _deepep_topology_ok(R: int, L: int) -> bool:
    """DeepEP v1.2.1's rules, spelled out (REFERENCE_FACTS.md): intranode kernels take 2, 4 or
    8 ranks on one node; internode kernels take node = rank // 8, so exactly 8 ranks per node,
    on 2, 4, 8 or 16 nodes."""
    if R < 2 or L > 8:
        return False
    if L == R:
        return R in (2, 4, 8)
    return L == 8 and R // L in (2, 4, 8, 16)


def _facts(cuda=True, nccl=True, gloo=True, gpus=8, deepep=True) -> HostFacts:
    return HostFacts(
        cuda_available=cuda,
        nccl_available=nccl,
        gloo_available=gloo,
        num_gpus=gpus,
        deepep=(deepep, "deep_ep imports" if deepep else "import deep_ep failed: boom"),
    )


def _expected(requested: str, R: int, L: int, f: HostFacts, hidden: int | None) -> str | None:
    deepep_ok = (
        f.deepep[0]
        and f.cuda_available
        and f.nccl_available
        and f.num_gpus >= L
        and _deepep_topology_ok(R, L)
        and (hidden is None or (hidden * 2) % 16 == 0)
    )
    torch_ok = (f.cuda_available and f.nccl_available) or f.gloo_available
    if requested == "deepep":
        return "deepep" if deepep_ok else None
    if requested == "torch":
        return "torch" if torch_ok else None
    return "deepep" if deepep_ok else ("torch" if torch_ok else None)


FACT_VARIANTS = [
    _facts(),
    _facts(deepep=False),
    _facts(cuda=False, gpus=0),
    _facts(nccl=False),
    _facts(gpus=4),
    _facts(cuda=False, nccl=False, gloo=False, gpus=0, deepep=False),
]


@pytest.mark.parametrize("requested", ["auto", "torch", "deepep"])
@pytest.mark.parametrize(
    "facts", FACT_VARIANTS, ids=["all", "no-deep_ep", "no-cuda", "no-nccl", "4-gpus", "nothing"]
)
def test_would_select_follows_the_rules(requested: str, facts: HostFacts) -> None:
    seen = set()
    for R in range(1, 41):
        for L in (d for d in range(1, R + 1) if R % d == 0):
            for hidden in (None, 7168, 7, 12):
                got = would_select(
                    requested, world_size=R, ranks_per_node=L, facts=facts, hidden=hidden
                )
                want = _expected(requested, R, L, facts, hidden)
                assert got.backend == want, (requested, R, L, hidden, got.reason)
                assert got.ok == (want is not None)
                seen.add(want)
    if requested == "auto" and facts == FACT_VARIANTS[0]:
        assert seen == {"deepep", "torch"}  # the sweep exercises both outcomes


def test_reasons_name_the_failing_check() -> None:
    f = _facts()
    auto = would_select("auto", world_size=6, ranks_per_node=6, facts=f)
    assert auto.backend == "torch"
    assert auto.reason.startswith("auto: torch fallback (")
    assert "2/4/8 ranks, not 6" in auto.reason
    bad_row = would_select("deepep", world_size=8, ranks_per_node=8, facts=f, hidden=7)
    assert bad_row.backend is None
    assert bad_row.reason.startswith("deepep backend not available:")
    assert "multiple of 16 bytes" in bad_row.reason
    ok = would_select("auto", world_size=16, ranks_per_node=8, facts=f, hidden=7168)
    assert ok.backend == "deepep" and ok.reason == "auto: deep_ep usable on every rank"
    failing = {c.name for c in ok.deepep if not c.ok}
    assert failing == set()
    no_import = would_select("auto", world_size=8, ranks_per_node=8, facts=_facts(deepep=False))
    assert "import deep_ep failed: boom" in no_import.reason
    d = no_import.as_dict()
    assert d["nodes"] == 1 and [c["name"] for c in d["checks"]["deepep"]] == [
        "import",
        "cuda",
        "nccl",
        "gpus",
        "topology",
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 6, "ranks_per_node": 4}, "not a multiple of ranks per node 4"),
        ({"world_size": 0, "ranks_per_node": 1}, "must be >= 1"),
        ({"world_size": 2, "ranks_per_node": 2, "hidden": 0}, "hidden must be >= 1"),
    ],
)
def test_would_select_rejects_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        would_select("auto", facts=_facts(), **kwargs)
    with pytest.raises(ValueError, match="backend must be one of"):
        would_select("nccl", world_size=2, ranks_per_node=2, facts=_facts())


def test_resolve_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert resolve_topology(None, None, 0) == (1, "default", 1, "default")
    assert resolve_topology(None, None, 8) == (8, "gpus", 8, "gpus")
    assert resolve_topology(16, None, 8) == (16, "argument", 8, "gpus")
    assert resolve_topology(4, 2, 8) == (4, "argument", 2, "argument")
    monkeypatch.setenv("WORLD_SIZE", "32")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve_topology(None, None, 0) == (32, "WORLD_SIZE", 8, "LOCAL_WORLD_SIZE")
    assert resolve_topology(4, None, 0) == (4, "argument", 4, "LOCAL_WORLD_SIZE")
    monkeypatch.setenv("WORLD_SIZE", "many")
    with pytest.raises(ValueError, match=r"\$WORLD_SIZE='many' is not an integer"):
        resolve_topology(None, None, 0)


# --------------------------------------------------------------------------- probes


class _Props:
    def __init__(self, i: int) -> None:
        self.name = f"NVIDIA H200 #{i}"
        self.total_memory = (140 + i) * 2**30
        self.major, self.minor = 9, 0
        self.multi_processor_count = 132


def _fake_cuda(n: int, nccl_version: object) -> types.SimpleNamespace:
    def version() -> object:
        if isinstance(nccl_version, Exception):
            raise nccl_version
        return nccl_version

    return types.SimpleNamespace(
        is_available=lambda: n > 0,
        device_count=lambda: n,
        get_device_properties=_Props,
        nccl=types.SimpleNamespace(version=version),
    )


def test_probe_cuda_lists_every_gpu() -> None:
    got = probe_cuda(_fake_cuda(3, (2, 21, 5)))
    assert got["available"] and got["device_count"] == 3
    for i, g in enumerate(got["gpus"]):
        p = _Props(i)
        assert g == {
            "index": i,
            "name": p.name,
            "total_memory_bytes": p.total_memory,
            "compute_capability": "9.0",
            "multi_processor_count": 132,
        }
    none = probe_cuda(_fake_cuda(0, None))
    assert not none["available"] and none["gpus"] == [] and none["reason"]
    real = probe_cuda()  # this machine, GPUs or not: asking must not raise, and it tells the truth
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert real["available"] is torch.cuda.is_available() and len(real["gpus"]) == count
    if count:
        assert real["device_count"] == count
        assert [g["index"] for g in real["gpus"]] == list(range(count))
        assert real["gpus"][0]["name"] == torch.cuda.get_device_name(0)


@pytest.mark.parametrize(
    ("raw", "text"),
    [((2, 21, 5), "2.21.5"), (22105, "2.21.5"), (2804, "2.8.4"), (RuntimeError("no"), None)],
)
def test_probe_nccl_version(raw: object, text: str | None) -> None:
    got = probe_nccl(_fake_cuda(1, raw), built=True)
    assert got["available"] is True and got["version"] == text
    if text is None:
        assert "RuntimeError: no" in got["reason"]
    assert probe_nccl(_fake_cuda(1, raw), built=False)["version"] is None
    real = probe_nccl()
    assert real["available"] == dist.is_nccl_available()


def _write_package(root: Path, name: str, files: dict[str, str]) -> None:
    pkg = root / name
    pkg.mkdir(parents=True)
    for rel, text in files.items():
        (pkg / rel).write_text(text)


@pytest.fixture
def fresh_modules(monkeypatch: pytest.MonkeyPatch):
    """Forget deep_ep / nvshmem for the test; everything imported during it is dropped after."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("deep_ep", "nvshmem")]:
        monkeypatch.delitem(sys.modules, name)
    yield monkeypatch
    for name in [m for m in sys.modules if m.split(".")[0] in ("deep_ep", "nvshmem")]:
        sys.modules.pop(name, None)
    importlib.invalidate_caches()


def test_probe_deep_ep_reports_the_exact_import_error(tmp_path: Path, fresh_modules) -> None:
    _write_package(
        tmp_path,
        "deep_ep",
        {"__init__.py": "raise OSError('libnvshmem_host.so.3: cannot open shared object file')"},
    )
    fresh_modules.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        importlib.import_module("deep_ep")
    except OSError as exc:
        expected = f"{type(exc).__name__}: {exc}"
    got = probe_deep_ep()
    assert got["importable"] is False and got["usable"] is False
    assert got["reason"] == f"deep_ep is installed but refused to import ({expected})"


class _NoDeepEP:
    """A meta-path finder under which ``deep_ep`` does not exist (a machine without DeepEP)."""

    @staticmethod
    def find_spec(name: str, *_: object) -> None:
        if name.split(".")[0] == "deep_ep":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def test_probe_deep_ep_missing(fresh_modules) -> None:
    fresh_modules.setattr(sys, "meta_path", [_NoDeepEP(), *sys.meta_path])
    got = probe_deep_ep()
    assert got["importable"] is False
    assert got["reason"] == (
        "deep_ep is not installed (ModuleNotFoundError: No module named 'deep_ep')"
    )


def test_probe_deep_ep_wheel_on_a_cpu_machine(fresh_modules) -> None:
    # the test set-up installs SGLang's DeepEP wheel (for its Python layer); on a CPU build of
    # torch its __init__ refuses to load, and doctor says why instead of crashing
    import importlib.metadata

    try:
        importlib.metadata.distribution("sgl-deep-ep")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("scripts/setup.sh installs sgl-deep-ep for the tests; it is missing")
    if torch.cuda.is_available():
        pytest.skip("a CUDA build of torch may load the wheel for real")
    got = probe_deep_ep()
    assert got["importable"] is False and got["usable"] is False
    assert got["reason"].startswith("deep_ep is installed but refused to import (ImportError: ")
    assert "does not provide CUDA" in got["reason"]


def test_probe_deep_ep_importable(tmp_path: Path, fresh_modules) -> None:
    _write_package(
        tmp_path,
        "deep_ep",
        {"__init__.py": "IS_EMULATOR = True\n__version__ = '9.9.9'\nclass Buffer: pass\n"},
    )
    fresh_modules.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    got = probe_deep_ep()
    assert got["importable"] is True and got["emulator"] is True
    assert got["version"] == "9.9.9"
    assert got["path"] == str(tmp_path / "deep_ep" / "__init__.py")
    assert got["usable"] == ("deepep" in BACKENDS)


def test_probe_nvshmem(tmp_path: Path, fresh_modules) -> None:
    if importlib.util.find_spec("nvshmem") is None:
        assert probe_nvshmem()["status"] == "not installed"
    good = tmp_path / "good"
    _write_package(
        good,
        "nvshmem",
        {
            "__init__.py": "__version__ = '0.4.1'\n",
            "core.py": "def init(*a, **k):\n    raise AssertionError('the doctor must not init')\n",
        },
    )
    fresh_modules.syspath_prepend(str(good))
    importlib.invalidate_caches()
    got = probe_nvshmem()
    assert got["status"] == "importable, not initialised"
    assert got["initialised"] is False
    assert got["nvshmem4py"]["importable"] is True
    for name in [m for m in sys.modules if m.split(".")[0] == "nvshmem"]:
        del sys.modules[name]
    bad = tmp_path / "bad"
    _write_package(
        bad,
        "nvshmem",
        {"__init__.py": "", "core.py": "raise ImportError('libnvshmem_host.so.3: not found')\n"},
    )
    fresh_modules.syspath_prepend(str(bad))
    importlib.invalidate_caches()
    got = probe_nvshmem()
    assert got["status"] == "import failed: ImportError: libnvshmem_host.so.3: not found"
    assert got["nvshmem4py"]["importable"] is False


# --------------------------------------------------------------------------- the report and CLI

TOP_KEYS = {
    "deep_ep_generations",
    "deep_ep_v25",
    "schema",
    "flexdispatch_version",
    "ok",
    "date",
    "platform",
    "torch",
    "cuda",
    "gpus",
    "nccl",
    "gloo",
    "deep_ep",
    "nvshmem",
    "launcher",
    "selection",
    "gin",  # issue 44: DeepEP V2 / 2.5's NCCL preconditions
    "side_group",  # issue 44: what a gloo group of the job would bind
}


def test_report_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    rep = run_doctor(world_size=4, ranks_per_node=2, hidden=1024)
    assert set(rep) == TOP_KEYS
    assert rep["schema"] == SCHEMA
    assert rep["torch"]["version"] == torch.__version__
    assert rep["gloo"]["available"] == dist.is_gloo_available()
    assert rep["launcher"]["comm_env"]["NCCL_SOCKET_IFNAME"] == "lo"
    sel = rep["selection"]
    assert (sel["world_size"], sel["ranks_per_node"], sel["nodes"]) == (4, 2, 2)
    assert sel["world_size_source"] == "argument"
    facts = HostFacts(
        cuda_available=rep["cuda"]["available"],
        nccl_available=rep["nccl"]["available"],
        gloo_available=rep["gloo"]["available"],
        num_gpus=rep["cuda"]["device_count"],
        deepep=(rep["deep_ep"]["usable"], rep["deep_ep"]["reason"]),
    )
    assert sel["backend"] == _expected("auto", 4, 2, facts, 1024)
    assert rep["ok"] == (sel["backend"] is not None)
    json.dumps(rep)  # JSON-ready


def test_cli_json_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--world-size", "2", "--ranks-per-node", "2"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) == TOP_KEYS and rep["selection"]["backend"] == "torch"

    code = main(["doctor", "--backend", "deepep", "--world-size", "8", "--ranks-per-node", "8"])
    out = capsys.readouterr().out
    usable = rep["deep_ep"]["usable"] and rep["cuda"]["available"]
    assert code == (0 if usable else 1)
    assert "NOT USABLE" in out or usable
    assert "deep_ep" in out and "nvshmem" in out and "gloo" in out

    assert main(["doctor", "--world-size", "6", "--ranks-per-node", "4"]) == 2
    assert "not a multiple of ranks per node 4" in capsys.readouterr().err


def test_deepep_api_choice_says_which_deepep_api_runs() -> None:
    from flexdispatch.doctor import deepep_api_choice

    auto = deepep_api_choice("auto", backend="deepep", elastic=True)
    assert auto["api"] == "v1" and "no per-rank token bound" in auto["reason"]
    worst = deepep_api_choice("auto", backend="deepep", elastic=True, num_worst_tokens=64)
    assert worst["api"] == "v2" and "M = W / R" in worst["reason"], worst
    worst_v1 = deepep_api_choice("auto", backend="deepep", elastic=False, num_worst_tokens=64)
    assert worst_v1["api"] == "v1" and "no ElasticBuffer" in worst_v1["reason"], worst_v1
    assert (
        "no ElasticBuffer" in deepep_api_choice("auto", backend="deepep", elastic=False)["reason"]
    )
    assert deepep_api_choice("v1", backend="deepep", elastic=True)["api"] == "v1"
    v2 = deepep_api_choice("v2", backend="deepep", elastic=True)
    assert v2["api"] == "v2" and "ElasticBuffer" in v2["reason"]
    missing = deepep_api_choice("v2", backend="deepep", elastic=False)
    assert missing["api"] is None and "absent here" in missing["reason"]
    gone = deepep_api_choice("v2", backend="deepep", elastic=None)
    assert "does not import" in gone["reason"]
    torch_runs = deepep_api_choice("v2", backend="torch", elastic=True)
    assert torch_runs["api"] is None and "deepep does not run" in torch_runs["reason"]
    with pytest.raises(ValueError, match="deepep_api must be one of"):
        deepep_api_choice("v3", backend="deepep", elastic=True)


def test_cli_reports_the_deepep_api(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["doctor", "--json", "--world-size", "2", "--ranks-per-node", "2"]
    assert main([*args, "--deepep-api", "v2"]) == 0
    api = json.loads(capsys.readouterr().out)["selection"]["deepep_api"]
    assert api["requested"] == "v2" and "ElasticBuffer" in api["reason"]
    main(["doctor", "--world-size", "2", "--ranks-per-node", "2"])
    assert "deepep_api requested 'auto'" in capsys.readouterr().out
