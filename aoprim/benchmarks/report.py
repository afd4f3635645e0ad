"""Tables for the terminal, and ``--compare``.

Every group prints one table: each entry's median, its spread (min - max over the rounds,
printed only when there was more than one round), and its ratio to the group's baseline --
``x2.50`` is 2.5 times better than the baseline (faster for ns/op, less CPU per message for
servers), ``~`` after it when the entry's min-max overlaps the baseline's (the difference is
within the run's own noise); ``*`` marks the group's winner (the best median among the entries
that compete; references such as the empty loop or a hardware floor never win and carry no
ratio).  The heading of each table names its unit and its baseline.  No line is wider than
``WIDTH`` columns.

The command prints the header, then each group's table as the group ends, then the footer;
``render(doc)`` is the same text for a saved run.
"""
from .fmt import WIDTH, heading, label, multi, num, ratio, ratio_cell, spread, wrap

__all__ = ["render", "render_header", "render_group", "render_footer", "compare",
           "markdown_summary", "markdown_servers", "markdown", "WIDTH"]

def _mmss(s):
    s = int(s)
    return f"{s // 60}:{s % 60:02d}"


LEGEND = ("median over the rounds; spread = min - max over the rounds (not shown after a "
          "single round); ratio = the baseline's median / the row's: x2.00 = twice as fast (or "
          "half the CPU) as the group's baseline, x0.50 = half as fast; ~ = the row's and the "
          "baseline's min-max overlap (a difference within this run's noise); * = the best "
          "median; a (floor) row is the hardware's lower bound, shown for scale, with no "
          "ratio")


def render_header(doc):
    h = doc["header"]
    c = h.get("compiler", {})
    comp = c.get("error") or (
        f"{c.get('cc', 'cc')} {c.get('compiler', '?')}, "
        f"{'optimized' if c.get('optimized') else 'NOT optimized'}"
        f"{', AddressSanitizer' if c.get('asan') else ''}; Python's CFLAGS: "
        f"{c.get('python_cflags', '')}")
    la = h.get("load_average")
    lines = [f"aoprim bench ({h['mode']}) -- {h['date']}"]
    lines += wrap(f"{h['cpu_model']}, {h['cores']} cores"
                   + (f", Linux {h['kernel']}" if h.get("kernel") else "")
                   + (f"; load average {la[0]:.2f} at the start" if la else ""), "machine:   ")
    lines.append(f"python:    {h['python']}")
    lines += wrap(f"{h['aoprim_version']}"
                   + (f" (commit {h['commit']})" if h.get("commit") else "")
                   + (f" from {h['aoprim_path']}" if h.get("aoprim_path") else ""), "aoprim:    ")
    lines += wrap(comp, "compiler:  ")
    if h.get("servers"):
        lines += wrap(f"{', '.join(h['servers'])}; {h['server_warmup']}", "servers:   ")
        lines += wrap(h["syscalls"], "syscalls:  ")
    lines += wrap(LEGEND, "figures:   ")
    for w in _start_warnings(h):
        lines += wrap(w, "WARNING:   ")
    return "\n".join(lines)


def _start_warnings(h):
    """The warnings known at the start (the load average's); the rest are the footer's."""
    return [w for w in h.get("warnings", []) if "at the start" in w]


def _note(g):
    return wrap(g["note"], "  note: ", "        ") if g.get("note") else []


def _cells(e, name_w, cols):
    """One table row: the label in ``name_w`` columns (on a line of its own when longer),
    then the right-aligned ``cols`` (text, width)."""
    name = label(e)
    nums = " ".join(f"{t:>{w}}" for t, w in cols)
    if len(name) > name_w:
        return [name, f"{'':<{name_w}} {nums}"]
    return [f"{name:<{name_w}} {nums}"]


def _name_width(ents, cols_w):
    w = max([len(label(e)) for e in ents] + [len("  server")])
    return min(w, WIDTH - 1 - cols_w)


def _server_tables(g, ents, base):
    """Two blocks per server group, each within WIDTH: the CPU figure with its spread (when
    some server ran more than one round) and ratio, msgs/s and its ratio, p99; then user/sys, p50, syscalls and faults (and, for TLS,
    records and wire bytes) per message."""
    uw = max(10, len(g["unit"]))
    tls = any("records_per_msg" in e.get("metrics", {}) for e in ents)
    bm = base["metrics"].get("msgs_per_s", {}).get("median") if base else None

    def med(e, k):
        return e.get("metrics", {}).get(k, {}).get("median")

    with_spread = multi(ents)
    first = [(g["unit"], uw)] + ([("spread", 11)] if with_spread else []) + \
        [("ratio", 6), ("msgs/s", 8), ("ratio", 6), ("p99 us", 7)]
    second = [("user", 6), ("sys", 6), ("p50 us", 7), ("syscalls/msg", 13),
              ("faults/msg", 11)] + ([("records/msg", 12), ("wire B/msg", 11)] if tls else [])
    nw = _name_width(ents, max(sum(w + 1 for _, w in first), sum(w + 1 for _, w in second)))
    head = {"name": "server", "winner": False, "role": "candidate"}
    lines = _cells(head, nw, first)
    for e in ents:
        mps = med(e, "msgs_per_s")
        mr = (mps / bm) if bm and mps else None
        lines += _cells(e, nw, [(num(e["median"]), uw)]
                        + ([(spread(e, "-"), 11)] if with_spread else [])
                        + [(ratio_cell(e, base), 6), (num(mps), 8),
                           ("-" if e["role"] == "reference" else ratio(mr), 6),
                           (num(med(e, "p99_us")), 7)])
    lines += _cells(head, nw, second)
    for e in ents:
        sc, fl, rpm = med(e, "syscalls_per_msg"), med(e, "faults_per_msg"), \
            med(e, "records_per_msg")
        cols = [(num(med(e, "user_us_per_msg")), 6), (num(med(e, "sys_us_per_msg")), 6),
                (num(med(e, "p50_us")), 7), ("-" if sc is None else f"{sc:.3f}", 13),
                ("-" if fl is None else f"{fl:.2f}", 11)]
        if tls:
            cols += [("-" if rpm is None else f"{rpm:.3f}", 12),
                     (num(med(e, "wire_bytes_per_msg")), 11)]
        lines += _cells(dict(e, winner=False), nw, cols)
    return lines


def render_group(g):
    if g["family"] == "aio":
        from .aio import render_group as aio_group
        return aio_group(g)
    if g["family"] == "ft":
        from .ft import render_group as ft_group
        return ft_group(g)
    lines = heading(g)
    ents = sorted(g["entries"], key=lambda e: e["median"], reverse=(g["better"] == "higher"))
    base = next((e for e in g["entries"] if e["role"] == "baseline"), None)
    if g["kind"] == "server":
        lines += _server_tables(g, ents, base)
    else:
        extra = g["kind"] == "contention"
        with_spread = multi(ents)
        cols = [("median", 9)] + ([("spread (min - max)", 19)] if with_spread else []) + \
            [("ratio", 7)] + ([("Mops/s", 7), ("CPU/wall", 8)] if extra else [])
        nw = _name_width(ents, sum(w + 1 for _, w in cols))
        lines += _cells({"name": "entry", "winner": False, "role": "candidate"}, nw, cols)
        for e in ents:
            row = [(num(e["median"]), 9)] + ([(spread(e), 19)] if with_spread else []) + \
                [(ratio_cell(e, base), 7)]
            if extra:
                cw = e.get("metrics", {}).get("cpu_per_wall", {}).get("median")
                row += [(f"{1e3 / e['median']:.2f}", 7), ("-" if cw is None else f"{cw:.2f}", 8)]
            lines += _cells(e, nw, row)
    lines += _note(g)
    for s in g["skipped"]:
        lines += wrap(f"{s['name']}: {s['reason']}", "  (skipped ", "    ")
    return "\n".join(lines)


def render_footer(doc):
    """How long the run took, how busy the machine was, every warning, what was skipped."""
    h = doc["header"]
    parts = []
    if "duration_s" in h:
        la = h.get("load_average_end")
        busy = [f"load average {la[0]:.2f} at the end" if la else None,
                f"the bench kept {h['own_cpus']:.1f} of {h['cores']} cores busy"
                if h.get("own_cpus") is not None else None,
                f"other processes {h['other_cpus']:.1f}"
                if h.get("other_cpus") is not None else None]
        parts += wrap(f"took {_mmss(h['duration_s'])}"
                       + "".join(f"; {b}" for b in busy if b), "\nrun:       ", " " * 11)
        for w in h.get("warnings", []):
            if w not in _start_warnings(h):
                parts += wrap(w, "WARNING:   ")
    if doc["skipped"]:
        parts.append("\nskipped:")
        for s in doc["skipped"]:
            parts += wrap(f"{s['what']}: {s['reason']}", "  ", "    ")
    return "\n".join(parts)


def render(doc):
    parts = [render_header(doc)]
    for g in doc["groups"]:
        parts.append(render_group(g))
    foot = render_footer(doc)
    if foot:
        parts.append(foot)
    return "\n".join(parts)


NW = 40      # compare(): the entry-name column


def _named(name, rest):
    """A compare() row: the name in NW columns (on a line of its own when longer), then
    ``rest``."""
    if len(name) > NW:
        return [f"  {name}", f"  {'':<{NW}} {rest}"]
    return [f"  {name:<{NW}} {rest}"]


def compare(old, new):
    """The change from ``old`` to ``new`` (two documents), group by group, entry by entry:
    medians, the change in percent, and the ratio to the baseline then and now.  ``better``
    / ``worse`` only when the new median lies outside the old run's min-max range (and the
    change is in that direction); ``~`` otherwise."""
    oh, nh = old["header"], new["header"]
    lines = wrap(f"compared with {oh['date']} ({oh['cpu_model']}, {oh['cores']} cores, "
                  f"{oh['python']}, aoprim {oh['aoprim_version']}"
                  + (f" {oh['commit']}" if oh.get("commit") else "") + f", {oh['mode']})",
                  "\n", "  ")
    if (oh["cpu_model"], oh["cores"]) != (nh["cpu_model"], nh["cores"]):
        lines.append("  (another machine: compare the ratios, not the absolute figures)")
    olds = {g["id"]: g for g in old["groups"]}
    n_better = n_worse = 0
    for g in new["groups"]:
        og = olds.get(g["id"])
        if og is None:
            lines.append(f"\n[{g['id']}] not in the old run")
            continue
        lines.append(f"\n[{g['id']}] ({g['unit']}, {g['better']} is better)")
        lines.append(f"  {'entry':<{NW}} {'old':>9} {'new':>9} {'change':>8} "
                     f"{'ratio old':>9} {'ratio new':>9}")
        oe = {e["name"]: e for e in og["entries"]}
        for e in g["entries"]:
            o = oe.get(e["name"])
            if o is None:
                lines += _named(e["name"], f"{'-':>9} {num(e['median']):>9}   (new entry)")
                continue
            ch = (e["median"] / o["median"] - 1) * 100 if o["median"] else None
            good = (e["median"] < o["min"]) if g["better"] == "lower" else (e["median"] > o["max"])
            bad = (e["median"] > o["max"]) if g["better"] == "lower" else (e["median"] < o["min"])
            verdict = "better" if good else "worse" if bad else "~"
            n_better += good
            n_worse += bad
            lines += _named(e["name"], f"{num(o['median']):>9} {num(e['median']):>9} "
                                       f"{'-' if ch is None else f'{ch:+.1f}%':>8} "
                                       f"{ratio(o.get('ratio')):>9} "
                                       f"{ratio(e.get('ratio')):>9}  {verdict}")
        gone = set(oe) - {e["name"] for e in g["entries"]}
        for name in sorted(gone):
            lines += _named(name, "(only in the old run)")
    missing = [gid for gid in olds if gid not in {g["id"] for g in new["groups"]}]
    if missing:
        lines += wrap(", ".join(missing), "\nonly in the old run: ", "  ")
    lines.append(f"\n{n_better} entries better, {n_worse} worse (outside the old run's "
                 "min-max), the rest within it")
    return "\n".join(lines)


def markdown_summary(doc):
    """A Markdown table of every group's aoprim-side entries against the baseline (for the
    README): group, entry, median, baseline median, ratio."""
    h = doc["header"]
    out = [f"Produced by `python -m aoprim bench` ({h['mode']} run) on {h['date'][:10]}: "
           f"{h['cpu_model']}, {h['cores']} cores, {h['python']}, aoprim "
           f"{h['aoprim_version']}" + (f" ({h['commit']})" if h.get("commit") else "") + ".",
           "", "| group | aoprim | median | baseline | median | ratio |",
           "|---|---|---:|---|---:|---:|"]
    for g in doc["groups"]:
        base = next((e for e in g["entries"] if e["role"] == "baseline"), None)
        if base is None or g["kind"] not in ("python", "c") or g["family"] == "aio":
            continue            # contention: the chart; servers: markdown_servers()
        for e in g["entries"]:
            if e["role"] != "candidate" or not _is_aoprim(e["name"]):
                continue
            u = g["unit"]
            # against a hardware floor the figure is the cost above it, not a ratio
            rel = (ratio(e["ratio"]) if g.get("compete", True) else
                   f"{e['median'] - base['median']:+.2f} {u} over the floor")
            out.append(f"| {g['id']} | {e['name']}{' *' if e['winner'] else ''} | "
                       f"{num(e['median'])} {u} | {base['name']} | {num(base['median'])} "
                       f"{u} | {rel} |")
    out.append("")
    out.append("`*`: the fastest entry of its group (groups also hold other baselines and "
               "peers: `python -m aoprim bench` prints them all).  Ratio: how many times "
               "faster than the baseline.")
    return "\n".join(out)


def markdown_servers(doc):
    """A Markdown table of the server groups: per scenario and server, messages/s, server
    CPU per message (user + sys), syscalls and minor page faults per message, p99, and the
    ratios to the baseline."""
    out = ["| scenario | server | msgs/s | CPU us/msg (user + sys) | syscalls/msg | faults/msg | "
           "p99 us | CPU ratio | msgs/s ratio |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    any_row = False
    for g in doc["groups"]:
        if g["kind"] != "server" or g["family"] == "aio":
            continue
        base = next((e for e in g["entries"] if e["role"] == "baseline"), None)
        bm = base["metrics"]["msgs_per_s"]["median"] if base else None
        first = True
        for e in sorted(g["entries"], key=lambda e: e["median"]):
            m = {k: v["median"] for k, v in e.get("metrics", {}).items()}
            sc = m.get("syscalls_per_msg")
            fl = m.get("faults_per_msg")
            name = f"**{e['name']}**" if e["winner"] else e["name"]
            if e["role"] == "baseline":
                name += " (baseline)"
            out.append(
                f"| {g['title'] if first else ''} | {name} | {num(m.get('msgs_per_s'))} | "
                f"{num(e['median'])} ({num(m.get('user_us_per_msg'))} + "
                f"{num(m.get('sys_us_per_msg'))}) | {'-' if sc is None else f'{sc:.2f}'} | "
                f"{'-' if fl is None else f'{fl:.2f}'} | {num(m.get('p99_us'))} | {ratio(e['ratio'])} | "
                f"{ratio(m['msgs_per_s'] / bm if bm and m.get('msgs_per_s') else None)} |")
            first = False
            any_row = True
    return "\n".join(out) if any_row else ""


def markdown(doc):
    """What the README shows: the primitives' table, then the servers' (``--markdown``)."""
    parts = [markdown_summary(doc)]
    srv = markdown_servers(doc)
    if srv:
        parts += ["", srv]
    from .aio import markdown as aio_markdown
    loops = aio_markdown(doc)
    if loops:
        parts += ["", loops]
    return "\n".join(parts)


AOPRIM_NAMES = ("AtomicInt", "RefCount", "SpinLock", "MPMCQueue", "SPSCQueue", "SlabPool",
                "BlockTable", "SendBatch", "FlushGroup", "Receiver", "aoprim")


def _is_aoprim(name):
    return any(name.startswith(n) or f" {n}" in name for n in AOPRIM_NAMES)
