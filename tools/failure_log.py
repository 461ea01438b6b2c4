"""pytest plugin for device runs: every test's outcome, and each failure's traceback, written to
files the moment the test ends, so that a run cut off by a device call's time limit (when pytest
prints no summary and writes no junit.xml) still says what ran, what failed and why.

    TEST_LOG_DIR=OUT python -m pytest -p benchmarks.failure_log ...

writes OUT/outcomes.txt (one line per test phase that ran: outcome, node id, phase, seconds) and
OUT/failures.txt (each failure's node id and traceback, at most MAX_TRACEBACK characters).
Under pytest-xdist the controller writes (it receives every worker's reports through this
hook); the workers, which load the plugin too, write nothing.
"""
import os

MAX_TRACEBACK = 6000


def pytest_runtest_logreport(report):
    out = os.environ.get("TEST_LOG_DIR")
    if not out or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when == "call" or report.outcome != "passed":
        with open(os.path.join(out, "outcomes.txt"), "a") as f:
            f.write(f"{report.outcome} {report.nodeid} {report.when} {report.duration:.1f}s\n")
    if report.failed:
        with open(os.path.join(out, "failures.txt"), "a") as f:
            f.write(f"===== {report.nodeid} [{report.when}]\n")
            f.write(report.longreprtext[-MAX_TRACEBACK:] + "\n")
