"""PNG plots of a bench summary (matplotlib, imported only here)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the install
        from ..errors import ConfigError

        raise ConfigError("plots need matplotlib: pip install 'specdraft[bench]'") from None
    return plt


def speedup_by_category(summary: dict, path: Path) -> None:
    plt = _pyplot()
    methods = [m for m in summary if m != "plain"]
    categories = list(next(iter(summary.values())))
    fig, ax = plt.subplots(figsize=(max(8, len(categories) * 0.9), 4.5))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        values = [summary[m].get(c, {}).get("speedup") or 0.0 for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(categories))], categories, rotation=40, ha="right")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("Speedup by category")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def acceptance_by_position(summary: dict, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    longest = 1
    for m, cats in summary.items():
        pos = cats["overall"].get("acceptance_by_position")
        if pos:
            ax.plot(range(1, len(pos) + 1), pos, marker="o", label=m)
            longest = max(longest, len(pos))
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance by draft position (overall)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
