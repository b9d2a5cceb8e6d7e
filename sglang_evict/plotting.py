"""matplotlib for the PNGs the demo and the benches write: headless, optional."""

from __future__ import annotations


def pyplot_or_none():
    """``matplotlib.pyplot`` on the Agg backend (no display needed), or None, with a
    line saying how to get it, when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('no plot: matplotlib is not installed (pip install "matplotlib")')
        return None
    return plt


def save_figure(plt, figure, path) -> None:
    """Lay ``figure`` out, write it to ``path`` (PNG, its folder created) and free it."""
    from pathlib import Path

    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
