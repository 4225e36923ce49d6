"""Service discovery: dns://NAME:PORT stands for every address NAME resolves to, re-resolved."""

from __future__ import annotations

import time

import pytest

from triptych.discovery import EndpointDirectory, expand, resolve_addresses


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


def test_bad_dns_url_names_the_value():
    with pytest.raises(ValueError, match="dns://nope"):
        expand("dns://nope")


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


def test_a_resolver_error_keeps_the_last_list_and_the_directory_keeps_re_reading():
    answers: list = [["192.0.2.1"], OSError("resolver broke"), ["192.0.2.1", "192.0.2.3"]]

    def resolver(_: str) -> list[str]:
        answer = answers[0] if len(answers) == 1 else answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return list(answer)

    directory = EndpointDirectory(["dns://enc.ns.svc:19000"], interval_s=0.05, resolver=resolver)
    try:
        deadline = time.monotonic() + 5
        while len(directory.urls) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert directory.urls == ["tcp://192.0.2.1:19000", "tcp://192.0.2.3:19000"]
    finally:
        directory.close()
