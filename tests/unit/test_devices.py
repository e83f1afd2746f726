"""Which backend and device the ranks of this machine get (``flexdispatch.launch.devices``), decided
before any process group exists; GPU machines are faked with ``$FLEXDISPATCH_VISIBLE_GPUS`` or an
explicit GPU count, so every branch runs on a CPU machine.

L ranks on this machine · G GPUs visible · E experts.
"""

from __future__ import annotations

import argparse

import pytest

from flexdispatch.cli import demo_machine
from flexdispatch.config import load_config
from flexdispatch.launch import devices

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(devices.DEVICE_ENV, raising=False)
    monkeypatch.delenv(devices.VISIBLE_GPUS_ENV, raising=False)


@pytest.mark.parametrize(
    ("L", "G", "device", "backend", "device_type"),
    [
        (2, 0, "auto", "gloo", "cpu"),
        (4, 8, "auto", "nccl", "cuda"),
        (8, 8, "cuda", "nccl", "cuda"),
        (1, 1, "auto", "nccl", "cuda"),
        (4, 1, "cpu", "gloo", "cpu"),
        (2, 8, "cpu", "gloo", "cpu"),
    ],
)
def test_plan_when_the_ranks_fit(L: int, G: int, device: str, backend: str, device_type: str):
    plan = devices.plan_devices(L, device=device, gpus=G)
    assert (plan.backend, plan.device_type, plan.ranks_per_node, plan.gpus) == (
        backend,
        device_type,
        L,
        G,
    )
    assert plan.uses_gpus == (device_type == "cuda")
    if plan.uses_gpus:
        assert [plan.device_index(i) for i in range(L)] == list(range(L))
        assert plan.child_env() == {}
        with pytest.raises(ValueError, match=f"outside 0..{L - 1}"):
            plan.device_index(L)
    else:
        assert plan.device_index(0) is None
        assert plan.child_env() == {"CUDA_VISIBLE_DEVICES": ""}
    assert f"{L} rank(s)" in plan.line() and f"{G} GPU(s)" in plan.line()


@pytest.mark.parametrize(("L", "G"), [(2, 1), (8, 4), (16, 8)])
def test_more_ranks_than_gpus_is_refused_in_one_line_naming_both(L: int, G: int) -> None:
    with pytest.raises(ValueError) as err:
        devices.plan_devices(L, gpus=G, ranks_hint="NPROC_PER_NODE={gpus}", cpu_hint="--cpu")
    msg = str(err.value)
    assert "\n" not in msg
    assert f"{L} rank(s)" in msg and f"only {G} GPU(s)" in msg
    assert f"NPROC_PER_NODE={G}" in msg and "--cpu" in msg


def test_cuda_asked_without_a_gpu_and_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match=r"no GPU is visible.*FLEXDISPATCH_DEVICE=cpu"):
        devices.plan_devices(2, device="cuda", gpus=0)
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        devices.plan_devices(0, gpus=1)
    with pytest.raises(ValueError, match="'tpu' is not one of"):
        devices.plan_devices(1, device="tpu", gpus=1)


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(devices.VISIBLE_GPUS_ENV, "3")
    assert devices.visible_gpus() == (3, "$FLEXDISPATCH_VISIBLE_GPUS")
    assert devices.plan_devices(3).backend == "nccl"
    with pytest.raises(ValueError, match=r"4 rank\(s\).*only 3 GPU\(s\).*FLEXDISPATCH_VISIBLE"):
        devices.plan_devices(4)
    monkeypatch.setenv(devices.DEVICE_ENV, "CPU")
    assert devices.requested_device() == "cpu"
    assert devices.plan_devices(4).backend == "gloo"
    monkeypatch.setenv(devices.DEVICE_ENV, "gpu")
    with pytest.raises(ValueError, match="FLEXDISPATCH_DEVICE='gpu' is not a device"):
        devices.requested_device()
    assert devices.requested_device(cpu_flag=True) == "cpu"
    monkeypatch.setenv(devices.VISIBLE_GPUS_ENV, "two")
    with pytest.raises(ValueError, match="'two' is not a GPU count"):
        devices.visible_gpus()


def test_real_count_is_torch_s(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    want = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert devices.visible_gpus()[0] == want


def test_check_command(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv(devices.VISIBLE_GPUS_ENV, "1")
    assert devices.main(["--ranks", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("flexdispatch: refused: 2 rank(s)")
    assert "NPROC_PER_NODE=1" in err and "FLEXDISPATCH_DEVICE=cpu" in err
    assert devices.main(["--ranks", "1"]) == 0
    assert "NCCL, one rank per GPU (cuda:0)" in capsys.readouterr().err
    assert devices.main(["--ranks", "2", "--cpu"]) == 0
    assert "gloo" in capsys.readouterr().err
    assert devices.main(["--ranks", "1", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def _args(nodes=None, per_node=None, cpu=False) -> argparse.Namespace:
    return argparse.Namespace(nodes=nodes, ranks_per_node=per_node, cpu=cpu)


@pytest.mark.parametrize(
    ("G", "E", "nodes", "per_node", "backend"),
    [
        (0, 16, 2, 2, "gloo"),  # a CPU machine: 2 x 2 over gloo, as before
        (1, 16, 1, 1, "nccl"),  # one GPU: one rank
        (3, 16, 1, 2, "nccl"),  # the most GPUs dividing E
        (8, 16, 2, 4, "nccl"),  # even and >= 4: two simulated nodes
        (8, 6, 2, 3, "nccl"),
    ],
)
def test_demo_defaults_to_one_rank_per_gpu(
    monkeypatch: pytest.MonkeyPatch, G: int, E: int, nodes: int, per_node: int, backend: str
) -> None:
    monkeypatch.setenv(devices.VISIBLE_GPUS_ENV, str(G))
    got_nodes, got_per_node, plan = demo_machine.spawned_topology(_args(), E)
    assert (got_nodes, got_per_node, plan.backend) == (nodes, per_node, backend)
    assert E % (nodes * per_node) == 0 and plan.ranks_per_node == nodes * per_node


def test_demo_explicit_topology_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(devices.VISIBLE_GPUS_ENV, "1")
    with pytest.raises(ValueError) as err:
        demo_machine.spawned_topology(_args(2, 2), 16)
    msg = str(err.value)
    assert "4 rank(s) on this machine but only 1 GPU(s)" in msg
    assert "--nodes 1 --ranks-per-node 1" in msg and "--cpu" in msg
    nodes, per_node, plan = demo_machine.spawned_topology(_args(2, 2, cpu=True), 16)
    assert (nodes, per_node, plan.backend) == (2, 2, "gloo")
    assert demo_machine.spawned_topology(_args(nodes=1, cpu=True), 16)[:2] == (1, 2)
    with pytest.raises(ValueError, match=r"2 rank\(s\) on this machine but only 1 GPU"):
        demo_machine.spawned_topology(
            _args(nodes=1), 16
        )  # the other one defaults to 2, as on the CPU
    with pytest.raises(ValueError, match="must be >= 1, got --nodes 0 --ranks-per-node 2"):
        demo_machine.spawned_topology(_args(0, 2, cpu=True), 16)
    # what the preset refuses (E not divisible by R) is said before the GPU count
    cfg = load_config("tiny_cpu")
    with pytest.raises(ValueError, match=r"num_experts=16 is not divisible by .* world size 3"):
        demo_machine.spawned_topology(_args(1, 3), 16, cfg.check_world)
    monkeypatch.setenv(devices.VISIBLE_GPUS_ENV, "4")
    assert demo_machine.launcher_devices(_args(), 4).backend == "nccl"
    with pytest.raises(ValueError, match=r"--nproc-per-node 4 \(NPROC_PER_NODE=4"):
        demo_machine.launcher_devices(_args(), 8)
    assert demo_machine.launcher_devices(_args(cpu=True), 8).backend == "gloo"


def test_demo_refuses_before_spawning(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from flexdispatch import launch
    from flexdispatch.cli import main

    def boom(*a, **k):
        raise AssertionError("spawned although refused")

    monkeypatch.setattr(launch, "spawn_group", boom)
    monkeypatch.setenv(devices.VISIBLE_GPUS_ENV, "2")
    assert main(["demo", "--nodes", "2", "--ranks-per-node", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) <= 200, err
    assert "4 rank(s) on this machine but only 2 GPU(s) visible" in err[0], err


def test_spawn_group_refuses_more_nccl_ranks_than_gpus() -> None:
    import torch

    from flexdispatch.launch import spawn_group

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=rf"world_size={gpus + 1} NCCL ranks but {gpus} GPU"):
        spawn_group(print, gpus + 1, backend="nccl")
