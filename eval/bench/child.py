"""``python -m eval.bench.child <rss file> <module> [args...]``: run a module as ``__main__`` and write its peak RSS.

The benchmark runs each index build through this so that its peak resident memory is measured alone.
"""
import resource
import runpy
import sys


def main() -> None:
    rss_file, module = sys.argv[1], sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
    with open(rss_file, "w", encoding="utf-8") as out:
        out.write(str(peak_rss_bytes()))


def peak_rss_bytes() -> int:
    """This process's peak resident memory in bytes: Linux's VmHWM of its own address space (ru_maxrss also counts
    the memory of the parent it was forked from, which an exec keeps in the figure), else ru_maxrss (KiB on
    Linux)."""
    from eval.bench_scale.measure import status_bytes  # after the module ran: its imports are not in the peak

    peak = status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    main()
