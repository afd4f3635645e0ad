"""Tables for the terminal, and ``--compare``.

Every group prints one table: each entry's median, its spread (min-max over the rounds), and
its ratio to the group's baseline -- ``x2.50`` is 2.5 times better than the baseline (faster
for ns/op, less CPU per message for servers); ``*`` marks the group's winner (the best median
among the entries that compete; references such as the empty loop or a hardware floor never
win).
"""
__all__ = ["render", "render_header", "render_group", "compare", "markdown_summary",
           "markdown_servers", "markdown"]


def _num(x, unit=""):
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


def _ratio(r):
    return "-" if r is None else f"x{r:.2f}"


def _mmss(s):
    s = int(s)
    return f"{s // 60}:{s % 60:02d}"


def render_header(doc):
    h = doc["header"]
    c = h.get("compiler", {})
    comp = c.get("error") or (
        f"{c.get('cc', 'cc')} {c.get('compiler', '?')}, "
        f"{'optimized' if c.get('optimized') else 'NOT optimized'}"
        f"{', AddressSanitizer' if c.get('asan') else ''}; Python's CFLAGS: "
        f"{c.get('python_cflags', '')}")
    la = h.get("load_average")
    lines = [
        f"aoprim bench ({h['mode']}) -- {h['date']}, took {_mmss(h['duration_s'])}",
        f"machine:   {h['cpu_model']}, {h['cores']} cores"
        + (f", load average {la[0]:.2f} at the start" if la else "")
        + (f", Linux {h['kernel']}" if h.get("kernel") else ""),
        f"python:    {h['python']}",
        f"aoprim:    {h['aoprim_version']}"
        + (f" (commit {h['commit']})" if h.get("commit") else "")
        + (f" from {h['aoprim_path']}" if h.get("aoprim_path") else ""),
        f"compiler:  {comp}",
    ]
    if h.get("servers"):
        lines.append(f"servers:   {', '.join(h['servers'])}; {h['server_warmup']}")
        lines.append(f"syscalls:  {h['syscalls']}")
    lines.append("figures:   median over the rounds, spread = min-max; ratio = how many times "
                 "better than the group's baseline; * = winner")
    return "\n".join(lines)


def render_group(g):
    if g["family"] == "aio":
        from .aio import render_group as aio_group
        return aio_group(g)
    lines = [f"\n[{g['id']}] {g['title']}  ({g['unit']}, {g['better']} is better)"]
    kind = g["kind"]
    ents = sorted(g["entries"], key=lambda e: e["median"], reverse=(g["better"] == "higher"))
    w = max([len(e["name"]) for e in ents] + [len("entry")]) + 11
    if kind == "server":
        uw = max(10, len(g["unit"]))
        # the tls groups also carry TLS records and wire bytes (server to client) per message
        tls = any("records_per_msg" in e.get("metrics", {}) for e in ents)
        lines.append(f"  {'server':<{w}} {g['unit']:>{uw}} {'spread':>13} {'ratio':>7} "
                     f"{'msgs/s':>8} {'ratio':>7} {'p50 us':>7} {'p99 us':>7} "
                     f"{'syscalls/msg':>12} {'faults/msg':>10} {'user':>6} {'sys':>6}"
                     + (f" {'records/msg':>11} {'wire B/msg':>10}" if tls else ""))
        base = next((e for e in g["entries"] if e["role"] == "baseline"), None)
        bm = base["metrics"].get("msgs_per_s", {}).get("median") if base else None
        for e in ents:
            m = e.get("metrics", {})

            def med(k):
                return m.get(k, {}).get("median")
            mr = (med("msgs_per_s") / bm) if bm and med("msgs_per_s") else None
            name = ("* " if e["winner"] else "  ") + e["name"] + \
                ("  (baseline)" if e["role"] == "baseline" else "")
            sc = med("syscalls_per_msg")
            fl = med("faults_per_msg")
            rpm = med("records_per_msg")
            lines.append(
                f"{name:<{w + 2}} {_num(e['median']):>{uw}} "
                f"{_num(e['min']) + '-' + _num(e['max']):>13} {_ratio(e['ratio']):>7} "
                f"{_num(med('msgs_per_s')):>8} {_ratio(mr):>7} {_num(med('p50_us')):>7} "
                f"{_num(med('p99_us')):>7} {'-' if sc is None else f'{sc:.3f}':>12} "
                f"{'-' if fl is None else f'{fl:.2f}':>10} "
                f"{_num(med('user_us_per_msg')):>6} {_num(med('sys_us_per_msg')):>6}"
                + (f" {'-' if rpm is None else f'{rpm:.3f}':>11} "
                   f"{_num(med('wire_bytes_per_msg')):>10}" if tls else ""))
    else:
        extra = kind == "contention"
        lines.append(f"  {'entry':<{w}} {'median':>9} {'spread (min-max)':>19} {'ratio':>8}"
                     + (f" {'Mops/s':>8} {'CPU/wall':>8}" if extra else ""))
        for e in ents:
            name = ("* " if e["winner"] else "  ") + e["name"] + \
                {"baseline": "  (baseline)", "reference": "  (ref)"}.get(e["role"], "")
            line = (f"{name:<{w + 2}} {_num(e['median']):>9} "
                    f"{_num(e['min']) + ' - ' + _num(e['max']):>19} {_ratio(e['ratio']):>8}")
            if extra:
                cw = e.get("metrics", {}).get("cpu_per_wall", {}).get("median")
                line += f" {1e3 / e['median']:>8.2f} {'-' if cw is None else f'{cw:.2f}':>8}"
            lines.append(line)
    for s in g["skipped"]:
        lines.append(f"  (skipped {s['name']}: {s['reason']})")
    return "\n".join(lines)


def render(doc):
    parts = [render_header(doc)]
    for g in doc["groups"]:
        parts.append(render_group(g))
    if doc["skipped"]:
        parts.append("\nskipped:")
        for s in doc["skipped"]:
            parts.append(f"  {s['what']}: {s['reason']}")
    return "\n".join(parts)


def compare(old, new):
    """The change from ``old`` to ``new`` (two documents), group by group, entry by entry:
    medians, the change in percent, and the ratio to the baseline then and now.  ``better``
    / ``worse`` only when the new median lies outside the old run's min-max range (and the
    change is in that direction); ``~`` otherwise."""
    oh, nh = old["header"], new["header"]
    lines = [f"\ncompared with {oh['date']} ({oh['cpu_model']}, {oh['cores']} cores, "
             f"{oh['python']}, aoprim {oh['aoprim_version']}"
             + (f" {oh['commit']}" if oh.get("commit") else "") + f", {oh['mode']})"]
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
        lines.append(f"  {'entry':<46} {'old':>9} {'new':>9} {'change':>8} "
                     f"{'ratio old':>9} {'ratio new':>9}")
        oe = {e["name"]: e for e in og["entries"]}
        for e in g["entries"]:
            o = oe.get(e["name"])
            if o is None:
                lines.append(f"  {e['name']:<46} {'-':>9} {_num(e['median']):>9}   (new entry)")
                continue
            ch = (e["median"] / o["median"] - 1) * 100 if o["median"] else None
            good = (e["median"] < o["min"]) if g["better"] == "lower" else (e["median"] > o["max"])
            bad = (e["median"] > o["max"]) if g["better"] == "lower" else (e["median"] < o["min"])
            verdict = "better" if good else "worse" if bad else "~"
            n_better += good
            n_worse += bad
            lines.append(f"  {e['name']:<46} {_num(o['median']):>9} {_num(e['median']):>9} "
                         f"{'-' if ch is None else f'{ch:+.1f}%':>8} "
                         f"{_ratio(o.get('ratio')):>9} {_ratio(e.get('ratio')):>9}  {verdict}")
        gone = set(oe) - {e["name"] for e in g["entries"]}
        for name in sorted(gone):
            lines.append(f"  {name:<46} (only in the old run)")
    missing = [gid for gid in olds if gid not in {g["id"] for g in new["groups"]}]
    if missing:
        lines.append(f"\nonly in the old run: {', '.join(missing)}")
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
            rel = (_ratio(e["ratio"]) if g.get("compete", True) else
                   f"{e['median'] - base['median']:+.2f} {u} over the floor")
            out.append(f"| {g['id']} | {e['name']}{' *' if e['winner'] else ''} | "
                       f"{_num(e['median'])} {u} | {base['name']} | {_num(base['median'])} "
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
                f"| {g['title'] if first else ''} | {name} | {_num(m.get('msgs_per_s'))} | "
                f"{_num(e['median'])} ({_num(m.get('user_us_per_msg'))} + "
                f"{_num(m.get('sys_us_per_msg'))}) | {'-' if sc is None else f'{sc:.2f}'} | "
                f"{'-' if fl is None else f'{fl:.2f}'} | {_num(m.get('p99_us'))} | {_ratio(e['ratio'])} | "
                f"{_ratio(m['msgs_per_s'] / bm if bm and m.get('msgs_per_s') else None)} |")
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
