"""Service discovery: dns://NAME:PORT stands for every address NAME resolves to, re-resolved."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest

from triptych.discovery import DiscoveryFailed, EndpointDirectory, expand, resolve_addresses


def test_tcp_urls_pass_through_and_dns_urls_expand_to_each_address():
    assert expand("tcp://192.0.2.1:19000") == ["tcp://192.0.2.1:19000"]
    resolver = {"dec.ns.svc": ["192.0.2.7", "192.0.2.5", "fd00::1"]}.get
    assert expand("dns://dec.ns.svc:19000", lambda h: sorted(resolver(h) or [])) == [
        "tcp://192.0.2.5:19000",
        "tcp://192.0.2.7:19000",
        "tcp://[fd00::1]:19000",
    ]


def test_localhost_resolves_through_the_real_resolver():
    assert "127.0.0.1" in resolve_addresses("localhost")
    assert resolve_addresses("no-such-host.invalid") == []


@pytest.mark.parametrize("spec", ["dns://nope", "dns://dec.ns.svc:0", "dns://dec.ns.svc:19000/path", "dns://u@dec:1"])
def test_bad_dns_url_names_the_value(spec: str):
    with pytest.raises(ValueError, match=rf"{spec!r} is not a dns://NAME:PORT endpoint \(PORT 1-65535\)"):
        expand(spec, lambda _: ["192.0.2.1"])


def test_a_file_list_keeps_only_whole_tcp_endpoints(tmp_path, caplog):
    """The list a tool rewrites at run time is held to what the flags take at start-up: an entry with
    port 0, a path or a user part would dial the wrong place, so it is skipped, with a warning naming it."""
    listed = tmp_path / "decoders"
    listed.write_text(
        "# decoders\n"
        "tcp://192.0.2.1:19000\n"
        "tcp://192.0.2.2:0\n"
        "tcp://192.0.2.3:19000/extra  # a path\n"
        "tcp://user@192.0.2.4:19000\n"
        "dns://dec.ns.svc:19000\n"
        "tcp://[2001:db8::1]:19000\n"
    )
    assert expand(f"file://{listed}") == ["tcp://192.0.2.1:19000", "tcp://[2001:db8::1]:19000"]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 4 and all("is not a tcp://HOST:PORT endpoint" in m for m in skipped)
    assert expand(f"file://{tmp_path}/missing") == []


def test_directory_follows_scaling_of_the_service():
    pods = ["192.0.2.1"]
    directory = EndpointDirectory(["dns://enc.ns.svc:19000"], interval_s=0.05, resolver=lambda _: list(pods))
    try:
        assert directory.urls == ["tcp://192.0.2.1:19000"]
        pods.append("192.0.2.2")
        deadline = time.monotonic() + 5
        while len(directory.urls) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert directory.urls == ["tcp://192.0.2.1:19000", "tcp://192.0.2.2:19000"]
        pods.remove("192.0.2.1")
        while len(directory.urls) > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert directory.urls == ["tcp://192.0.2.2:19000"]
    finally:
        directory.close()


def scripted(answers: list) -> Callable[[str], list[str]]:
    """A resolver that gives `answers` in turn (raising the exceptions among them), the last for ever."""

    def resolver(_: str) -> list[str]:
        answer = answers[0] if len(answers) == 1 else answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    return resolver


def test_a_resolver_error_keeps_the_last_list_and_the_directory_keeps_re_reading():
    answers: list = [["192.0.2.1"], OSError("resolver broke"), ["192.0.2.1", "192.0.2.3"]]
    directory = EndpointDirectory(["dns://enc.ns.svc:19000"], interval_s=0.05, resolver=scripted(answers))
    try:
        deadline = time.monotonic() + 5
        while len(directory.urls) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert directory.urls == ["tcp://192.0.2.1:19000", "tcp://192.0.2.3:19000"]
    finally:
        directory.close()


def test_a_name_with_no_address_is_an_empty_list_and_a_resolver_that_cannot_say_is_a_failure(monkeypatch):
    """NXDOMAIN (a headless Service without a ready pod) means no instances; EAI_AGAIN (the DNS server
    restarting, a timeout) means nothing about them, and must not empty the list."""

    def failing(errno: int):
        def getaddrinfo(*_: object, **__: object) -> list:
            raise socket.gaierror(errno, "as the resolver says")

        return getaddrinfo

    monkeypatch.setattr(socket, "getaddrinfo", failing(socket.EAI_NONAME))
    assert resolve_addresses("dec.ns.svc") == []
    monkeypatch.setattr(socket, "getaddrinfo", failing(socket.EAI_AGAIN))
    with pytest.raises(DiscoveryFailed, match=r"resolving dec\.ns\.svc"):
        resolve_addresses("dec.ns.svc")


def test_a_temporary_dns_failure_keeps_the_last_list_logged_once(caplog):
    pair = ["192.0.2.1", "192.0.2.2"]
    answers: list = [pair, *[DiscoveryFailed("resolving enc.ns.svc: try again")] * 6, pair]
    directory = EndpointDirectory(["dns://enc.ns.svc:19000"], interval_s=0.02, resolver=scripted(answers))
    try:
        deadline = time.monotonic() + 5
        while len(answers) > 1 and time.monotonic() < deadline:
            assert directory.urls == ["tcp://192.0.2.1:19000", "tcp://192.0.2.2:19000"]
            time.sleep(0.005)
        assert len(answers) == 1
    finally:
        directory.close()
    logged = [r.getMessage() for r in caplog.records if "try again" in r.getMessage()]
    assert len(logged) == 1 and "keeping ['tcp://192.0.2.1:19000', 'tcp://192.0.2.2:19000']" in logged[0]


def test_an_endpoint_file_that_cannot_be_read_keeps_the_last_list(tmp_path):
    listed = tmp_path / "encoders"
    listed.write_text("tcp://192.0.2.1:19000\n")
    directory = EndpointDirectory([f"file://{listed}"], interval_s=0.02)
    try:
        listed.unlink()
        listed.mkdir()  # there, but no list to read (an EISDIR, as an EIO would be)
        time.sleep(0.2)
        assert directory.urls == ["tcp://192.0.2.1:19000"]
        listed.rmdir()  # gone: no instances
        deadline = time.monotonic() + 5
        while directory.urls and time.monotonic() < deadline:
            time.sleep(0.02)
        assert directory.urls == []
    finally:
        directory.close()
