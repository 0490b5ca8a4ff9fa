"""Tables, ratios and plots of a bench.qps result."""

from __future__ import annotations

from typing import Dict, List


def _find(rows, name, m=None):
    for r in rows:
        if r["name"] == name and (m is None or r.get("microbatches") == m):
            return r
    return None


def ratios(rows: List[Dict], stages: int) -> List[Dict]:
    """Per pipedp row: DP cost vs torch (same schedule and m; dp-zb against torch's 1F1B), speedup over the naive split,
    efficiency against the ideal p*m/(m+p-1) speedup over m=1, memory vs torch."""
    naive = _find(rows, "naive-split")
    out = []
    for r in rows:
        if not r["name"].startswith("pipedp-"):
            continue
        m, schedule = r["microbatches"], r["schedule"]
        torch_row = _find(rows, f"torch-{schedule if schedule in ('gpipe', '1f1b') else '1f1b'}", m)
        one = _find(rows, r["name"], 1)
        ideal = stages * m / (m + stages - 1)
        out.append(
            {
                "name": r["name"],
                "microbatches": m,
                "qps": r["qps"],
                "dp_cost_vs_torch": r["qps"] / torch_row["qps"] if torch_row else None,
                "speedup_vs_naive": r["qps"] / naive["qps"] if naive else None,
                "efficiency_vs_ideal": (r["qps"] / one["qps"]) / ideal if one else None,
                "memory_vs_torch": max(r["peak_mib"]) / max(1e-9, max(torch_row["peak_mib"])) if torch_row else None,
            }
        )
    return out


def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def markdown(result: Dict) -> str:
    lines = [
        f"**{result['preset']}**, {result['stages']} stages, logical batch {result['batch']}, median of "
        f"{result['reps']} steps; {result['machine']}; `{result['command']}` ({result['seconds']:.0f}s)",
        "",
        "| contender | m | samples/s | peak MiB per process |",
        "|---|---|---|---|",
    ]
    for r in result["rows"]:
        mem = " / ".join(f"{v:.0f}" for v in r["peak_mib"])
        lines.append(f"| {r['name']} | {r.get('microbatches', '-')} | {r['qps']:.1f} | {mem} |")
    lines += [
        "",
        "| pipedp | m | DP cost (x torch, same schedule) | x naive split | efficiency vs ideal | memory (x torch) |",
        "|---|---|---|---|---|---|",
    ]
    for q in result["ratios"]:
        lines.append(
            f"| {q['name']} | {q['microbatches']} | {_f(q['dp_cost_vs_torch'])} | {_f(q['speedup_vs_naive'])} | "
            f"{_f(q['efficiency_vs_ideal'])} | {_f(q['memory_vs_torch'])} |"
        )
    return "\n".join(lines)


def plot(result: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    series = sorted({r["name"] for r in rows if "microbatches" in r and r["name"] != "naive-split"})
    for name in series:
        pts = sorted((r["microbatches"], r["qps"]) for r in rows if r["name"] == name)
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            linestyle="--" if name.startswith("torch") else "-",
            label=name,
        )
    for r in rows:
        if "microbatches" not in r or r["name"] == "naive-split":
            ax.axhline(r["qps"], linestyle=":", color="grey")
            ax.text(1, r["qps"], r["name"], fontsize=7, va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches")
    ax.set_ylabel("samples / s")
    ax.set_title(f"{result['preset']}: QPS, {result['stages']} stages")
    ax.legend(fontsize=7)
    names = [f"{r['name']}" + (f" m={r['microbatches']}" if "microbatches" in r else "") for r in rows]
    for s in range(max(len(r["peak_mib"]) for r in rows)):
        bx.barh(
            [i + 0.4 * s for i in range(len(rows))],
            [r["peak_mib"][s] if s < len(r["peak_mib"]) else 0 for r in rows],
            height=0.4,
            label=f"process {s}",
        )
    bx.set_yticks(range(len(rows)), names, fontsize=6)
    bx.set_xlabel("peak MiB above start")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
