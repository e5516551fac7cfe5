"""Draw dsat's TensorBoard curves as one static SVG (docs/dsat.md's picture), read with TensorBoard's
own EventAccumulator from ``OUTPUT_DIR/tensorboard/curves`` (toolkit/dsat/tensorboard.py writes them).

    python scripts/tb_curves_svg.py runs/dsat docs/img/dsat-curves.svg [--metric throughput]

Left: the metric against the micro-batch, a line per ZeRO configuration. Right: the peak memory
per slot, measured (solid, trials judged out of memory as crosses), predicted by the memory model
(dashed) and the budget (grey). The micro-batch axis is logarithmic. No plotting library: SVG text.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

Points = list[tuple[int, float]]
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 440, 320, 66, 14, 34, 46


def read_curves(curves: Path) -> dict[str, dict[str, Points]]:
    """Every run under ``curves`` (``stage_1``, ``stage_1_predicted``, ``budget``...): tag -> points."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs: dict[str, dict[str, Points]] = {}
    for run in sorted(p for p in curves.iterdir() if p.is_dir()):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        runs[run.name] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags}
    return runs


def _ticks(lo: float, hi: float) -> list[float]:
    """About five round values between ``lo`` and ``hi``."""
    if hi <= lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / 4))
    step *= next(m for m in (1, 2, 5, 10) if (hi - lo) / (step * m) <= 5)
    return [step * k for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]


class Panel:
    """One chart: log2 micro-batch against a linear value, at ``(x0, 0)`` in the picture."""

    def __init__(self, x0: int, title: str, ylabel: str, series: Sequence[Points]) -> None:
        xs = [m for s in series for m, _ in s] or [1]
        ys = [v for s in series for _, v in s] or [0.0]
        self.x0, self.parts = x0, []
        self.lx = math.log2(min(xs))
        self.hx = math.log2(max(xs)) if max(xs) > min(xs) else self.lx + 1
        self.ly, self.hy = min(0.0, min(ys)), max(ys) * 1.3 or 1.0   # room for the legend at the top
        self.parts.append(f'<text x="{x0 + W / 2}" y="20" text-anchor="middle" font-size="14">'
                          f'{title}</text>')
        self._axes(ylabel)

    def xy(self, m: float, v: float) -> tuple[float, float]:
        fx = (math.log2(m) - self.lx) / (self.hx - self.lx)
        fy = (v - self.ly) / (self.hy - self.ly)
        return (self.x0 + PAD_L + fx * (W - PAD_L - PAD_R), PAD_T + (1 - fy) * (H - PAD_T - PAD_B))

    def _axes(self, ylabel: str) -> None:
        x_left, x_right, y_top, y_bottom = self.x0 + PAD_L, self.x0 + W - PAD_R, PAD_T, H - PAD_B
        add = self.parts.append
        add(f'<rect x="{x_left}" y="{y_top}" width="{x_right - x_left}" height="{y_bottom - y_top}" '
            'fill="none" stroke="#999"/>')
        for k in range(math.ceil(self.lx), math.floor(self.hx) + 1):
            x, _ = self.xy(2**k, self.ly)
            add(f'<line x1="{x:.1f}" y1="{y_bottom}" x2="{x:.1f}" y2="{y_bottom + 4}" stroke="#999"/>'
                f'<text x="{x:.1f}" y="{y_bottom + 16}" text-anchor="middle" font-size="10">{2**k}</text>')
        for v in _ticks(self.ly, self.hy):
            _, y = self.xy(2**self.lx, v)
            add(f'<line x1="{x_left}" y1="{y:.1f}" x2="{x_right}" y2="{y:.1f}" stroke="#eee"/>'
                f'<text x="{x_left - 4}" y="{y + 3:.1f}" text-anchor="end" font-size="10">{v:.4g}</text>')
        add(f'<text x="{(x_left + x_right) / 2}" y="{H - 8}" text-anchor="middle" font-size="11">'
            'micro-batch per GPU (log scale)</text>'
            f'<text transform="translate({self.x0 + 12},{(y_top + y_bottom) / 2}) rotate(-90)" '
            f'text-anchor="middle" font-size="11">{ylabel}</text>')

    def line(self, points: Points, colour: str, *, dashed: bool = False, marks: bool = True) -> None:
        points = sorted(points)
        if len(points) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in (self.xy(m, v) for m, v in points))
            dash = ' stroke-dasharray="5,4"' if dashed else ""
            self.parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" '
                              f'stroke-width="1.6"{dash}/>')
        for m, v in points if marks else ():
            x, y = self.xy(m, v)
            self.parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>')

    def crosses(self, points: Points, colour: str) -> None:
        for m, v in points:
            x, y = self.xy(m, v)
            self.parts.append(f'<path d="M{x - 4:.1f},{y - 4:.1f}L{x + 4:.1f},{y + 4:.1f}'
                              f'M{x - 4:.1f},{y + 4:.1f}L{x + 4:.1f},{y - 4:.1f}" stroke="{colour}" '
                              'stroke-width="1.8"/>')

    def legend(self, entries: Sequence[tuple[str, str, bool]]) -> None:
        for i, (label, colour, dashed) in enumerate(entries):
            x, y = self.x0 + PAD_L + 8, PAD_T + 14 + 14 * i
            dash = ' stroke-dasharray="5,4"' if dashed else ""
            self.parts.append(f'<line x1="{x}" y1="{y - 4}" x2="{x + 18}" y2="{y - 4}" stroke="{colour}" '
                              f'stroke-width="1.6"{dash}/>'
                              f'<text x="{x + 22}" y="{y}" font-size="10">{label}</text>')


def draw(runs: dict[str, dict[str, Points]], metric: str) -> str:
    """The SVG text of the two panels. Pure."""
    configs = [name for name in runs if name != "budget" and not name.endswith("_predicted")]
    colour = {name: COLOURS[i % len(COLOURS)] for i, name in enumerate(configs)}
    tag = f"metrics/{metric}"
    left = Panel(0, f"{metric} against the micro-batch", metric, [runs[c].get(tag, []) for c in configs])
    for name in configs:
        left.line(runs[name].get(tag, []), colour[name])
    left.legend([(name.replace("_", " "), colour[name], False) for name in configs])
    memory = [runs[n].get(k, []) for n in runs for k in ("memory/peak_MiB", "memory/peak_MiB_oom")]
    right = Panel(W, "peak memory per slot", "MiB", memory)
    right.line(runs.get("budget", {}).get("memory/peak_MiB", []), "#888", marks=False)
    for name in configs:
        predicted = runs.get(f"{name}_predicted", {}).get("memory/peak_MiB", [])
        right.line(predicted, colour[name], dashed=True, marks=False)
        right.line(runs[name].get("memory/peak_MiB", []), colour[name])
        right.crosses(runs[name].get("memory/peak_MiB_oom", []), colour[name])
    right.legend([("budget", "#888", False), ("measured (x: out of memory)", "#444", False),
                  ("memory model", "#444", True)])
    body = "\n".join(left.parts + right.parts)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H}" '
            f'viewBox="0 0 {2 * W} {H}" font-family="sans-serif">\n'
            f'<rect width="100%" height="100%" fill="white"/>\n{body}\n</svg>\n')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path, help="dsat's --output-dir")
    parser.add_argument("svg", type=Path, help="the picture to write")
    parser.add_argument("--metric", default="throughput",
                        help="the metric drawn on the left (default: %(default)s)")
    args = parser.parse_args(argv)
    curves = args.output_dir / "tensorboard" / "curves"
    if not curves.is_dir():
        parser.error(f"{curves}: no curves; is OUTPUT_DIR a dsat --output-dir of this toolkit?")
    args.svg.parent.mkdir(parents=True, exist_ok=True)
    args.svg.write_text(draw(read_curves(curves), args.metric), encoding="utf-8")
    print(f"wrote {args.svg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
