"""Output side of the studies: CSV tables, PNG figures, text summaries and progress bars.

matplotlib and tqdm (the ``plot`` extra) are imported lazily, so the library never needs them;
without tqdm the progress bar silently degrades to a plain loop.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

__all__ = ["write_csv", "write_summary", "new_figure", "save_figure", "progress"]


def _cell(value):
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return repr(value)
        return f"{value:.6g}"
    return value


def write_csv(rows: list[dict], path: Path) -> Path:
    """Write ``rows`` (a list of flat dicts sharing one key set) to ``path`` as CSV.

    Floats are written with 6 significant digits; inf/nan as ``inf``/``nan``. Returns the path.
    """
    if not rows:
        raise ValueError(f"write_csv needs at least one row for {path}, got none")
    fields = list(rows[0])
    for row in rows:
        for key in row:
            if key not in fields:
                fields.append(key)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(v) for k, v in row.items()})
    return path


def write_summary(title: str, lines: list[str], path: Path) -> Path:
    """Write a short text summary: the title, an underline and one paragraph per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = title + "\n" + "=" * len(title) + "\n\n" + "\n".join(lines).rstrip() + "\n"
    path.write_text(text)
    return path


def new_figure(ncols: int = 1, *, nrows: int = 1, width: float = 5.2, height: float = 3.8):
    """A matplotlib Figure with a grid of ``nrows`` x ``ncols`` axes, each about ``width`` x
    ``height`` inches, drawn off-screen (Agg canvas).

    Uses ``matplotlib.figure.Figure`` directly, so no pyplot backend is selected or changed.
    Returns ``(figure, list_of_axes)`` (row by row).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the studies draw with matplotlib: "
                          "pip install 'numba-flash[plot]'") from exc
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(nrows * ncols)]
    return fig, axes


def save_figure(fig, path: Path, *, dpi: int = 84) -> Path:
    """Save ``fig`` as a PNG at ``path`` (parents created); returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=dpi, metadata={"Software": None})
    return path


def progress(iterable, *, total: int | None = None, desc: str = "", enabled: bool = True):
    """Wrap ``iterable`` in a tqdm progress bar when tqdm is installed and ``enabled``."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)
