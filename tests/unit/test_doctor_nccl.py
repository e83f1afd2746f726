"""Issue 44, part 3: ``flexdispatch doctor`` reports, before a job starts, the NCCL runtime against
each DeepEP generation's rule, the NCCL plugins (mapped now, and what NCCL would dlopen at its
first communicator), DeepEP's GIN / device-API preconditions as far as they can be read without a
communicator, and the interface a gloo group would bind — each with ``doctor --json`` fields."""

from __future__ import annotations

import json
import shutil

import pytest

from flexdispatch.doctor import nccl as doctor_nccl
from flexdispatch.doctor import run_doctor
from tests.deepep_emu.shim import stand_in_libraries


def test_json_carries_the_new_fields_and_the_generations_their_nccl_rule() -> None:
    """The report (``doctor --json`` prints it: ``tests/unit/test_doctor.py`` checks its keys)
    has every new field; this CPU machine maps no NCCL, so the runtime is unknown and each rule's
    verdict is null (said, not guessed)."""
    rep = json.loads(json.dumps(run_doctor(world_size=16, ranks_per_node=8)))
    gens = rep["deep_ep_generations"]
    assert gens["v2"]["nccl_rule"]["rule"] == "== 2.30.7", gens["v2"]
    assert gens["v25"]["nccl_rule"]["rule"] == ">= 2.32.3", gens["v25"]
    assert gens["v1"]["nccl_rule"]["rule"].startswith("none"), gens["v1"]
    assert rep["nccl"]["runtime"]["version"] is None, rep["nccl"]["runtime"]
    assert gens["v2"]["nccl_rule"]["ok"] is None and gens["v1"]["nccl_rule"]["ok"] is True
    assert set(rep["nccl"]["plugins"]) >= {
        "mapped",
        "would_load",
        "deepep_import_after_communicator",
    }
    assert rep["gin"]["nodes"] == 2 and rep["gin"]["source"] == "environment", rep["gin"]
    assert rep["side_group"]["needed"] is False, rep["side_group"]


def test_a_net_plugin_on_the_library_path_is_listed(monkeypatch, tmp_path) -> None:
    """A ``libnccl-net.so`` on ``LD_LIBRARY_PATH`` (HPC-X SHARP, aws-ofi-nccl and GCP's plugins
    ship one): NCCL dlopens it at its first communicator, after which DeepEP's own import check
    refuses; the doctor lists it and says how flexdispatch imports DeepEP there."""
    libs = stand_in_libraries()
    if libs is None:
        pytest.skip("no libz to stand in for a plugin")
    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    shutil.copy(libs[0], plugin_dir / "libnccl-net.so")
    nccl_root = tmp_path / "nccl" / "lib"
    nccl_root.mkdir(parents=True)
    shutil.copy(libs[0], nccl_root / "libnccl.so.2")
    env = {"LD_LIBRARY_PATH": str(plugin_dir), "EP_NCCL_ROOT_DIR": str(nccl_root.parent)}
    monkeypatch.setenv("EP_NCCL_ROOT_DIR", str(nccl_root.parent))
    got = doctor_nccl.probe_plugins(env)
    assert got["mapped"] == [], got  # nothing mapped in the doctor's own process
    net = [p for p in got["would_load"] if p["kind"] == "net"]
    assert net and net[0]["path"] == str(plugin_dir / "libnccl-net.so"), got
    assert net[0]["source"] == "default", net
    assert got["deepep_import_after_communicator"] == "plugin-tolerant", got
    assert "EP_SUPPRESS_NCCL_CHECK=1" in got["detail"], got
    named = doctor_nccl.probe_plugins({**env, "NCCL_NET_PLUGIN": "none"})
    assert not [p for p in named["would_load"] if p["kind"] == "net"], named


def test_gin_preconditions_without_a_communicator() -> None:
    """``NCCL_CUMEM_ENABLE=0`` turns NCCL's symmetric memory off (nccl src/init.cc:1674-1675,
    misc/cudawrap.cc:47-50): V2's and V2.5's device communicator is refused, which the doctor
    says before any communicator exists; ``NCCL_GIN_TYPE=2`` (proxy) refuses V2.5 only;
    ``EP_DISABLE_GIN`` across nodes refuses both."""
    gin = doctor_nccl.probe_gin({"NCCL_CUMEM_ENABLE": "0"}, world_size=16, ranks_per_node=8)
    assert gin["cumem_enable"] == "0" and gin["device_api_support"] is False, gin
    assert gin["ok_v2"] is False and gin["ok_v25"] is False and "NCCL_CUMEM_ENABLE" in gin["detail"]
    proxy = doctor_nccl.probe_gin({"NCCL_GIN_TYPE": "2"}, world_size=8, ranks_per_node=8)
    assert proxy["ok_v25"] is False and proxy["ok_v2"] is None, proxy
    off = doctor_nccl.probe_gin({"EP_DISABLE_GIN": "1"}, world_size=16, ranks_per_node=8)
    assert off["ok_v2"] is False and "EP_DISABLE_GIN" in off["detail"], off
    fine = doctor_nccl.probe_gin({}, world_size=16, ranks_per_node=8)
    assert fine["ok_v2"] is None and fine["ok_v25"] is None, fine  # NCCL's report decides


def test_side_group_interface() -> None:
    """No side group is built; what a gloo group of the job would bind, against the route to the
    rendezvous."""
    side = doctor_nccl.probe_side_group({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert side["rendezvous_address"] == "127.0.0.1", side
    assert isinstance(side["hostname_loopback"], bool), side
    assert side["needed"] is False and side["gloo_socket_ifname"] is None, side
    set_if = doctor_nccl.probe_side_group({"GLOO_SOCKET_IFNAME": "eth0"})
    assert set_if["gloo_socket_ifname"] == "eth0" and set_if["warning"] is None, set_if


def test_text_report_has_a_line_per_new_fact() -> None:
    from flexdispatch.doctor import format_report

    text = format_report(run_doctor(world_size=8, ranks_per_node=8))
    for needle in ("  runtime  ", "  plugins  ", "  nccl     ", "gin        ", "gloo bind  "):
        assert needle in text, (needle, text)
