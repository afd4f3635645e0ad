"""``--plot DIR``: PNG charts of a run, with matplotlib (the optional ``plot`` extra:
``pip install 'aoprim[plot]'``).

  contention.png      throughput (Mops/s) against threads, one panel per series (lock, queue)
  servers.png         server scaling: messages/s and server CPU per message against
                      connections and against message size, one line per server
  ratios.png          every aoprim entry's ratio to its group's baseline (log scale; right
                      of 1 is better than the baseline)
Only the charts the run has data for are written.
"""
import os

from .report import _is_aoprim

__all__ = ["MissingMatplotlib", "plot", "HOW_TO_GET"]

HOW_TO_GET = ("--plot needs matplotlib: pip install 'aoprim[plot]' (or pip install "
              "matplotlib)")


class MissingMatplotlib(RuntimeError):
    pass


def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingMatplotlib(HOW_TO_GET) from None
    return plt


def _series(doc, name):
    return sorted((g for g in doc["groups"] if name in g.get("series", [])),
                  key=lambda g: tuple(sorted(g["params"].items())))


def _contention(plt, doc, path):
    series = [s for s in ("contention-lock", "contention-queue") if _series(doc, s)]
    if not series:
        return None
    fig, axes = plt.subplots(1, len(series), figsize=(5.2 * len(series), 3.6), squeeze=False)
    for ax, s in zip(axes[0], series):
        gs = sorted(_series(doc, s), key=lambda g: g["params"]["threads"])
        names = []
        for g in gs:
            for e in g["entries"]:
                if e["name"] not in names:
                    names.append(e["name"])
        for n in names:
            xs, ys = [], []
            for g in gs:
                e = next((e for e in g["entries"] if e["name"] == n), None)
                if e:
                    xs.append(g["params"]["threads"])
                    ys.append(1e3 / e["median"])
            ax.plot(xs, ys, marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8])
        ax.set_xticklabels(["1", "2", "4", "8"])
        ax.set_xlabel("threads")
        ax.set_ylabel("million operations/s (all threads)")
        ax.set_title(s.replace("contention-", "contention: "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _save(plt, fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _servers(plt, doc, path):
    panels = []
    for s, param in (("server-conns", "conns"), ("server-sizes", "size")):
        gs = _series(doc, s)
        if gs:
            panels.append((s, param, sorted(gs, key=lambda g: g["params"][param])))
    if not panels:
        return None
    fig, axes = plt.subplots(2, len(panels), figsize=(5.2 * len(panels), 6.4), squeeze=False)
    for col, (s, param, gs) in enumerate(panels):
        names = []
        for g in gs:
            for e in g["entries"]:
                if e["name"] not in names:
                    names.append(e["name"])
        for row, (metric, label) in enumerate((("msgs_per_s", "messages/s"),
                                               ("cpu", "server CPU us/message"))):
            ax = axes[row][col]
            for n in names:
                xs, ys = [], []
                for g in gs:
                    e = next((e for e in g["entries"] if e["name"] == n), None)
                    if not e:
                        continue
                    v = e["median"] if metric == "cpu" else \
                        e.get("metrics", {}).get(metric, {}).get("median")
                    if v is not None:
                        xs.append(g["params"][param])
                        ys.append(v)
                ax.plot(xs, ys, marker="o", label=n)
            ax.set_xscale("log")
            ax.set_xlabel("connections" if param == "conns" else "message bytes")
            ax.set_ylabel(label)
            ax.set_title(f"{s}: {label}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _ratios(plt, doc, path):
    bars = []
    for g in doc["groups"]:
        if g["kind"] == "contention" or not g.get("compete", True):
            continue        # a hardware floor is a yardstick, not a competitor
        for e in g["entries"]:
            if e["role"] == "candidate" and e.get("ratio") and _is_aoprim(e["name"]):
                bars.append((f"{g['id']}: {e['name']}", e["ratio"]))
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.22 * len(bars) + 1.0))
    labels = [b[0] for b in bars][::-1]
    vals = [b[1] for b in bars][::-1]
    colors = ["tab:green" if v >= 1 else "tab:red" for v in vals]
    ax.barh(range(len(vals)), vals, color=colors)
    ax.set_yticks(range(len(vals)))
    ax.set_yticklabels(labels, fontsize=6)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("ratio to the group's baseline (x times better; log scale)")
    ax.set_title(f"aoprim vs baselines, {doc['header']['date'][:10]}, "
                 f"{doc['header']['cpu_model']} x{doc['header']['cores']}", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return _save(plt, fig, path)


def _shrink(path):
    """Re-save a chart as a 64-colour palette PNG (a third of the size; charts have few
    colours) when Pillow is there -- matplotlib depends on it, so it normally is."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=64)
    small.save(path, optimize=True)


def plot(doc, outdir):
    """Write the charts the run has data for into ``outdir``; returns their paths.  Raises
    MissingMatplotlib (with how to get it) when matplotlib is not installed."""
    plt = _plt()
    os.makedirs(outdir, exist_ok=True)
    made = []
    for fn, name in ((_contention, "contention.png"), (_servers, "servers.png"),
                     (_ratios, "ratios.png")):
        p = fn(plt, doc, os.path.join(outdir, name))
        if p:
            _shrink(p)
            made.append(p)
    return made
