"""The `kvsim` command line; building and running live elsewhere, this writes what they return.

Exports: main (app.py: run, memory); cost.py: cost, calibrate; args.py: argument parsers both use.
"""

import os

# Arrow's default allocator (mimalloc) reserves 1 GiB of address space at its first
# allocation, which a run makes as soon as a table has a string column (pandas keeps
# those in Arrow); kvsim's tables are a few megabytes. With the system allocator a run's
# address space stays near half a gigabyte, which is what counts where it is limited
# (`ulimit -v`, batch schedulers): near the limit a worker process cannot even start a
# thread. Chosen before pyarrow loads (it reads the choice once); worker processes
# inherit it; a user's own ARROW_DEFAULT_MEMORY_POOL wins.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")

from kvsim.cli.app import main  # noqa: E402  (after the allocator's choice)

__all__ = ["main"]
