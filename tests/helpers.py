"""Small helpers shared by several test modules (tests/ is on sys.path under pytest)."""
import contextlib
import signal

from kvsim.cost.model import StepBatch


@contextlib.contextmanager
def wall_limit(seconds: int):
    """Fail, rather than hang the suite, if the block runs longer (SIGALRM: main thread only)."""
    def expire(signum, frame):
        raise TimeoutError(f"did not finish within {seconds} s of wall time")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class OneSecondSteps:
    """A cost model whose every step takes one second, so every instant is predictable;
    it keeps the batches it priced."""
    label = "fixed"

    def __init__(self):
        self.batches: list[StepBatch] = []

    def price(self, batch: StepBatch) -> tuple[float, tuple[str, ...]]:
        self.batches.append(batch)
        return 1.0, ()

    def step_time(self, batch: StepBatch) -> float:
        return self.price(batch)[0]
