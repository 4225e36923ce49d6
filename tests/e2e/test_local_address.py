"""tests/local_address.py shared by sessions at once, in a private network namespace (`unshare -n`, as
root): the address stays while any session uses it, the last one out removes it if one of them added
it, one that was there before is left, an add that finds it added meanwhile is no error, and a
failing add reports what `ip` said.

Before: a session that found the address present used it while the session that had added it
deleted it under it; of two that both found nothing and both added, the second's add failed
("Address already assigned"), blamed on a missing CAP_NET_ADMIN, and its cleanup still deleted the
first's address.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests import local_address as la
from tests.setup_check import missing

REPO = Path(__file__).resolve().parents[2]
ADDRESS = "198.18.0.77"  # TEST-NET (RFC 2544), inside the test's own network namespace only
DEVICE = "trp-shared"
SESSION = """
import sys
from tests.local_address import local_address
with local_address(sys.argv[1], sys.argv[2]):
    print("in", flush=True)
    sys.stdin.readline()
print("out", flush=True)
"""


def test_sessions_share_an_address_and_the_last_one_out_removes_it(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        missing("root, unshare and ip (a private network namespace)", "the suite runs as root in CI")
    env = {**os.environ, "TRIPTYCH_ADDRESS_LOCK_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    code = "from tests.e2e.test_local_address import in_a_private_namespace; in_a_private_namespace()"
    ran = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0 and ran.stdout.strip().endswith("all scenarios passed"), f"{ran.stdout}\n{ran.stderr}"


class Session:
    """Another pytest session holding the address: in once it says so, out when told."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SESSION, ADDRESS, DEVICE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def entered(self) -> Session:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line == "in", f"{line!r}; {self.proc.stderr.read() if self.proc.stderr else ''}"
        return self

    def leave(self) -> None:
        out, err = self.proc.communicate("\n", timeout=30)
        assert self.proc.returncode == 0 and out.strip() == "out", (out, err)


def held() -> bool:
    return la._held(ADDRESS)


def first_user_leaves_first() -> None:
    first, second = Session().entered(), Session().entered()  # the first adds, the second finds it
    first.leave()
    assert held(), "the adder left while another session still used the address: it must stay"
    second.leave()
    assert not held(), "the last user out removes it"


def last_user_leaves_first() -> None:
    first, second = Session().entered(), Session().entered()
    second.leave()
    assert held()
    first.leave()
    assert not held()


def all_at_once() -> None:
    sessions = [Session() for _ in range(4)]  # started together: each may find nothing and add
    for session in sessions:
        session.entered()
    assert held()
    for session in sessions:
        session.leave()
    assert not held()


def someone_else_s_address_is_left() -> None:
    assert la._ip("addr", "add", f"{ADDRESS}/32", "dev", "lo").returncode == 0
    try:
        first, second = Session().entered(), Session().entered()
        first.leave()
        second.leave()
        assert held(), "an address that was there before any session is left"
    finally:
        la._ip("addr", "del", f"{ADDRESS}/32", "dev", "lo")


def added_meanwhile_is_no_error() -> None:
    """Someone else adds the address after this session looked and before its own add."""
    assert la._ip("addr", "add", f"{ADDRESS}/32", "dev", "lo").returncode == 0
    looked = la._held
    la._held = lambda address: False  # type: ignore[assignment]
    try:
        with la.local_address(ADDRESS, DEVICE):
            assert looked(ADDRESS)
        assert looked(ADDRESS), "the add found it already assigned: someone else's, used and left"
    finally:
        la._held = looked  # type: ignore[assignment]
        la._ip("addr", "del", f"{ADDRESS}/32", "dev", "lo")


def a_failed_add_says_what_ip_said() -> None:
    try:
        with la.local_address("198.18.0.300", DEVICE):  # no address: `ip` refuses it
            raise AssertionError("an address ip refuses was not refused")
    except BaseException as exc:  # pytest.fail's Failed is no Exception
        said = str(exc)
    assert "198.18.0.300" in said and "ip addr add" in said and "CAP_NET_ADMIN" not in said, said
    assert "Error" in said, said  # ip's own words ('Error: any valid prefix is expected ...')


SCENARIOS = (
    first_user_leaves_first,
    last_user_leaves_first,
    all_at_once,
    someone_else_s_address_is_left,
    added_meanwhile_is_no_error,
    a_failed_add_says_what_ip_said,
)


def in_a_private_namespace() -> None:
    """The scenarios, each on a fresh start, in the namespace `unshare -n` made (the test above calls it)."""
    failed = []
    for scenario in SCENARIOS:
        assert not held(), f"before {scenario.__name__}: the address is left over"
        try:
            scenario()
            print(f"ok {scenario.__name__}")
        except BaseException as exc:  # pytest.fail's Failed too
            failed.append(scenario.__name__)
            print(f"FAILED {scenario.__name__}: {type(exc).__name__}: {exc}")
            la._ip("addr", "del", f"{ADDRESS}/32", "dev", "lo")
            la._ip("link", "del", DEVICE)
    print(f"{len(failed)} scenarios failed" if failed else "all scenarios passed")
