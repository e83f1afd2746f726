"""Bounds that hold on a real machine (reliability-4: #5, N3-N8, N20): one memory model
(``flexdispatch._checks.sysmem``: ``MemAvailable``, ``RLIMIT_AS`` and the cgroup limits, 80 % of it
planned for), estimates that count temporaries, and the shapes no estimate may trust.

Every probe that could allocate a lot runs in a subprocess under ``RLIMIT_AS`` (4 GiB) or against
``$FLEXDISPATCH_MEMORY_AVAILABLE``, so a regression is refused by the address-space limit, never
by the machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import flexdispatch as fd
from flexdispatch._checks import fits, sysmem
from tests.hostile import AS_LIMIT, ROOT, verbose_error

pytestmark = pytest.mark.timeout(240)

GiB = 1 << 30
_EST = r"needs about [\d.]+ [KMGTP]i?B .*more than the [\d.]+ [KMGTP]?i?B available on cpu"


def _idx(T: int = 16, k: int = 2, E: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.rand(T, E, generator=g).argsort(1)[:, :k].contiguous()


@pytest.fixture
def machine(monkeypatch):
    """Pretend this machine has ``n`` bytes available (and forget what fitted before)."""

    def set_available(n: int) -> None:
        monkeypatch.setenv(sysmem.AVAILABLE_ENV, f"{n}b")

    monkeypatch.setattr(fits, "_FITTED", {})
    return set_available


# --------------------------------------------------------------------------- headroom (N3, #5)


def test_old_5_is_refused_on_the_idle_machine_of_the_probe(machine):
    # NOTE: reliability-4 #5: 22.9 GiB MemAvailable, E = 10**9 was accepted and the 16-token
    # dispatch then allocated until the cgroup killed it
    machine(int(22.9 * GiB))
    with pytest.raises(ValueError, match=r"FlexDispatcher: num_experts=1000000000 " + _EST):
        fd.FlexDispatcher(fd.DispatchConfig(backend="torch"), num_experts=10**9)


def test_97_percent_of_the_available_memory_is_refused(machine):
    # NOTE: the probe's one-liner (reliability-4 section 6, #3), on this machine's own figure
    machine(4 * GiB)
    a, _ = fits.available_bytes("cpu")
    per = fits.expert_bytes(1, 1)  # NOTE: bytes per expert on one rank
    with pytest.raises(ValueError, match=r"num_experts=\d+ " + _EST + r" \(80% of"):
        fd.FlexDispatcher(fd.DispatchConfig(backend="torch"), num_experts=int(a * 0.97) // per)
    d = fd.FlexDispatcher(fd.DispatchConfig(backend="torch"), num_experts=int(a * 0.7) // per)
    assert d.num_experts > 0  # NOTE: 70 % of it fits (nothing is allocated at construction)


# --------------------------------------------------------------------------- cgroups (N4)


def _fake_proc(tmp: Path, *, cgroup: str, mounts: list[str], files: dict[str, str]) -> str:
    """A fake ``/proc`` (``self/cgroup``, ``self/mountinfo``, no meminfo) and cgroup tree."""
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text("".join(m + "\n" for m in mounts))
    for rel, text in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(proc)


def test_cgroup_v2_limit_of_the_process_and_of_its_ancestors(tmp_path):
    fs = tmp_path / "cg2"
    proc = _fake_proc(
        tmp_path,
        cgroup="0::/job/step\n",
        mounts=[f"41 31 0:38 / {fs} rw,relatime - cgroup2 cgroup2 rw"],
        files={
            "cg2/job/memory.max": f"{3 * GiB}\n",
            "cg2/job/memory.current": f"{1 * GiB}\n",
            "cg2/job/memory.stat": f"anon 1\ninactive_file {GiB // 2}\n",
            "cg2/job/step/memory.max": "max\n",
            "cg2/job/step/memory.current": "123\n",
        },
    )
    room, source = sysmem.cgroup_room(proc)
    assert room == 3 * GiB - GiB // 2  # the parent's limit less its working set
    assert source.endswith("cg2/job/memory.max")
    # the process's own, tighter limit wins
    (fs / "job" / "step" / "memory.max").write_text(f"{GiB}\n")
    assert sysmem.cgroup_room(proc) == (
        GiB - 123,
        f"the cgroup memory limit {fs}/job/step/memory.max",
    )


def test_cgroup_v1_memory_controller_under_a_container_root(tmp_path):
    # NOTE: a container sees its cgroup as the root of the mount (mount root /docker/abc)
    fs = tmp_path / "memory"
    proc = _fake_proc(
        tmp_path,
        cgroup="5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n",
        mounts=[
            f"32 31 0:29 /docker/abc {tmp_path}/cpu rw - cgroup cgroup rw,cpu,cpuacct",
            f"35 31 0:32 /docker/abc {fs} rw,relatime - cgroup cgroup rw,memory",
        ],
        files={
            "memory/memory.limit_in_bytes": f"{2 * GiB}\n",
            "memory/memory.usage_in_bytes": f"{GiB}\n",
            "memory/memory.stat": f"cache 5\ntotal_inactive_file {GiB // 4}\n",
        },
    )
    assert sysmem.cgroup_room(proc) == (
        2 * GiB - (GiB - GiB // 4),
        f"the cgroup memory limit {fs}/memory.limit_in_bytes",
    )
    # "no limit" (2^63 rounded down to a page) is no figure
    (fs / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert sysmem.cgroup_room(proc) is None


def test_the_cgroup_limit_bounds_every_size_check(tmp_path, monkeypatch):
    # NOTE: N4: E = 10**8 (2.4 GB) inside a 1.5 GiB cgroup was accepted, then OOM-killed
    fs = tmp_path / "cg2"
    proc = _fake_proc(
        tmp_path,
        cgroup="0::/\n",
        mounts=[f"41 31 0:38 / {fs} rw - cgroup2 cgroup2 rw"],
        files={"cg2/memory.max": f"{3 * GiB // 2}\n", "cg2/memory.current": f"{GiB // 4}\n"},
    )
    monkeypatch.delenv(sysmem.AVAILABLE_ENV, raising=False)
    monkeypatch.setattr(fits, "_FITTED", {})
    real = sysmem.figures
    monkeypatch.setattr(sysmem, "figures", lambda proc_=None, tree=False: real(proc, tree=tree))
    avail, source = fits.available_bytes("cpu")
    assert avail == 3 * GiB // 2 - GiB // 4 and "cgroup memory limit" in source
    with pytest.raises(ValueError, match=r"num_experts=100000000 .*cgroup memory limit"):
        fd.FlexDispatcher(fd.DispatchConfig(backend="torch"), num_experts=10**8)
    from flexdispatch.cli import demo_fit

    assert demo_fit.available_memory() == (avail, source)  # one model for the demo too


def test_a_bad_memory_variable_is_named(monkeypatch):
    from flexdispatch.cli.demo_machine import RUNTIME_ENV, measure_runtime

    monkeypatch.setenv(sysmem.AVAILABLE_ENV, "lots")
    with pytest.raises(ValueError, match=r"^\$FLEXDISPATCH_MEMORY_AVAILABLE='lots' is not a memo"):
        sysmem.available()
    monkeypatch.setenv(sysmem.AVAILABLE_ENV, "S3CR3T" * 5)
    with pytest.raises(ValueError, match=r"AVAILABLE='S3CR3TS3CR3T'… is not a memory size"):
        sysmem.available(tree=True)
    monkeypatch.setenv(RUNTIME_ENV, "-1GiB")
    with pytest.raises(ValueError, match=r"^\$FLEXDISPATCH_RUNTIME_BYTES='-1GiB' is not a memory"):
        measure_runtime("cpu")


def test_this_machine_has_one_figure_for_every_check(monkeypatch):
    monkeypatch.delenv(sysmem.AVAILABLE_ENV, raising=False)
    found = sysmem.figures()
    assert found and all(n >= 0 and src for n, src in found)
    assert any(src == "MemAvailable in /proc/meminfo" for _, src in found)
    monkeypatch.setattr(sysmem, "figures", lambda proc=None, tree=False: found)  # NOTE: moves
    avail, source = sysmem.available()
    assert (avail, source) == min(found) == fits.available_bytes("cpu")
    usable, why = sysmem.usable()
    assert usable == int(0.8 * avail) and why.startswith("80% of")


@pytest.fixture
def address_space_limit(monkeypatch):
    """A machine with 22 GiB available and no cgroup limit, this process under an ``RLIMIT_AS``
    that leaves it 1 GiB (the detection's readings, not a real limit)."""
    monkeypatch.delenv(sysmem.AVAILABLE_ENV, raising=False)
    monkeypatch.setattr(fits, "_FITTED", {})
    monkeypatch.setattr(sysmem, "_meminfo_available", lambda proc: 22 * GiB)
    monkeypatch.setattr(sysmem, "_address_space_left", lambda proc: GiB)
    monkeypatch.setattr(sysmem, "cgroup_room", lambda proc="/proc": None)


def test_rlimit_as_bounds_each_process_never_the_tree(address_space_limit):
    # NOTE: RLIMIT_AS is per process: under `prlimit --as=4GiB`, `demo --nodes 2
    # --ranks-per-node 4` and spawn_group(f, 20) were refused although each rank has its own
    # 4 GiB and 22 GiB was free
    from flexdispatch.bench import BenchSpec
    from flexdispatch.cli import demo_fit
    from flexdispatch.cli.bench import check_bench_memory
    from flexdispatch.config import load_config
    from flexdispatch.launch.spawn import _check_spawn_args

    assert sysmem.available() == (GiB, "address space left under RLIMIT_AS")
    assert sysmem.available(tree=True) == (22 * GiB, "MemAvailable in /proc/meminfo")
    assert fits.available_bytes("cpu") == (GiB, "address space left under RLIMIT_AS")
    # the tree: the demo's total, spawn_group's ranks, bench's ranks
    assert demo_fit.memory_limit(None) == (4 * GiB, "the default --max-memory 4.0 GiB")
    _check_spawn_args(os.getpid, 20, (), None, 60.0, None, "gloo", None)
    spec = BenchSpec(world_size=8, tokens=64, hidden=64, experts=8, topk=2)
    check_bench_memory(spec, runtime=300 << 20, runtime_source="given")
    # one process: what an API call allocates, a bench rank, the demo's largest process
    with pytest.raises(ValueError, match=r"num_experts=100000000 .*address space left under"):
        fd.FlexDispatcher(fd.DispatchConfig(backend="torch"), num_experts=10**8)
    big = BenchSpec(world_size=2, tokens=1 << 17, hidden=256, experts=8, topk=2)
    with pytest.raises(ValueError, match=r"--tokens=131072 .*one spawned rank.*RLIMIT_AS"):
        check_bench_memory(big, runtime=300 << 20, runtime_source="given")
    largest, why = demo_fit.process_limit()
    assert largest == int(0.8 * GiB) and "RLIMIT_AS" in why
    cfg = load_config("deepseek_v3")
    with pytest.raises(ValueError, match=r"its largest process would need .*RLIMIT_AS"):
        demo_fit.fit_demo(
            cfg, 2, 64, worst_case=False, limit=100 * GiB, limit_reason="test", runtime=GiB,
            largest_limit=largest, largest_reason=why,
        )  # fmt: skip
    plan = demo_fit.fit_demo(
        load_config("tiny_cpu"), 8, 64, worst_case=False, limit=4 * GiB, limit_reason="test",
        largest_limit=largest, largest_reason=why,
    )  # fmt: skip
    assert plan.estimate.largest <= largest


# --------------------------------------------------------------------------- shapes (N5-N8)


def _under_as_limit(code: str, timeout: float = 180) -> subprocess.CompletedProcess:
    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(sysmem.AVAILABLE_ENV, None)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        preexec_fn=limit,
    )


# NOTE: each probe runs in one subprocess under RLIMIT_AS (4 GiB), so that a regression is an
# allocation error there, not the allocation of the machine (N5: 5 GB, N6: 65 GB, N7: 8 GB and
# 136 TB, N8: 9.6 GB).
_SHAPES = r"""
import json, torch, flexdispatch as fd
out = {}
def probe(name, fn):
    try:
        fn()
        out[name] = "ACCEPTED"
    except ValueError as exc:
        out[name] = "REFUSED " + str(exc)
    except Exception as exc:
        out[name] = f"{type(exc).__name__} {exc}"[:300]
g = torch.Generator().manual_seed(0)
idx = torch.rand(16, 8, generator=g).argsort(1)[:, :2].contiguous()
wide = fd.FlexDispatcher(
    fd.DispatchConfig(backend="torch", num_worst_tokens=4 * 10**6, hidden_size=8), num_experts=8
)
probe("n6", lambda: wide.dispatch(torch.randn(16, 4096), idx, torch.rand(16, 2)))
out["n6_calls"] = wide.stats.dispatch_calls
small = fd.FlexDispatcher(
    fd.DispatchConfig(backend="torch", num_worst_tokens=64, hidden_size=8), num_experts=8
)
out["n6_ok"] = list(small.dispatch(torch.randn(16, 8), idx, torch.rand(16, 2)).recv_x.shape)
probe("n7", lambda: fd.permute(torch.randn(16, 32), idx, 8, num_rows=10**12))
probe("n7_align", lambda: fd.permute(torch.randn(16, 32), idx, 8, align=4, num_rows=10**9))
out["n7_ok"] = list(fd.permute(torch.randn(16, 32), idx, 8, num_rows=32).x.shape)
T = 3 * 10**8
one = (torch.zeros(1, 8), torch.tensor([[0, 1]]), torch.ones(1, 2))
x, ids, probs = (t.expand(T, -1) for t in one)
d = fd.FlexDispatcher(fd.DispatchConfig(backend="torch"), num_experts=8)
probe("n8_dispatch", lambda: d.dispatch(x, ids, probs))
out["n8_calls"] = d.stats.dispatch_calls
layer = fd.MoELayer(
    fd.MoEConfig(hidden_size=8, ffn_hidden_size=8, router=fd.RouterConfig(num_experts=8, topk=2))
)
probe("n8_layer", lambda: layer(x))
probe("n8_layer_3d", lambda: layer(torch.zeros(1, 1, 8).expand(T // 2, 2, 8)))
W = 10**7  # N5: W rows of 32 fp32 (about 5 GB at the first call's peak) against 4 GiB
worst = fd.FlexDispatcher(fd.DispatchConfig(backend="torch", num_worst_tokens=W), num_experts=8)
def n5():
    res = worst.dispatch(torch.randn(16, 32), idx, torch.rand(16, 2))
    worst.combine(res.recv_x, res.handle)
probe("n5", n5)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def shapes() -> dict:
    proc = _under_as_limit(_SHAPES)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_worst_case_rows_counted_with_their_temporaries_under_an_address_space_limit(shapes):
    # NOTE: N5: W = 2*10**7 (estimated 2.8 GB) reached 7.3 GB and failed in the allocator
    assert shapes["n5"].startswith(
        "REFUSED FlexDispatcher.dispatch: num_worst_tokens=10000000 needs about"
    ), shapes["n5"]
    assert "address space left under RLIMIT_AS" in shapes["n5"]


def test_declared_hidden_size_must_be_the_rows_hidden_size(shapes):
    # NOTE: N6: hidden_size=8 bounded W x 8 while x was 4096 wide (a 65 GB allocation)
    assert shapes["n6"].startswith(
        "REFUSED x has hidden size 4096 but DispatchConfig.hidden_size=8"
    ), shapes["n6"]
    assert shapes["n6_calls"] == 0 and shapes["n6_ok"] == [64, 8]


def test_permute_num_rows_is_bounded(shapes):
    # NOTE: N7: num_rows was trusted up to a 136 TB allocation
    for name, value, most in (("n7", 10**12, 32), ("n7_align", 10**9, 56)):
        assert shapes[name].startswith(f"REFUSED num_rows={value} is more rows"), shapes[name]
        assert f"= {most}):" in shapes[name]
    assert shapes["n7_ok"] == [32, 32]


def test_a_stride_zero_batch_is_counted_as_the_rows_it_stands_for(shapes):
    # NOTE: N8: an expanded x of 32 bytes standing for 3*10**8 rows was materialised
    assert re.match(r"REFUSED FlexDispatcher.dispatch: T=300000000 " + _EST, shapes["n8_dispatch"])
    assert shapes["n8_calls"] == 0
    for name in ("n8_layer", "n8_layer_3d"):
        assert re.match(r"REFUSED MoELayer.forward: T=300000000 " + _EST, shapes[name]), shapes[
            name
        ]


# --------------------------------------------------------------------------- the command line


def _cli(argv: list[str]) -> int:
    from flexdispatch.cli import main

    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.fixture
def no_spawn(monkeypatch):
    import flexdispatch.launch as launch
    from flexdispatch.cli import demo_machine

    monkeypatch.setattr(launch, "spawn_group", lambda *a, **k: pytest.fail("spawned"))
    monkeypatch.setenv(demo_machine.RUNTIME_ENV, "300MiB")
    monkeypatch.setattr(fits, "_FITTED", {})
    demo_machine._measure.cache_clear()
    yield
    demo_machine._measure.cache_clear()


BENCH = ["bench", "--tokens", "1", "--hidden", "8", "--experts", "64", "--topk", "2", "--reps", "1"]


@pytest.mark.parametrize("ranks", [64, 4096])
def test_bench_counts_the_runtime_of_every_spawned_rank(ranks, no_spawn, monkeypatch, capsys):
    # NOTE: N11: --world-size 64 (up to 4096) spawned without counting each process's runtime
    monkeypatch.setenv(sysmem.AVAILABLE_ENV, "16GiB")
    argv = [*BENCH, "--world-size", str(ranks), "--warmup", "0", "--what", "layout"]
    argv[argv.index("--experts") + 1] = str(ranks)
    assert _cli(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and len(err) <= 201
    assert f"error: --world-size {ranks}: needs ~" in err and ": lower --world-size" in err
    assert "12.8 GiB available (80% of $FLEXDISPATCH_MEMORY_AVAILABLE)" in err
    err = verbose_error(argv, capsys)  # NOTE: the derivation, with --verbose
    assert f"R={ranks} spawned ranks and the parent, each with 300.0 MiB runtime" in err
    assert "more than the 12.8 GiB available on cpu (80% of 16.0 GiB" in err


def test_bench_small_worlds_still_fit(no_spawn, monkeypatch):
    from flexdispatch.bench import BenchSpec
    from flexdispatch.cli.bench import check_bench_memory

    monkeypatch.setenv(sysmem.AVAILABLE_ENV, "16GiB")
    check_bench_memory(BenchSpec(world_size=4, tokens=1, hidden=8, experts=64, topk=2))
    check_bench_memory(BenchSpec())  # the defaults


def test_bench_rows_are_counted_with_their_temporaries(no_spawn, monkeypatch, capsys):
    # NOTE: N12: 600000 tokens of 1024 (4.9 GB estimated) were accepted in a 5 GiB cgroup and
    # the rank was OOM-killed; the audit measured 4.19 GB for 200000 tokens
    from flexdispatch.cli.bench import bench_rank_bytes

    monkeypatch.setenv(sysmem.AVAILABLE_ENV, "5GiB")
    argv = ["bench", "--world-size", "1", "--tokens", "600000", "--hidden", "1024"]
    argv += ["--experts", "8", "--topk", "2", "--what", "layout", "--reps", "1", "--warmup", "0"]
    assert _cli(argv) == 2
    err = capsys.readouterr().err
    assert "error: --tokens 600000: needs ~" in err and "4.0 GiB available" in err
    assert bench_rank_bytes(T=200000, H=1024, E=8, k=2, R=1, elem=2, worst_case=False) > 4.19e9


def test_plan_exact_is_bounded_with_its_estimate(capsys):
    # NOTE: N9: --exact materialised every block up front (5 GB in 20 s) and ran for a year
    argv = ["plan", "--preset", "tiny_cpu", "--nodes", "2", "--ranks-per-node", "2", "--exact"]
    assert _cli([*argv, "--tokens", "1000000000000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) <= 201, err
    assert (
        "error: --tokens 1000000000000000: --exact routes 1.28e+17 logits, about 812 years" in err
    )
    err = verbose_error([*argv, "--tokens", "1000000000000000"], capsys)
    assert "= 4 x 1000000000000000 x 16 x 2 = 128000000000000000 router logits" in err
    assert "about 812 years at the 5 M logits/s the planner routes on 2 CPU cores" in err
    t0 = time.process_time()  # NOTE: CPU time: the work done, whatever else loads the machine
    assert _cli([*argv, "--tokens", "100000000"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    err = verbose_error([*argv, "--tokens", "100000000"], capsys)
    assert "routing every token means R x T x E x variants = 4 x 100000000 x 16 x 2" in err
    assert "about 43 minutes at the 5 M logits/s" in err
    assert "more than its exact limit of 2147483648 logits: drop --exact" in err
    assert time.process_time() - t0 < 30
    from flexdispatch.planner import plan_cluster

    cfg = fd.load_config("tiny_cpu")
    with pytest.raises(ValueError, match=r"routing every token .* = 4 x 1000000000 x 16 x 2"):
        plan_cluster(cfg, nodes=2, ranks_per_node=2, tokens=10**9, max_logits=None)
    exact = plan_cluster(cfg, nodes=2, ranks_per_node=2, tokens=64, max_logits=None)
    assert sum(exact.variant("preset").tokens_per_expert) == 4 * 64 * 4


def test_plan_plot_of_many_experts_is_drawn_in_seconds(tmp_path):
    # NOTE: N10: one bar per expert: E = 65536 took 82 s to draw
    pytest.importorskip("matplotlib", reason="--plot needs the optional 'plot' extra")
    from flexdispatch.planner import plan_cluster, plot_plan
    from flexdispatch.planner.report import MAX_BARS

    cfg = fd.load_config("tiny_cpu")
    flat = {"num_experts": 65536, "num_groups": None, "group_topk": None}
    router = cfg.router.model_copy(update=flat)
    cfg = cfg.model_copy(update={"router": router})
    plan = plan_cluster(cfg, nodes=1, ranks_per_node=1, tokens=1)
    t0 = time.process_time()  # NOTE: CPU time (82 s of it before), not the machine's load
    path = plot_plan(plan, tmp_path / "e")
    assert time.process_time() - t0 < 30
    assert path == tmp_path / "e.png" and path.stat().st_size > 10_000
    assert MAX_BARS <= 512
