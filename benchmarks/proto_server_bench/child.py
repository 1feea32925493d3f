"""The benchmark's server process: `python -m proto_server_bench.child FD` (see measure.py).

A module of its own, which nothing imports, so running it is never running a module twice.
"""

import sys

from proto_server_bench.measure import child_main

if __name__ == "__main__":
    child_main(int(sys.argv[1]))
