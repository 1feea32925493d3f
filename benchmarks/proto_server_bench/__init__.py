"""Benchmarks, measured (modelled GPU time is always labelled so). The transport benchmark:
`proto-server bench`, or from Python (the server runs in a child
process; the client runs in the caller's trio loop):

    import trio
    from proto_server_bench import BenchSettings, render, run_bench, write_all

    run = trio.run(run_bench, BenchSettings(repeats=1), print)
    summary, json_path, plots = write_all(run)
    print(render(summary))
"""

from proto_server_bench.report import render, summarize, write_all
from proto_server_bench.runner import BenchRun, BenchSettings, run_bench

__all__ = ["BenchRun", "BenchSettings", "render", "run_bench", "summarize", "write_all"]
