"""What every benchmark shares: failures collected as they happen, and one
exit code at the end (0: everything ran, a missed target is a figure; 1:
something broke). Imported by bench/*.py, which run as scripts, so this
folder is on sys.path."""

import os
import sys
import traceback

FAILURES = []


def fail(message):
    """Something broke (not a missed target): printed now, exit code 1 at the end."""
    FAILURES.append(message)
    print(f"    FAILED: {message}", flush=True)


def run(main, argv=None):
    """main(argv); exit code 1 if it raised or anything in it failed."""
    try:
        main(argv)
    except Exception:  # noqa: BLE001 - printed, then the exit code says it
        sys.stdout.flush()
        traceback.print_exc()
        print("benchmark aborted by the error above", flush=True)
        FAILURES.append("aborted by an exception")
    if FAILURES:
        print(f"\nFAILED ({len(FAILURES)}): " + "; ".join(FAILURES), flush=True)
        return 1
    return 0


def cached(program):
    """The command that runs `program` (a vesti.py) as `python vesti.py`
    does (the same argv[0] and sys.path[0]) but from its cached bytecode:
    Python compiles a script afresh each time it runs one. For benchmarks
    whose figures are not a command's start-up."""
    return [sys.executable, "-c", "import os, runpy, sys; sys.argv.pop(0); "
            "sys.path[0] = os.path.dirname(sys.argv[0]); "
            "runpy.run_module(os.path.basename(sys.argv[0])[:-3], run_name='__main__', "
            "alter_sys=True)", os.path.abspath(program)]
