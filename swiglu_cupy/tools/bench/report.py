"""The bench report as a text table and as a PNG."""
from __future__ import annotations

import json
from pathlib import Path

from .contenders import CONTENDERS, LABELS, LOWER_BOUND, OURS, OURS_FP8
from .measure import short_error


def write_report(out_dir: Path, stem: str, report: dict, text: str, extra: tuple[Path, ...] = ()) -> None:
    """``<stem>.json`` and ``<stem>.txt`` in ``out_dir`` (made if missing), the
    text printed, then one line naming what was written (``extra``: files the
    mode wrote itself, a plot)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, text_path = out_dir / f"{stem}.json", out_dir / f"{stem}.txt"
    json_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    text_path.write_text(text + "\n")
    print(text)
    print(f"\nwrote {', '.join(str(p) for p in (json_path, text_path, *extra))}")


def _ms(s) -> str:
    if not s:
        return "-"
    return f"{s['median']:.3f} ({s['p10']:.3f}-{s['p90']:.3f})"


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def _us(s) -> str:
    return "-" if not s else f"{s['median']:.1f} ({s['p10']:.1f}-{s['p90']:.1f})"


def _ratio(value, goal=None) -> str:
    text = "-" if value is None else f"{value:.2f}x"
    return text if goal is None else f"{text} (goal <= {goal:.2f}x)"


def _overhead_lines(ov: dict, width: int) -> list[str]:
    s, ref = ov["shape"], ov["reference"]
    modes = list(ov["us_per_call"])
    lines = [f"host overhead per forward call, us (M={s['M']}, D={s['D']}, H={s['H']}, {s['dtype']}; median "
             f"(p10-p90) of {ov['rounds']} interleaved blocks of {ov['calls']} calls; ratio = / {ref}):",
             f"  {'contender':<{width}}" + "".join(f"  {m:>20}  {'ratio':>6}" for m in modes)]
    for name in ov["us_per_call"][modes[0]]:
        timings = [ov["us_per_call"][m].get(name) for m in modes]
        if all(t is None for t in timings):
            reason = ov["null_reasons"].get(name) or "; ".join(
                f"{m}: {ov['null_reasons'].get(f'{name} ({m})')}" for m in modes)
            lines.append(f"  {LABELS[name]:<{width}}  - ({reason})")
            continue
        cells = "".join(f"  {_us(t):>20}  {_ratio(ov['ratio_vs_reference'][m].get(name)):>6}"
                        for m, t in zip(modes, timings))
        lines.append(f"  {LABELS[name]:<{width}}{cells}")
    for m in modes:
        lines.append(f"ratio ours / {ref}, host overhead per call, {m}: "
                     f"{_ratio(ov['ratio_vs_reference'][m].get(OURS), ov['goals'].get(m))}")
    return lines


_CASE_NAMES = {"fwd_bwd": "fwd+bwd", "nograd_fwd": "no-grad fwd"}


def _cpu_path_lines(cpu: dict | None) -> list[str]:
    if not cpu:
        return []
    if "error" in cpu:
        return [f"CPU path ratios: {cpu['error']}"]
    s, ref = cpu["shape"], cpu["reference"]
    lines = [f"CPU path (M={s['M']}, D={s['D']}, H={s['H']}, {cpu['threads']} thread(s); median of "
             f"{cpu['rounds']} interleaved calls each):"]
    for case in cpu["cases"]:
        ms = case["ms"]
        fp8 = ms.get(OURS_FP8)
        fp8_note = "" if fp8 is None else f", ours with saved_x12='fp8' {fp8['median']:.1f}"
        lines.append(f"ratio ours / {ref}, CPU path {_CASE_NAMES[case['what']]} {case['dtype']}: "
                     f"{_ratio(case['ratio'], case['goal'])}  (median ms: ours {ms[OURS]['median']:.1f}{fp8_note}, "
                     f"{ref} {ms[ref]['median']:.1f})")
    return lines


def format_table(report: dict) -> str:
    lines = []
    env = report["environment"]
    where = env["gpu_name"] or f"CPU ({env['cpu']})"
    lines.append(f"swiglu-cupy bench  {env['date']}  {where}  torch {env['torch']}  cupy {env['cupy']}")
    lines.append("times in ms: median (p10-p90); 'x GEMM' = fwd+bwd median / GEMM lower bound; "
                 "memory = peak above baseline, MiB")
    names = (LOWER_BOUND, *CONTENDERS)
    width = max(len(LABELS[n]) for n in names)
    for res in report["results"]:
        s = res["shape"]
        lines.append("")
        lines.append(f"== {s['name']}  D={s['D']} H={s['H']} M={s['M']} {s['dtype']}")
        lines.append(f"{'contender':<{width}}  {'fwd':>24}  {'bwd':>24}  {'fwd+bwd':>24}  "
                     f"{'x GEMM':>6}  {'mem fwd+bwd':>11}  {'mem no-grad':>11}  {'rel err':>8}")
        bound = res["contenders"].get(LOWER_BOUND, {}).get("fwd_bwd_ms")
        for name in names:
            e = res["contenders"].get(name)
            if e is None:
                continue
            if not e.get("available"):
                lines.append(f"{LABELS[name]:<{width}}  absent: {e.get('reason')}")
                continue
            ratio = (f"{e['fwd_bwd_ms']['median'] / bound['median']:.2f}" if bound else "-")
            err = e.get("rel_err_vs_eager_hf")
            lines.append(f"{LABELS[name]:<{width}}  {_ms(e['fwd_ms']):>24}  {_ms(e['bwd_ms']):>24}  "
                         f"{_ms(e['fwd_bwd_ms']):>24}  {ratio:>6}  {_mib(e['peak_mem_fwd_bwd_bytes']):>11}  "
                         f"{_mib(e['peak_mem_nograd_fwd_bytes']):>11}  "
                         f"{'-' if err is None else f'{err:.1e}':>8}")
    copy = report.get("copy")
    lines.append("")
    if copy and copy.get("gbps"):
        lines.append(f"device copy (dst.copy_(src), {copy['buffer_bytes'] // 2**20} MiB): {copy['gbps']:.1f} GB/s")
    lines.append("elementwise primitives (fwd: read 2H + write H; bwd: read 3H + write 3H elements per token):")
    for res in report["results"]:
        el = res.get("elementwise") or {}
        if "fwd_gbps" not in el:
            lines.append(f"  {res['shape']['name']} M={res['shape']['M']}: {el.get('error', 'not measured')}")
            continue
        pct = lambda v: f" ({100 * v / copy['gbps']:.0f}% of copy)" if copy and copy.get("gbps") else ""  # noqa: E731
        s = res["shape"]
        lines.append(f"  {s['name']} {s['dtype']} M={s['M']} [{el['implementation']}]: "
                     f"fwd {el['fwd_ms']['median']:.3f} ms {el['fwd_gbps']:.1f} GB/s{pct(el['fwd_gbps'])}; "
                     f"bwd {el['bwd_ms']['median']:.3f} ms {el['bwd_gbps']:.1f} GB/s{pct(el['bwd_gbps'])}")
    for ov in report.get("host_overhead", []):
        lines += _overhead_lines(ov, width)
    lines += _cpu_path_lines(report.get("cpu_path"))
    for comp in report.get("compile", []):
        parts = []
        for key in ("cold", "warm"):
            r = comp.get(key)
            parts.append(f"{key} {r['first_call_s']:.2f} s" if r else
                         f"{key} - ({comp['null_reasons'].get(key)})")
        lines.append(f"kernel compile, first fwd+bwd in a new process ({comp['dtype']}): {'; '.join(parts)}")
    lines.append(f"total bench time: {report['wall_s']:.1f} s")
    return "\n".join(lines)


def pyplot():
    """(matplotlib.pyplot on the file-only Agg backend, None), or (None, why not)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return None, f"matplotlib is not importable ({short_error(exc)}): install it with `pip install matplotlib`"
    return plt, None


def plot(report: dict, path: Path) -> str | None:
    """Writes the PNG; returns None, or the reason nothing was written."""
    plt, reason = pyplot()
    if plt is None:
        return reason
    names = [n for n in (LOWER_BOUND, *CONTENDERS)
             if any(r["contenders"].get(n, {}).get("available") for r in report["results"])]
    groups = [f"{r['shape']['name']}\n{r['shape']['dtype']} M={r['shape']['M']}" for r in report["results"]]
    panels = [("fwd_ms", "forward (ms)"), ("bwd_ms", "backward (ms)"), ("fwd_bwd_ms", "forward + backward (ms)"),
              ("peak_mem_fwd_bwd_bytes", "peak memory fwd+bwd (MiB)"),
              ("peak_mem_nograd_fwd_bytes", "peak memory no-grad forward (MiB)")]
    fig, axes = plt.subplots(2, 3, figsize=(18, 9))
    width = 0.8 / max(len(names), 1)
    for ax, (key, title) in zip(axes.flat, panels):
        ax.set_title(title)
        drawn = False
        for i, name in enumerate(names):
            xs, heights, lo, hi = [], [], [], []
            for g, res in enumerate(report["results"]):
                e = res["contenders"].get(name, {})
                value = e.get(key) if e.get("available") else None
                if value is None:
                    continue
                xs.append(g + (i - (len(names) - 1) / 2) * width)
                if key.endswith("_ms"):
                    heights.append(value["median"])
                    lo.append(value["median"] - value["p10"])
                    hi.append(value["p90"] - value["median"])
                else:
                    heights.append(value / 2**20)
                    lo.append(0.0)
                    hi.append(0.0)
            if xs:
                drawn = True
                ax.bar(xs, heights, width, label=LABELS[name], yerr=[lo, hi] if key.endswith("_ms") else None,
                       capsize=2)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, fontsize=8)
        if not drawn:
            ax.set_yticks([])
            ax.text(0.5, 0.5, "not measured (needs CUDA)" if not key.endswith("_ms") else "no data",
                    ha="center", va="center", transform=ax.transAxes)
    absent = sorted({f"absent: {n} ({r['contenders'][n].get('reason', '')[:60]})"
                     for r in report["results"] for n in CONTENDERS
                     if n in r["contenders"] and not r["contenders"][n].get("available")})
    handles, labels = axes.flat[0].get_legend_handles_labels()
    last = axes.flat[5]
    last.axis("off")
    env = report["environment"]
    last.legend(handles, labels, loc="upper left", fontsize=9)
    last.text(0.0, 0.35, "\n".join([
        f"{env['gpu_name'] or 'CPU'}", f"torch {env['torch']}, cupy {env['cupy']}",
        f"CUDA {env['cuda_runtime'] or env['torch_cuda']}, driver {env['driver']}", env["date"],
        "bars: median; whiskers: p10-p90", *absent]), va="top", fontsize=9, transform=last.transAxes)
    fig.suptitle("SwiGLU feed-forward: swiglu-cupy and alternatives")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
