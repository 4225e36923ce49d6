"""A worker's heads (worker/triptych_worker/heads.py): found by discovery, mapped by their pings."""

from __future__ import annotations

import time

from triptych.roles import Role
from triptych_worker.heads import HeadBook


def test_heads_that_discovery_adds_get_an_endpoint_and_are_mapped_by_their_pings(tmp_path) -> None:
    heads = tmp_path / "heads"
    heads.write_text("tcp://127.0.0.1:5555\n")
    book = HeadBook(f"file://{heads}", Role.DENOISER, 0.05, time.monotonic)
    try:
        first = book.endpoints()
        assert first == ["tcp://127.0.0.1:5557"] and not book.single  # the denoiser's result port: +2
        version = book.version
        heads.write_text("tcp://127.0.0.1:5555\ntcp://127.0.0.1:6555\n")  # a second head pod
        deadline = time.monotonic() + 5
        while len(book.endpoints()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert book.endpoints() == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:6557"]
        assert book.version > version, "the links of every thread must follow the new endpoint"
        assert book.on_ping("head-b", "", "w") is None and book.endpoint_of("head-b") is None  # where: not yet
        assert book.on_ping("head-b", "tcp://127.0.0.1:6557", "w") is None  # its ping echoes our heartbeat's via
        assert book.endpoint_of("head-b") == "tcp://127.0.0.1:6557" and book.head_at("tcp://127.0.0.1:6557") == "head-b"
        assert book.on_ping("head-c", "tcp://127.0.0.1:6557", "w") == "head-b"  # a restarted head there replaced it
    finally:
        book.close()


def test_one_static_address_is_the_single_head_every_message_goes_to() -> None:
    book = HeadBook("tcp://192.0.2.3:19655", Role.ENCODER, 5, time.monotonic)
    assert book.single and book.route("any-request") == "tcp://192.0.2.3:19656"
    assert book.on_ping("h1", "", "w") is None and book.on_ping("h2", "", "w") == "h1"  # a new head id replaces
    book.close()
