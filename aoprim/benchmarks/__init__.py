"""``python -m aoprim bench``: every primitive and the server beside their baselines, in one
run, on this machine.

    cases.py       the measured bodies: groups of cases (aoprim and its baselines), the one
                   copy shared with the pytest-benchmark suites in the checkout's bench/
    contention.py  the lock and the queues at 1, 2, 4, 8 threads
    runner.py      the in-process harness: warm-up, interleaved rounds, median, spread, ratio;
                   the progress bar
    servers.py     the server groups: aoprim's server, asyncio, uvloop (and aoprim.aio, other
                   Layer 1 backends when present) under the project's load generator
    tls.py         the tls groups: the same servers speaking TLS, under a TLS client that
                   counts records and bytes on the wire (also the client, run by path)
    echo_asyncio.py / echo_floor.py   the baseline servers those groups start
    machine.py     the header: CPU, cores, Python, aoprim version, compiler
    report.py      tables, --compare
    plot.py        --plot (matplotlib, the optional ``plot`` extra)
    schema.py      the JSON document's schema and its validator
    cli.py         the ``bench`` subcommand (hooked into aoprim.server.cli)

The method and the JSON schema are documented in the checkout's bench/README.md.
"""
