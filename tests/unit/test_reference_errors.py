"""What a failed reference-image fetch (triptych.reference) says: its messages reach the client's 400,
the head's log and the trace's span status, so they name the URL without its user part or query (a
presigned S3, GCS or Azure URL's signature, user:password) and never repeat a server's raw words (a
status line with a carriage return would forge a log line)."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import socket
import sys
import threading
import urllib.error
from collections.abc import Iterator

import pytest

from triptych.reference import ECHO, BadReference, _why, check_reference_url, fetch_reference, parse_networks

LOOPBACK = parse_networks("127.0.0.0/8")
SIGNED = "?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature=5ec2e7516a7e"
SECRETS = ("AKIAEXAMPLE", "5ec2e7516a7e", "alice", "pa55word")


class _Server(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.startswith("/expired"):  # a presigned URL past its expiry
            self.send_response(403)
            self.end_headers()
        elif self.path.startswith("/to-user-part"):
            self.send_response(302)
            self.send_header("Location", "http://alice:pa55word@127.0.0.1/x.png")
            self.end_headers()
        elif self.path.startswith("/long-ftp"):  # a redirect whose target's path is longer than ECHO
            self.send_response(302)
            self.send_header("Location", f"ftp://files.example.com/{'d' * 300}/cat.png")
            self.end_headers()
        elif self.path.startswith("/moved"):
            self.send_response(302)
            self.send_header("Location", f"ftp://files.example.com/cat.png{SIGNED}")
            self.end_headers()
        else:
            self.send_response(200)
            self.send_header("Content-Length", "64")
            self.end_headers()
            self.wfile.write(b"x" * 64)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port
    server.shutdown()


def _refused(url: str, **kwargs: object) -> str:
    with pytest.raises(BadReference) as caught:
        fetch_reference(url, "image", networks=LOOPBACK, **kwargs)  # type: ignore[arg-type]
    return str(caught.value)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("path", "kwargs", "says"),
    [
        ("/expired", {}, "answered 403"),
        ("/big", {"max_bytes": 10}, "is larger than 10 bytes"),
        ("/moved", {}, "redirected to ftp://files.example.com/cat.png?…, not an http(s) URL"),
    ],
)
def test_a_failed_fetch_names_the_url_without_its_user_part_or_query(
    port: int, path: str, kwargs: dict[str, object], says: str
) -> None:
    message = _refused(f"http://127.0.0.1:{port}{path}{SIGNED}", **kwargs)
    assert f"127.0.0.1:{port}{path}?…" in message and says in message, message
    for secret in SECRETS:
        assert secret not in message, message


def test_an_unreachable_server_is_named_without_the_url_s_query() -> None:
    port = _closed_port()
    message = _refused(f"http://127.0.0.1:{port}/cat.png{SIGNED}")
    assert f"GET http://127.0.0.1:{port}/cat.png?… failed: " in message, message
    for secret in SECRETS:
        assert secret not in message, message


_DIALS: list[tuple[str, object]] | None = None  # the sockets' audit events while no_dials() watches


def _audit(event: str, args: tuple[object, ...]) -> None:
    if _DIALS is not None and event in ("socket.connect", "socket.getaddrinfo", "socket.gethostbyname"):
        _DIALS.append((event, args[1] if event == "socket.connect" else args[0]))


@contextlib.contextmanager
def no_dials() -> Iterator[list[tuple[str, object]]]:
    """The name look-ups and connections this process makes inside, from any thread (an audit hook,
    added once: it cannot be removed, and records nothing outside)."""
    global _DIALS, _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True
    _DIALS = dials = []
    try:
        yield dials
    finally:
        _DIALS = None


_HOOKED = False


@contextlib.contextmanager
def recording_listener() -> Iterator[tuple[int, list[object]]]:
    """A listening port on loopback and the connections made to it."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join()
        listener.close()


@pytest.mark.parametrize("user", ["alice:pa55word@", "alice@", "alice:@"])
@pytest.mark.parametrize("ported", [False, True])
def test_a_url_with_a_user_part_is_refused_before_any_connection_without_repeating_it(user: str, ported: bool) -> None:
    """urllib took `alice:pa55word@127.0.0.1` for a host with the port `pa55word@127.0.0.1` (InvalidURL,
    an HTTPException: "the server answered something that is not HTTP", no server asked), and
    `alice@127.0.0.1:port` for a host named so ("Name or service not known", the user part hidden):
    the client could not tell why. Refused up front, by check_reference_url (the head's door) and
    the image encoder's fetch alike, saying why; nothing looked up, nothing dialled."""
    with recording_listener() as (port, accepted), no_dials() as dials:
        address = f"127.0.0.1:{port}" if ported else "127.0.0.1"
        url = f"http://{user}{address}/cat.png{SIGNED}"
        with pytest.raises(BadReference) as checked:
            check_reference_url(url)
        fetched = _refused(url)
    for message in (str(checked.value), fetched):
        assert message == (
            f"image: http://{address}/cat.png?…: a URL with user:password@ is not fetched (credentials do not "
            "belong in a URL); give a presigned URL or upload the image"
        ), message
        for secret in SECRETS:
            assert secret not in message, message
    assert dials == [] and accepted == [], (dials, accepted)


def test_the_user_part_check_sees_only_the_authority() -> None:
    """An `@` in the path or the query is no user part; one in a URL the parser refuses still is
    (whose message would otherwise repeat the URL, its password with it)."""
    assert check_reference_url("http://example.com/a@b.png?by=me@x") == "http://example.com/a@b.png?by=me@x"
    for url in ("http://alice:pa55word@[::1/x.png", "http://alice:pa55word@example.com:99999/x.png"):
        with pytest.raises(BadReference, match="user:password@") as refused:
            check_reference_url(url)
        assert "pa55word" not in str(refused.value) and "alice" not in str(refused.value)


def test_a_redirect_to_a_url_with_a_user_part_is_refused_naming_why(port: int) -> None:
    message = _refused(f"http://127.0.0.1:{port}/to-user-part")
    assert message.endswith("redirected to http://127.0.0.1/x.png, a URL with a user part"), message
    assert "alice" not in message and "pa55word" not in message, message


def test_a_url_http_client_refuses_is_not_called_a_server_s_answer() -> None:
    """http.client's InvalidURL is an HTTPException, but no server said anything."""
    said = _why(urllib.error.URLError(http.client.InvalidURL("nonnumeric port: 'pa55word@127.0.0.1'")))
    assert "not HTTP" not in said and "server" not in said and "pa55word" not in said, said
    assert "refused the URL before connecting" in said, said


def _raw_server(answer: bytes) -> socket.socket:
    """A listening socket that reads one request and answers `answer`, bytes as given."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return listener


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (
            b"SSH-2.0-OpenSSH\r\n2026-12-06 15:20:12,279 INFO [server] forged: admin key used\r\n\r\n",
            "answered something that is not HTTP",
        ),
        (b"", "closed the connection without answering"),
    ],
)
def test_a_server_that_answers_no_http_is_named_in_fixed_words_not_its_own(answer: bytes, says: str) -> None:
    """BadStatusLine's reason is the server's status line (up to 64 KiB, carriage returns included): it
    went into the client's 400 and the head's text log, where its \\r forged a line of the server's own."""
    with _raw_server(answer) as listener:
        message = _refused(f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png")
    assert f"failed: the server {says}" in message, message
    assert "\r" not in message and "forged" not in message and "SSH" not in message, message


def test_a_reason_of_its_own_is_escaped_and_cut_short() -> None:
    said = _why(urllib.error.URLError("broken\r\nINFO forged line " + "x" * 1000))
    assert "\r" not in said and "\n" not in said and said.startswith("broken\\r\\nINFO forged"), said
    assert len(said) <= 201, len(said)


def test_the_head_s_own_refusals_are_shown_whole_however_long_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """_why escaped and cut every reason at ECHO characters, the head's own refusals too: a redirect
    to an ftp:// URL with a long path lost "not an http(s) URL", a private address with a long host
    name lost the --reference-url-networks advice. Only a server's or a library's words are cut."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        redirected = _refused(f"http://127.0.0.1:{server.server_port}/long-ftp")
    finally:
        server.shutdown()
    assert redirected.endswith("…, not an http(s) URL"), redirected  # the target cut at ECHO, the reason whole

    host = "a-reference-image-host-with-a-long-name." * 5 + "example"
    resolve = socket.getaddrinfo

    def resolver(name: str, port: int, *args: object, **kwargs: object) -> list:  # type: ignore[type-arg]
        if name == host:  # a name that points at a private address (refused: nothing is dialled)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.168.0.7", port))]
        return resolve(name, port, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    with pytest.raises(BadReference) as refused:
        fetch_reference(f"http://{host}/cat.png", "image", networks=[])
    message = str(refused.value)
    assert len(f"{host} resolves to 192.168.0.7") > ECHO
    assert message.endswith(
        f"failed: {host} resolves to 192.168.0.7, not a public address; the image encoder's "
        "--reference-url-networks lists the private networks it may fetch from"
    ), message
