"""triptych.startup: phases in seconds since the process started, each at its first mark, in order."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from triptych import startup
from triptych.startup import REEXEC_ENV, StartupClock


def test_the_clock_counts_from_the_process_start_not_from_its_import() -> None:
    # A child that sleeps before importing the module: its first reading includes the sleep.
    code = "import time; time.sleep(0.5); from triptych import startup; print(startup.since_process_start())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert 0.5 <= float(out.stdout) < 60


def test_the_first_mark_of_a_phase_counts_and_phases_come_in_pipeline_order() -> None:
    clock = StartupClock()
    clock.mark("loaded")
    first = clock.phases()["loaded"]
    clock.mark("started")
    clock.mark("loaded")
    assert list(clock.phases()) == ["started", "loaded"]
    assert clock.phases()["loaded"] == first


def test_an_unknown_phase_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown start-up phase 'warm'"):
        StartupClock().mark("warm")


def test_the_reexecuted_image_takes_over_the_first_images_time_and_hides_it_from_children(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(REEXEC_ENV, "0.250")
    clock = StartupClock()
    assert clock.phases() == {"reexec": 0.25}
    assert REEXEC_ENV not in os.environ  # the ranks a worker starts are processes of their own


def test_the_logged_line_parses_back_to_the_phases() -> None:
    clock = StartupClock()
    for phase in ("started", "imported", "listening"):
        clock.mark(phase)
    log = f"2026-12-03 INFO [encoder] triptych.startup: {clock.line()}\nanother line"
    assert startup.parse_line(log) == pytest.approx(clock.phases(), abs=1e-3)
    assert startup.parse_line("no start-up here") is None


def test_sigterm_while_a_role_starts_ends_the_process_at_once() -> None:
    """A pod deleted while its model loads: `triptych serve` exits 143 with one line, before serving.
    (As a container's PID 1, a SIGTERM without a handler would be ignored and the load go on.) The
    role's start-up is a stand-in that never ends, as a long model load."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    child = (
        "import sys, time\n"
        "from triptych import launch\n"
        "from triptych.cli import build_parser\n"
        "from triptych.config import ServeArgs\n"
        "def loading(args, names):\n"
        "    print('loading', flush=True)\n"
        "    time.sleep(60)\n"
        "launch._serve_role, launch.model_names = loading, lambda *given: ['m']\n"
        "launch.resolve_model_path = lambda given: given\n"
        "argv = ['serve', '--model-path', '.', '--device', 'cpu']\n"
        "args = ServeArgs.from_namespace(build_parser().parse_args(argv))\n"
        "sys.exit(launch.serve(args))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(60, proc.kill)  # a child that never says "loading" ends, and readline with it
    watchdog.start()
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "loading"
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        watchdog.cancel()
        proc.kill()  # nothing once it has exited
        proc.wait(timeout=30)
    assert proc.returncode == 143, err
    assert "triptych: SIGTERM while starting: exiting before serving" in err
    assert time.monotonic() - started < 10
