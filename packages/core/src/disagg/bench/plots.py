"""The published figure's shape: throughput vs vision tokens per layout, and
memory per rank vs vision tokens with the budget line and the points over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

INSTALL_HINT = "disagg bench draws its plots with matplotlib: pip install 'disagg-core[bench]'"


def require_matplotlib() -> None:
    """Fail before any step runs, with the line that fixes it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None


def _series(points: list[dict[str, Any]], value: Any) -> dict[str, list[tuple[int, float, dict[str, Any]]]]:
    out: dict[str, list[tuple[int, float, dict[str, Any]]]] = {}
    for p in points:
        y = value(p)
        if y is not None:
            out.setdefault(p["layout"], []).append((p["vision_tokens"], y, p))
    return {k: sorted(v, key=lambda t: t[0]) for k, v in out.items()}


def plot(
    points: list[dict[str, Any]], out_dir: Path, budget: int | None, probes: list[dict[str, Any]] = ()
) -> list[Path]:
    """Write ``throughput.png`` (sweep points: the budget probes' single steps
    are not timed) and ``memory.png`` (sweep points and probes); return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a CI machine
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 1024 and 20, not 2^10 and 2x10^1
    written = []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, s in _series(points, lambda p: p.get("measured", {}).get("tokens_per_s")).items():
        ax.plot([x for x, _, _ in s], [y for _, y, _ in s], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(plain)
    ax.set_xlabel("vision tokens per image")
    ax.set_ylabel("tokens/s (median after warm-up)")
    ax.set_title("Throughput per layout")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out_dir / "throughput.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    mib = 1024 * 1024
    points = [*points, *probes]
    for name, s in _series(points, lambda p: p["memory_per_rank"].get("measured")).items():
        (line,) = ax.plot([x for x, _, _ in s], [y / mib for _, y, _ in s], marker="o", label=name)
        over = [(x, y) for x, y, p in s if p.get("fits_budget") is False]
        if over:
            ax.scatter(
                [x for x, _ in over],
                [y / mib for _, y in over],
                marker="x",
                s=80,
                color=line.get_color(),
                zorder=3,
            )
        pred = _series(
            [p for p in points if p["layout"] == name], lambda p: p["memory_per_rank"]["predicted"]
        )
        for _, ps in pred.items():
            ax.plot(
                [x for x, _, _ in ps], [y / mib for _, y, _ in ps], ls=":", color=line.get_color(), alpha=0.7
            )
    if budget is not None:
        ax.axhline(budget / mib, color="red", ls="--", lw=1, label="budget (x: over)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("vision tokens per image")
    ax.set_ylabel("MiB per rank (saved activations + state)")
    ax.set_title("Memory per rank (dotted: analytic)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out_dir / "memory.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written
