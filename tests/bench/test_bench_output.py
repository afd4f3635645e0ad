"""What ``python -m aoprim bench`` prints, read as a user reads it: every line within 100
columns, a spread only where there was more than one round, every group's ratio taken against
what a user would otherwise use (named in the heading; a hardware floor is shown, never a
ratio baseline), a note beside the contention rows, a warning when other programs load the
machine, and each table (and each server run's figure) printed as soon as it is measured.

In-process and small: the micro groups at the test-only ``tiny`` size, the server groups with
a stand-in for the server run (servers.run_one is tested in test_bench_cmd.py).
"""
import io
import re
import sys

import pytest

from aoprim.benchmarks import cases, cli, contention, machine, report, runner, schema, suite

WIDTH = 100


def fake_run_one(cpu_by_server, tls=False, calls=None):
    """A stand-in for servers.run_one: each server's CPU us/msg per round, from a list."""
    def run_one(name, scenario, duration, warmup, syscalls):
        if calls is not None:
            calls.append(name)
        cpu = cpu_by_server[name].pop(0)
        res = {"server_cpu": {"cpu_us_per_msg": cpu, "user_us_per_msg": cpu / 3,
                              "sys_us_per_msg": cpu * 2 / 3},
               "msgs_per_s": 1e6 / cpu, "p50_us": 70.0, "p99_us": 190.0,
               "syscalls_per_msg": 2.5, "faults_per_msg": 0.0}
        if tls:
            res.update(records_per_msg=1.0, wire_bytes_per_msg=1046.0)
        return res
    return run_one


def server_result(rounds, tls=False, progress=None, calls=None):
    """One server group's result, measured with fake_run_one over ``rounds`` rounds."""
    if tls:
        g = suite.TLSGroup("tls-handshake")         # the widest unit: CPU us/handshake
    else:
        g = suite.ServerGroup("raw-1k-10")
    names = ["asyncio", "aoprim-epoll", "aoprim.aio"]
    cpu = {"asyncio": [11.0, 11.5, 10.5][:rounds], "aoprim-epoll": [4.0, 4.2, 3.9][:rounds],
           "aoprim.aio": [10.8, 11.2, 10.9][:rounds]}
    g.run_one = fake_run_one(cpu, tls, calls)
    mode = dict(suite.MODES["quick"], server=dict(suite.MODES["quick"]["server"],
                                                  rounds=rounds))
    return suite._server_group(g, names, mode, progress, {}, True)


@pytest.fixture(scope="module")
def doc():
    """A document of micro, C-level and contention groups (tiny) and fake server groups."""
    groups = suite.plan("tiny", ["atomic-increment", "c", "contention-lock-1t",
                                 "contention-queue-2t", "queue-spsc-1p1c"])
    d = suite.run(groups, "tiny")
    d["groups"] += [server_result(1), server_result(3), server_result(1, tls=True)]
    return d


def test_every_line_of_the_report_and_the_comparison_fits_100_columns(doc):
    assert schema.validate(doc) == []
    for text in (report.render(doc), report.compare(doc, doc)):
        long = [line for line in text.splitlines() if len(line) > WIDTH]
        assert not long, "\n".join(long)


def test_a_spread_is_printed_only_when_there_was_more_than_one_round(doc):
    one, three = doc["groups"][-3], doc["groups"][-2]
    assert {e["rounds"] for e in one["entries"]} == {1}
    text = report.render_group(one)
    # no "a-a" / "a - a" range made of one figure
    assert not re.search(r"(?<![\w.])(\d[\d.]*[kM]?) ?- ?\1(?![\w.])", text), text
    row = next(line for line in text.splitlines() if line.startswith("  asyncio  (baseline)"))
    assert row.split()[2:4] == ["11.0", "x1.00"], row        # the figure, then the ratio
    # three rounds: the min-max range is there
    assert "10.5-11.5" in report.render_group(three)


def test_every_group_is_compared_with_what_a_user_would_otherwise_use():
    for g in cases.GROUPS + contention.groups():
        base = g.baseline
        assert base is not None, g.id
        assert "floor" not in base.name and "bare" not in base.name, (g.id, base.name)
        for c in g.cases:
            if "floor" in c.name or c.name.startswith("bare "):
                assert c.role == "reference", (g.id, c.name)
    c_baselines = {g.id: g.baseline.name for g in cases.GROUPS if g.kind == "c"}
    assert c_baselines == {
        "c-atomic": "int64 + pthread_mutex", "c-refcount": "int64 + pthread_mutex +1/-1",
        "c-lock": "pthread_mutex lock + unlock", "c-queue": "ring + pthread_mutex: push + pop",
        "c-slab": "malloc(4096) + free", "c-sendbatch": "write() per message"}


def test_each_heading_names_its_baseline_and_a_floor_row_carries_no_ratio(doc):
    floors = 0
    for g in doc["groups"]:
        text = report.render_group(g)
        unit_line = next(line for line in text.splitlines() if " is better" in line)
        assert unit_line.endswith(f"; ratio = vs {g['baseline']}"), text
        for e in g["entries"]:
            if e["role"] != "reference":
                continue
            floors += "(floor)" in e["name"]
            row = next(line for line in text.splitlines() if line.startswith("  " + e["name"]))
            assert not re.search(r"\bx\d", row), row          # no ratio on a reference row
    assert floors >= 5                                        # c-atomic ... c-slab
    c_lock = next(g for g in doc["groups"] if g["id"] == "c-lock")
    spin = next(e for e in c_lock["entries"] if e["name"].startswith("SpinLock"))
    assert spin["ratio"] == pytest.approx(
        next(e for e in c_lock["entries"] if e["role"] == "baseline")["median"]
        / spin["median"])


def test_the_contention_rows_say_what_they_measure_beside_the_headline(doc):
    text = report.render(doc)
    lock = text.split("[contention-lock-1t]", 1)[1].split("\n[", 1)[0]
    assert "note:" in lock and "lock-acquire-release" in lock and "GIL" in lock
    q = text.split("[contention-queue-2t]", 1)[1].split("\n[", 1)[0]
    assert "note:" in q and "queue-2p2c" in q and "queue-1thread" in q


def test_a_ratio_within_the_noise_is_marked(doc):
    three = doc["groups"][-2]            # aoprim.aio 10.8-11.2 overlaps asyncio 10.5-11.5
    rows = {line[2:].split()[0]: line for line in
            report.render_group(three).splitlines()[4:7]}
    assert re.search(r"x1\.\d\d~", rows["aoprim.aio"]), rows
    assert "~" not in rows["aoprim-epoll"]                    # 3.9-4.2: clearly apart


def sample(t, load, own, busy):
    return {"t": t, "load": [load, load, load], "own": own, "busy": busy}


def test_load_check_warns_at_a_high_start_or_busy_others_and_not_on_a_quiet_machine():
    quiet0, quiet1 = sample(0, 0.1, 0.0, 0.0), sample(60, 1.9, 90.0, 95.0)
    facts, warnings = machine.load_check(2, quiet0, quiet1)
    assert warnings == [] and facts["own_cpus"] == 1.5 and facts["other_cpus"] == 0.1
    # busy at the start: the load average against the cores
    _, warnings = machine.load_check(2, sample(0, 3.0, 0.0, 0.0), quiet1)
    assert len(warnings) == 1 and "3.00 at the start, on 2 cores" in warnings[0]
    # others kept the CPUs busy during the run (/proc/stat's busy time less the bench's own)
    _, warnings = machine.load_check(2, quiet0, sample(60, 2.0, 60.0, 110.0))
    assert len(warnings) == 1 and "0.8 of the 2 cores" in warnings[0]
    # no /proc/stat: the load average at the end less what the bench kept busy recently
    nob = [dict(s, busy=None)
           for s in (quiet0, sample(30, 1.0, 20.0, 0), sample(90, 3.5, 140.0, 0))]
    _, warnings = machine.load_check(2, nob[0], nob[2], recent=nob[1])
    assert len(warnings) == 1 and "3.50 at the end" in warnings[0]
    nob[2]["load"] = [2.5] * 3                               # 2.5 - 2.0 busy: quiet enough
    assert machine.load_check(2, nob[0], nob[2], recent=nob[1])[1] == []


def run_cli(args, monkeypatch):
    """cli.main in this process; returns what it printed to stdout."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main(cli.build_parser().parse_args(args)) == 0
    return out.getvalue()


def test_the_command_prints_a_warning_when_the_load_average_is_high(monkeypatch):
    cores = machine._cores()
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (4.0 * cores, 1.0, 1.0))
    text = run_cli(["--tiny", "--no-progress", "--only", "atomic-read"], monkeypatch)
    warn = [line for line in text.splitlines() if line.startswith("WARNING:")]
    assert warn and f"{4.0 * cores:.2f} at the start" in warn[0], text
    assert text.index("WARNING:") < text.index("[atomic-read]")     # before any table
    monkeypatch.setattr(machine.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(machine, "_busy_seconds", lambda: None)     # the fallback: load only
    text = run_cli(["--tiny", "--no-progress", "--only", "atomic-read"], monkeypatch)
    assert "WARNING" not in text, text


def test_each_table_is_printed_as_its_group_ends(monkeypatch):
    """The refcount group's setup sees the atomic-read table already printed and flushed."""
    seen = []
    case = cases.by_id("refcount").cases[0]
    real = case.setup

    def setup(n):
        seen.append(sys.stdout.getvalue())
        return real(n)
    monkeypatch.setattr(case, "setup", setup)
    text = run_cli(["--tiny", "--no-progress", "--only", "atomic-read", "refcount"], monkeypatch)
    assert seen and "[atomic-read]" in seen[0] and "AtomicInt.load" in seen[0]
    assert "[refcount]" not in seen[0]
    assert "[refcount]" in text and text.rstrip().endswith(text.rstrip().splitlines()[-1])


def test_each_server_run_reports_its_figure_as_it_ends():
    stream = io.StringIO()
    prog = runner.Progress(1, stream=stream)
    assert not prog.tty
    snapshots = []
    calls = []

    class Recording(list):
        def append(self, name):
            snapshots.append(stream.getvalue())
            super().append(name)
    server_result(1, progress=prog, calls=Recording())
    assert len(snapshots) == 3
    # before the second server starts, the first one's figure is out
    assert re.search(r"asyncio \(round 1/1\): 11\.00 CPU us/msg", snapshots[1]), snapshots[1]
    assert "aoprim-epoll (round 1/1): 4.00 CPU us/msg" in stream.getvalue()
    del calls


def test_the_progress_bar_on_a_terminal_gets_out_of_the_way_of_the_tables():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    err = Tty()
    prog = runner.Progress(10, stream=err)
    prog.step(3, "atomic-read: AtomicInt.load")
    printed = []
    prog.above(lambda: printed.append(err.getvalue()))
    # the bar's line was blanked before the table printed, and drawn again after
    assert printed[0].endswith("\r" + " " * (WIDTH - 1) + "\r")
    assert err.getvalue().rstrip().endswith("atomic-read: AtomicInt.load")
    prog.note("  server-raw-1k-10: asyncio (round 1/1): 11.00 CPU us/msg")
    assert "\r  server-raw-1k-10: asyncio (round 1/1): 11.00 CPU us/msg\n\r[" in err.getvalue()
    assert all(len(part) <= WIDTH for part in re.split(r"[\r\n]", err.getvalue()))


def test_the_c_baselines_move_every_word_and_every_block():
    from aoprim.benchmarks import _benchcore
    n = 5000
    assert _benchcore.mutex_ring_loop(n) == n * (n - 1) // 2     # every word pushed is popped
    assert _benchcore.malloc_loop(100, 4096) is None
    for fn in ("mutex_add_loop", "mutex_incdec_loop", "mutex_lock_loop"):
        assert getattr(_benchcore, fn)(100) is None
