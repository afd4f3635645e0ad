"""What one ``bench`` run measures, at which size, and the document it produces.

``plan(mode, only)`` picks the groups; ``run(plan, progress)`` measures them and returns the
JSON document (schema.py).  Modes:

  full   every default group; 9 interleaved rounds (5 for threaded cases); servers: every
         scenario, 3 rounds of 2 s each (5 of 1.5 s for 64 KiB and up)    (~11 minutes)
  quick  the same groups, 5 rounds (2 threaded, smaller; 3 of half the size for the
         contention curves); servers: 4 scenarios, 1 round of 1 s           (~1 minute)
  tiny   for the test suite only (``--tiny``): everything, as small as still runs end to end
         (the tls groups only when named: ``--only tls``)

The ``ft`` groups (ft.py) measure scaling at 1 and 2 threads; they run only on a
free-threaded interpreter, and elsewhere the run's skipped list says why.
The ``tls`` groups (tls.py) run the servers with TLS, with the server groups' rounds and
durations.  The ``aio`` groups (aio.py; only when named: ``--only aio``) run asyncio's loop,
uvloop, rloop and aoprim.aio side by side, with their own rounds and durations
(``aio.MODES``).
"""
import fnmatch

from . import aio, cases, contention, ft, machine, runner, servers, tls
from .schema import SCHEMA_ID

__all__ = ["MODES", "SERVER_SERIES", "plan", "run", "selectors", "UnknownSelection"]

# micro: runner.Settings; contention: its own heavy_scale; servers: rounds/duration/warm-up
MODES = {
    "full": dict(micro=dict(rounds=9, heavy_rounds=5, sample_s=0.05, scale=1.0, heavy_scale=0.2),
                 contention_scale=1.0, contention_rounds=3,
                 server=dict(rounds=3, duration=2.0, warmup=0.5,
                             scenarios=["raw-1k-10", "u16-64x16-10", "raw-1k-100",
                                        "raw-1k-1000", "raw-64-10", "raw-16k-10",
                                        "raw-64k-10", "raw-256k-10", "raw-1m-10",
                                        "u32-1m-10"],
                             # the large messages (pinned to one CPU: servers.one_cpu, why
                             # there): five shorter rounds, a steadier median for ~the time
                             per_scenario={**{sc: dict(rounds=5, duration=1.5)
                                              for sc in ("raw-64k-10", "raw-256k-10",
                                                         "raw-1m-10", "u32-1m-10")},
                                           # one wake-up per message, a Python TLS client:
                                           # rounds differ by ~10% (2026-12-05), so seven
                                           "tls-raw-1k-10": dict(rounds=7, duration=1.5)})),
    "quick": dict(micro=dict(rounds=5, heavy_rounds=2, sample_s=0.01, scale=1.0,
                             heavy_scale=0.05),
                  contention_scale=0.5, contention_rounds=3,
                  server=dict(rounds=1, duration=1.0, warmup=0.3,
                              scenarios=["raw-1k-10", "u16-64x16-10", "raw-1k-100",
                                         "raw-64k-10"])),
    "tiny": dict(micro=dict(rounds=2, heavy_rounds=1, sample_s=0.002, scale=0.05,
                            heavy_scale=0.005),
                 contention_scale=0.01, contention_rounds=1,
                 server=dict(rounds=1, duration=0.3, warmup=0.1, scenarios=["raw-1k-10"])),
}

# the server curves: series -> (the parameter that varies, scenarios in order)
SERVER_SERIES = {
    "server-conns": ("conns", ["raw-1k-10", "raw-1k-100", "raw-1k-1000"]),
    "server-sizes": ("size", ["raw-64-10", "raw-1k-10", "raw-16k-10", "raw-64k-10",
                              "raw-256k-10", "raw-1m-10"]),
}
SERVER_TITLES = {
    "raw": "raw ping-pong echo, {size} B, {conns} connections",
    "u16": "u16-framed {size} B messages pipelined {pipeline} deep, {conns} connections "
           "(one reply per frame)",
    "u32": "u32-framed {size} B messages, ping-pong, {conns} connections (max_frame "
           "{max_frame})",
}
WARMUP_TEXT = ("every server, baseline or not, is measured warm: before the load starts one "
               "connection exchanges 8 messages of the scenario and closes (a fresh asyncio "
               "process serves its 256 KiB recv with mmap/munmap per read until then)")


class UnknownSelection(ValueError):
    pass


class ServerGroup:
    """A server scenario as a group (it has no Cases: servers.run_one measures it)."""
    kind = "server"
    family = "server"
    compete = True
    default = True
    unit = "CPU us/msg"

    def __init__(self, scenario):
        sc = servers.SCENARIOS[scenario]
        self.scenario = scenario
        self.id = f"server-{scenario}"
        self.title = SERVER_TITLES[sc["framing"]].format(**sc)
        if sc.get("one_cpu"):
            self.title += "; server and load generator on one CPU"
        self.params = dict(sc)
        self.series = [s for s, (_, scs) in SERVER_SERIES.items() if scenario in scs]
        if sc["pipeline"] > 1:
            self.series.append("server-pipelined")


class TLSGroup:
    """A TLS scenario (tls.SCENARIOS) as a server group, measured by tls.run_one."""
    kind = "server"
    family = "tls"
    compete = True

    def __init__(self, scenario, default=True):
        sc = tls.SCENARIOS[scenario]
        self.scenario = scenario
        self.id = scenario
        self.title = tls.TITLES[scenario]
        self.params = dict(sc)
        self.series = []
        self.default = default
        self.unit = "CPU us/handshake" if sc["mode"] == "handshake" else "CPU us/msg"
        self.run_one = tls.run_one


def _all_groups(mode):
    return (list(cases.GROUPS) + contention.groups() +
            [ServerGroup(s) for s in MODES[mode]["server"]["scenarios"]] +
            [TLSGroup(s, default=(mode != "tiny")) for s in tls.SCENARIOS] +
            aio.groups(mode) + ft.groups(mode))


def selectors():
    """The names --only accepts besides group ids: families and kinds."""
    gs = _all_groups("full")
    return sorted({g.family for g in gs} | {"python", "c", "contention", "server"})


def _selected(g, names):
    for name in names:
        if name == g.id or fnmatch.fnmatchcase(g.id, name) or name == g.family:
            return True
        if g.default and (name == g.kind or (len(name) > 2 and g.id.startswith(name))):
            return True
    return False


def plan(mode="full", only=None):
    """The groups to run, in order.  ``only``: names (a family such as ``atomic`` or
    ``server``, a kind -- ``python``, ``c``, ``contention``, ``server`` --, a group id, a
    glob over group ids, or a prefix of one); non-default groups run only when named by
    their id or family."""
    gs = _all_groups(mode)
    if not only:
        return [g for g in gs if g.default]
    picked = [g for g in gs if _selected(g, only)]
    unknown = [n for n in only if not any(_selected(g, [n]) for g in gs)]
    if unknown:
        raise UnknownSelection(
            f"--only {' '.join(unknown)}: matches no group; use a family or kind "
            f"({', '.join(selectors())}), a group id or a glob (see --list)")
    return picked


def _contention_settings(m):
    return runner.Settings(rounds=1, heavy_rounds=m["contention_rounds"], sample_s=0.0,
                           scale=m["contention_scale"], heavy_scale=m["contention_scale"])


def steps(groups, mode, n_servers, n_loops=len(aio.LOOPS)):
    m = MODES[mode]
    micro = runner.Settings(**m["micro"])
    cont = _contention_settings(m)
    total = 0
    for g in groups:
        if g.family == "ft" and not ft.available():
            continue
        if hasattr(g, "measure"):
            total += g.steps(n_loops)
        elif g.kind == "server":
            total += _server_settings(m, g.scenario)["rounds"] * n_servers
        else:
            total += runner.plan_steps(g, cont if g.kind == "contention" else micro)
    return total


def _server_settings(m, scenario):
    """The mode's server rounds/duration/warm-up, with the scenario's own where it has them."""
    s = dict(m["server"])
    s.update(s.pop("per_scenario", {}).get(scenario, {}))
    return s


def _server_group(g, names, m, progress, skipped_servers, count_syscalls):
    """Measure one server scenario: rounds interleaved, server order rotating."""
    s = _server_settings(m, g.scenario)
    runs = {n: [] for n in names}
    skipped = []
    for r in range(s["rounds"]):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if name in skipped_servers:
                if progress:
                    progress.step(1)
                continue
            if progress:
                progress.step(0, f"{g.id}: {name} (round {r + 1}/{s['rounds']})")
            try:
                run_one = getattr(g, "run_one", servers.run_one)
                res = run_one(name, g.scenario, s["duration"], warmup=s["warmup"],
                              syscalls=count_syscalls and r == 0)
            except servers.ServerUnavailable as e:
                skipped_servers[name] = str(e)
                res = None
            except Exception as e:        # a failed run is reported, the others go on
                res = {"errors": [f"{type(e).__name__}: {e}"]}
            if progress:
                progress.step(1)
            if res is None:
                if progress:
                    progress.note(f"  {g.id}: {name} skipped: {skipped_servers[name]}")
                continue
            cpu = res.get("server_cpu") or {}
            if res.get("errors") or "cpu_us_per_msg" not in cpu:
                why = "; ".join(res.get("errors", [])[:2]) or "no message completed"
                skipped.append({"name": name, "reason": f"round {r + 1}: {why}"})
                if progress:
                    progress.note(f"  {g.id}: {name} round {r + 1} failed: {why}")
                continue
            runs[name].append(res)
            if progress:
                progress.note(f"  {g.id}: {name} (round {r + 1}/{s['rounds']}): "
                              f"{cpu['cpu_us_per_msg']:.2f} {g.unit}, "
                              f"{res.get('msgs_per_s', 0):,.0f} msgs/s")
    entries = []
    for name in names:
        rs = runs[name]
        if not rs:
            if name in skipped_servers and not any(x["name"] == name for x in skipped):
                skipped.append({"name": name, "reason": skipped_servers[name]})
            continue
        cpu = [x["server_cpu"]["cpu_us_per_msg"] for x in rs]
        e = {"name": name, "role": "baseline" if name == "asyncio" else "candidate",
             "samples": [round(c, 4) for c in cpu], "rounds": len(rs)}
        e.update(runner.summarize(cpu))
        metrics = {}
        for key, get in (("msgs_per_s", lambda x: x["msgs_per_s"]),
                         ("p50_us", lambda x: x["p50_us"]),
                         ("p99_us", lambda x: x["p99_us"]),
                         ("user_us_per_msg", lambda x: x["server_cpu"]["user_us_per_msg"]),
                         ("sys_us_per_msg", lambda x: x["server_cpu"]["sys_us_per_msg"]),
                         ("syscalls_per_msg", lambda x: x.get("syscalls_per_msg")),
                         ("faults_per_msg", lambda x: x.get("faults_per_msg")),
                         ("send_syscalls_per_msg", lambda x: x.get("send_syscalls_per_msg")),
                         ("records_per_msg", lambda x: x.get("records_per_msg")),
                         ("wire_bytes_per_msg", lambda x: x.get("wire_bytes_per_msg"))):
            vals = [v for v in map(get, rs) if v is not None]
            if vals:
                metrics[key] = runner.summarize(vals)
        e["metrics"] = metrics
        entries.append(e)
    return runner.finish_group(g, entries, skipped)


def run(groups, mode="full", progress=None, only=None, on_header=None, on_group=None):
    """Measure ``groups`` (from plan()); returns the document (schema.py).

    ``on_header(header)`` is called once the header is known, before anything is measured,
    and ``on_group(result)`` as each group ends: the command prints each as it comes, so a
    user sees the run working.  The header's ``duration_s``, ``load_average_end``,
    ``own_cpus``, ``other_cpus`` and ``warnings`` are final only in the returned document."""
    m = MODES[mode]
    micro = runner.Settings(**m["micro"])
    cont = _contention_settings(m)
    start = machine.cpu_sample()
    samples = [start]             # one per group end: the load-average fallback's window
    header = machine.describe()
    doc_skipped = []
    server_names, server_skips = servers.available_servers()
    have_servers = any(g.kind == "server" and not hasattr(g, "measure") for g in groups)
    loops, loop_skips = aio.available_loops() if any(g.family == "aio" for g in groups) \
        else ([], [])
    method, why_not = servers.syscall_method() if have_servers else (None, "no server group ran")
    if have_servers:
        doc_skipped += [{"what": f"server {n}", "reason": r} for n, r in server_skips]
        if why_not:
            doc_skipped.append({"what": "syscalls per message", "reason": why_not})
    if any(g.kind == "c" for g in groups):
        doc_skipped += [{"what": f"C level: {fam}", "reason": r}
                        for fam, r in cases.C_SKIPPED.items()]
    if any(g.family == "ft" for g in groups) and not ft.available():
        # the scaling groups mean something only without the GIL (ft.py): one line says so
        doc_skipped.append({"what": "ft (free-threaded scaling) groups",
                            "reason": ft.skip_reason()})
        groups = [g for g in groups if g.family != "ft"]
    _, warnings = machine.load_check(header["cores"], start)
    header.update({
        "mode": mode,
        "settings": {"micro": m["micro"], "contention_scale": m["contention_scale"],
                     "contention_rounds": m["contention_rounds"], "server": m["server"]},
        "server_warmup": WARMUP_TEXT,
        "syscalls": method or f"not measured: {why_not}",
        "servers": (server_names if have_servers else []) + [f"loop {lp}" for lp in loops],
        "selected": list(only or []),
        "load_average": start["load"],
        "warnings": warnings,
    })
    if on_header:
        on_header(header)
    if progress:
        progress.total = max(1, steps(groups, mode, len(server_names), len(loops)))
    out = []
    skipped_servers = {}          # family -> {server: why it cannot run}
    for g in groups:
        if hasattr(g, "measure"):             # the aio loops' server groups (aio.py)
            res = g.measure(loops, loop_skips, progress)
        elif g.kind == "server":
            res = _server_group(g, server_names, m, progress,
                                skipped_servers.setdefault(g.family, {}), method is not None)
        else:
            res = runner.measure_group(g, cont if g.kind == "contention" else micro, progress)
            # runner's groups carry series as one name or None; the document has a list
            res["series"] = [res["series"]] if isinstance(res["series"], str) else []
        out.append(res)
        samples.append(machine.cpu_sample())
        if on_group:
            on_group(res)
    end = samples[-1] if len(samples) > 1 else machine.cpu_sample()
    recent = next((x for x in reversed(samples) if end["t"] - x["t"] >= 60), start)
    facts, warnings = machine.load_check(header["cores"], start, end, recent)
    header.update(facts)
    header["warnings"] = warnings
    header["duration_s"] = round(end["t"] - start["t"], 1)
    return {"schema": SCHEMA_ID, "header": header, "groups": out, "skipped": doc_skipped}
