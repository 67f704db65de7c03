"""Small helpers shared by several test modules (tests/ is on sys.path under pytest)."""
import contextlib
import signal


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
