"""The text form of the doctor's report (``flexdispatch doctor`` without ``--json``)."""

from __future__ import annotations

from typing import Any

__all__ = ["format_report"]


def _mark(ok: bool) -> str:
    return "ok " if ok else "NO "


def format_report(report: dict[str, Any]) -> str:
    """The report as a short human-readable text (what ``flexdispatch doctor`` prints)."""
    p, t, c, n = report["platform"], report["torch"], report["cuda"], report["nccl"]
    lines = [
        f"flexdispatch {report['flexdispatch_version']} doctor — {p['hostname']}, "
        f"{p['cpu_count']} CPUs, Python {p['python']} ({p['system']} {p['machine']})",
        f"torch      {t['version']} (built with CUDA {t['cuda_build'] or 'none'})",
        f"cuda       {_mark(c['available'])}{c['reason']}"
        + (f", runtime {c['version']}" if c["available"] else ""),
    ]
    for g in report["gpus"]:
        lines.append(
            f"  gpu {g['index']}    {g['name']}, {g['total_memory_bytes'] / 2**30:.1f} GiB, "
            f"sm_{g['compute_capability'].replace('.', '')}, {g['multi_processor_count']} SMs"
        )
    lines.append(
        f"nccl       {_mark(n['available'])}"
        + (f"version {n['version']}" if n["version"] else n["reason"])
    )
    rt = n.get("runtime")
    if rt is not None:
        lines.append(
            f"  runtime  {rt['version'] or 'unknown'} ({rt['detail']})"
            + (f"; {rt['library']}" if rt["library"] else "")
        )
    pl = n.get("plugins")
    if pl is not None:
        found = ", ".join(f"{w['kind']} {w['path']}" for w in pl["would_load"]) or "none"
        lines.append(
            f"  plugins  mapped {', '.join(pl['mapped']) or 'none'}; at the first communicator "
            f"{found}; DeepEP import after it: {pl['deepep_import_after_communicator']}"
        )
    lines.append(
        f"gloo       {_mark(report['gloo']['available'])}"
        + ("available" if report["gloo"]["available"] else "not built")
    )
    d = report["deep_ep"]
    detail = d["reason"]
    if d["importable"]:
        detail += f" (version {d['version'] or '?'}, {d['path']})" + (
            " [test emulator]" if d["emulator"] else ""
        )
    lines.append(f"deep_ep    {_mark(d['usable'])}{detail}")
    gens = report.get("deep_ep_generations")
    if gens:
        lines.append(
            "deepep gen "
            + ", ".join(
                f"{name} {g['api']} {'ok' if g['ok'] else 'NO'}"
                for name, g in (("V1", gens["v1"]), ("V2", gens["v2"]), ("V2.5", gens["v25"]))
            )
        )
        if not gens["v25"]["ok"]:
            lines.append(f"           V2.5: {gens['v25']['reason']}")
        for name, g in (("V1", gens["v1"]), ("V2", gens["v2"]), ("V2.5", gens["v25"])):
            rule = g.get("nccl_rule")
            if rule is not None:
                mark = "?? " if rule["ok"] is None else _mark(rule["ok"])
                lines.append(f"  nccl     {mark}{name} needs NCCL {rule['rule']}: {rule['detail']}")
    gin = report.get("gin")
    if gin is not None:
        verdict = " ".join(
            f"{name} {'?' if gin[key] is None else 'ok' if gin[key] else 'NO'}"
            for name, key in (("V2", "ok_v2"), ("V2.5", "ok_v25"))
        )
        lines.append(f"gin        {verdict} ({gin['source']}): {gin['detail']}")
    side = report.get("side_group")
    if side is not None:
        lines.append(
            f"gloo bind  {side['gloo_socket_ifname'] or side['hostname_address'] or '?'} "
            f"(GLOO_SOCKET_IFNAME or {side['hostname']}); route to the rendezvous "
            f"{side['rendezvous_address'] or 'unknown'}"
            + (f" — {side['warning']}" if side["warning"] else "")
        )
    for chk in report.get("deep_ep_v25", []):
        mark = _mark(chk["ok"]) if chk["ok"] or chk["level"] == "error" else "warn "
        fix = f" — fix: {chk['fix']}" if chk["fix"] else ""
        lines.append(f"  v2.5    {mark}{chk['name']}: {chk['detail']}{fix}")
    nv = report["nvshmem"]
    lines.append(
        f"nvshmem    {_mark(nv['nvshmem4py']['importable'])}nvshmem4py {nv['status']}"
        + (f" (version {nv['nvshmem4py']['version']})" if nv["nvshmem4py"]["version"] else "")
        + (f"; library {nv['library_path']}" if nv["library_path"] else "")
    )
    la = report["launcher"]
    if la["under_launcher"]:
        env = " ".join(f"{k}={v}" for k, v in la["env"].items())
        lines.append(f"launcher   {env}")
    s = report["selection"]
    lines.append(
        f"backend    requested {s['requested']!r} for {s['world_size']} rank(s) = {s['nodes']} "
        f"node(s) x {s['ranks_per_node']}"
        + (f", H={s['hidden']}" if s["hidden"] is not None else "")
        + f": {s['backend'] or 'NOT USABLE'}"
    )
    lines.append(f"           {s['reason']}")
    api = s.get("deepep_api")
    if api is not None:
        lines.append(
            f"deepep_api requested {api['requested']!r}: {api['api'] or '-'} ({api['reason']})"
        )
    for name in ("deepep", "torch"):
        for chk in s["checks"][name]:
            lines.append(f"  {name:<7} {_mark(chk['ok'])}{chk['name']}: {chk['detail']}")
    return "\n".join(lines)
