"""The consistency/accuracy trade of every configuration measured so far, as a Pareto front: reads
the markdown tables of record (``robust_starter.md``'s sweeps, ``eval_compare.md``'s models and
expansions, ...) and writes one table and one plot of AO@10 against T2I R@1 and against STS-B.

    python -m paraseek.loadtests.research.pareto loadtests/results/robust_starter.md loadtests/results/eval_compare.md \
        --out loadtests/results/robust_pareto

A row is on the front when no other row is at least as good on AO@10, R@1 and STS and better on one
(rows without STS: on AO@10 and R@1 only). Rows repeated across files (the same run, label and numbers)
are kept once.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

AO = ("AO@10",)
R1 = ("T2I R@1",)
STS = ("STS ρ", "STS Spearman", "STS")
LABEL = ("model", "run")
ALPHA = ("WiSE-FT α",)
WHAT = ("what changed",)


@dataclass(frozen=True)
class Point:
    label: str
    ao: float
    r1: float
    sts: float | None
    source: str

    @property
    def expanded(self) -> bool:
        """A row of a tower with query-time expansion (``eval compare`` names them ``model + expansion``)."""
        return " + " in self.label and not self.label.startswith("+")

    def dominated_by(self, other: Point) -> bool:
        mine = [self.ao, self.r1] + ([self.sts] if self.sts is not None and other.sts is not None else [])
        theirs = [other.ao, other.r1] + ([other.sts] if self.sts is not None and other.sts is not None else [])
        return all(t >= m for t, m in zip(theirs, mine)) and any(t > m for t, m in zip(theirs, mine))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _column(header: list[str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if name in header:
            return header.index(name)
    return None


def _number(cell: str) -> float | None:
    match = re.match(r"^\**(-?\d+(?:\.\d+)?)", cell)
    return float(match.group(1)) if match else None


def read_points(path: Path) -> list[Point]:
    """Rows of every markdown table in ``path`` that has AO@10 and T2I R@1 columns."""
    points: list[Point] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("|") or i + 1 >= len(lines) or not set(lines[i + 1]) <= set("|-: "):
            i += 1
            continue
        header = _cells(lines[i])
        ao, r1, sts, label = (_column(header, names) for names in (AO, R1, STS, LABEL))
        alpha, what = _column(header, ALPHA), _column(header, WHAT)
        i += 2
        while i < len(lines) and lines[i].startswith("|"):
            row = _cells(lines[i])
            i += 1
            if ao is None or r1 is None or label is None or len(row) != len(header):
                continue
            a, r = _number(row[ao]), _number(row[r1])
            if a is None or r is None:
                continue
            name = row[label] + (f" α{row[alpha]}" if alpha is not None and row[alpha] not in ("", "–") else "")
            if what is not None and row[what] not in ("", "–"):
                name += f" ({row[what]})"
            points.append(Point(name, a, r, _number(row[sts]) if sts is not None else None, path.name))
    return points


def pareto_front(points: list[Point]) -> list[Point]:
    return [p for p in points if not any(p.dominated_by(q) for q in points if q is not p)]


def markdown(points: list[Point], front: list[Point]) -> str:
    out = ["| configuration | AO@10 | T2I R@1 | STS-B dev ρ | on the front | source |", "|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (-p.ao, -p.r1)):
        sts = f"{p.sts:.3f}" if p.sts is not None else ""
        out.append(f"| {p.label} | {p.ao:.3f} | {p.r1:.1f} | {sts} | {'yes' if p in front else ''} | {p.source} |")
    return "\n".join(out) + "\n"


def plot(points: list[Point], front: list[Point], out: Path, targets: dict[str, float]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    for ax, y, name in ((left, "r1", "T2I R@1 (%)"), (right, "sts", "STS-B dev Spearman")):
        shown = [p for p in points if getattr(p, y) is not None]
        for expanded, marker, kind in ((False, "o", "tower alone"), (True, "^", "with query-time expansion")):
            part = [p for p in shown if p.expanded == expanded]
            ax.scatter([p.ao for p in part], [getattr(p, y) for p in part], s=14, color="0.6", marker=marker, label=kind)
            on = [p for p in part if p in front]
            ax.scatter([p.ao for p in on], [getattr(p, y) for p in on], s=30, color="C3", marker=marker,
                       label=f"on the Pareto front (AO, R@1, STS), {kind}")
        on = sorted((p for p in shown if p in front), key=lambda p: p.ao)
        for p in on:
            ax.annotate(p.label[:38], (p.ao, getattr(p, y)), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.axvline(targets["ao"], color="C0", linestyle="--", linewidth=0.8)
        ax.axhline(targets[y], color="C0", linestyle="--", linewidth=0.8, label="issue 34 targets (tower alone)")
        ax.set_xlabel("AO@10 on the CxC dev pairs")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    left.legend(fontsize=7, loc="lower left")
    fig.suptitle("Consistency against top-1 and STS: every measured configuration (dev data)")
    fig.tight_layout()
    path = out.with_suffix(".png")
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tables", type=Path, nargs="+")
    p.add_argument("--out", type=Path, required=True, help="path stem: writes STEM.md and STEM.png")
    args = p.parse_args(argv)
    points: list[Point] = []
    for table in args.tables:
        points.extend(q for q in read_points(table) if all((q.label, q.ao, q.r1, q.sts) != (o.label, o.ao, o.r1, o.sts) for o in points))
    if not points:
        p.error("no table with AO@10 and T2I R@1 columns in the given files")
    front = pareto_front(points)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(markdown(points, front), encoding="utf-8")
    print(markdown(points, front))
    print(plot(points, front, args.out, {"ao": 0.85, "r1": 27.0, "sts": 0.860}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
