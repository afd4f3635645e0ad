"""The cells and lines every bench table is made of (report.py's tables, and the aio and ft
groups' own, which report.py calls): numbers to 3-4 significant figures, min - max spreads,
ratios to a baseline, entry labels, group headings and text wrapped to ``WIDTH`` columns."""
import textwrap

__all__ = ["WIDTH", "num", "ratio", "wrap", "rounds", "multi", "spread", "overlaps",
           "ratio_cell", "label", "heading"]

WIDTH = 100


def num(x, unit=""):
    if x is None:
        return "-"
    ax = abs(x)
    if ax >= 1e6:
        s = f"{x / 1e6:.2f}M"
    elif ax >= 1e4:
        s = f"{x / 1e3:.1f}k"
    elif ax >= 100:
        s = f"{x:.0f}"
    elif ax >= 10:
        s = f"{x:.1f}"
    else:
        s = f"{x:.2f}"
    return s + unit


def ratio(r):
    return "-" if r is None else f"x{r:.2f}"


def wrap(text, first="", rest=None):
    """``text`` wrapped to WIDTH columns, the first line after ``first``, the others after
    ``rest`` (spaces as wide as ``first`` by default)."""
    rest = " " * len(first) if rest is None else rest
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False) or [first.rstrip()]


def rounds(e):
    return e.get("rounds") or len(e.get("samples") or ())


def multi(ents):
    """True when some entry had more than one round: the spread column is worth a place."""
    return any(rounds(e) > 1 for e in ents)


def spread(e, sep=" - "):
    """min - max over the rounds; empty for a single round (there is no spread to show)."""
    return f"{num(e['min'])}{sep}{num(e['max'])}" if rounds(e) > 1 else ""


def overlaps(e, base):
    """True when ``e`` and the baseline were each measured more than once and their min-max
    ranges overlap: the difference between them is within this run's noise."""
    return (e is not base and base is not None and rounds(e) > 1 and rounds(base) > 1
            and e["min"] <= base["max"] and base["min"] <= e["max"])


def ratio_cell(e, base):
    if e["role"] == "reference":
        return "-"
    return ratio(e["ratio"]) + ("~" if overlaps(e, base) else "")


def label(e):
    return ("* " if e["winner"] else "  ") + e["name"] + {
        "baseline": "  (baseline)", "reference": ""}.get(e["role"], "")


def heading(g):
    base = g.get("baseline")
    lines = wrap(g["title"], f"\n[{g['id']}] ", "  ")
    lines.append(f"  {g['unit']}, {g['better']} is better"
                 + (f"; ratio = vs {base}" if base else ""))
    return lines
