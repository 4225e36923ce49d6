"""Reference images (triptych.reference): every bad image or URL is a BadReference naming the field."""

from __future__ import annotations

import http.server
import io
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from PIL import Image

from triptych.reference import (
    BadReference,
    _permitted,
    check_reference_url,
    fetch_reference,
    open_reference,
    parse_networks,
)


def png(width: int = 12, height: int = 10) -> bytes:
    out = io.BytesIO()
    Image.new("RGBA", (width, height), (1, 2, 3, 4)).save(out, format="PNG")
    return out.getvalue()


def test_a_good_image_decodes_to_rgb() -> None:
    image = open_reference(png())
    assert (image.mode, image.size) == ("RGB", (12, 10))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "the file is empty"),
        (b"plain text", "not an image"),
        (png()[:40], "truncated or corrupt|not an image"),
    ],
)
def test_bad_bytes_name_the_field(data: bytes, message: str) -> None:
    with pytest.raises(BadReference, match=rf"^reference: ({message})"):
        open_reference(data, "reference")


def tiff_with_rational_strip_offsets() -> bytes:
    """A 4x4 TIFF whose StripOffsets tag is typed RATIONAL: Pillow's decoder raises TypeError on it."""
    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, format="TIFF")
    data = bytearray(out.getvalue())
    ifd = struct.unpack_from("<I", data, 4)[0]
    for i in range(struct.unpack_from("<H", data, ifd)[0]):
        entry = ifd + 2 + 12 * i
        if struct.unpack_from("<H", data, entry)[0] == 273:  # StripOffsets
            struct.pack_into("<H", data, entry + 2, 5)  # RATIONAL
    return bytes(data)


def test_an_image_pillow_fails_to_decode_in_any_way_is_a_bad_reference() -> None:
    """Not only OSError and ValueError: an upload that made Pillow raise TypeError was a 500."""
    with pytest.raises(BadReference, match=r"^image: the image is truncated or corrupt"):
        open_reference(tiff_with_rational_strip_offsets())


@pytest.mark.parametrize(
    "url",
    ["http://[::1", "http://[zz]/", "http://a\u2100b/", "http://a:x/", "http://a:99999/", "http://a b/",
     "http://a/\r\nX: y", "http://a\x00b/"],
)  # fmt: skip
def test_a_url_the_parser_or_http_client_would_refuse_is_a_bad_reference(url: str) -> None:
    """Each was a 500 at the head (the parser's ValueError, or http.client's InvalidURL when fetched)."""
    with pytest.raises(BadReference, match=r"^image: "):
        check_reference_url(url)


class _Server(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/to-ipv6-loopback":
            self.send_response(302)
            self.send_header("Location", "http://[::1]:9/x.png")
            self.end_headers()
            return
        if self.path == "/trickle":  # a byte every 0.1 s, never stalling long enough for a read to time out
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(100):  # bounded: 10 s at most
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up, as its test means it to
            return
        if self.path == "/slow-headers":  # the status line, then a header a byte at a time (bounded: 10 s)
            try:
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                for _ in range(50):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            except (BrokenPipeError, ConnectionResetError):
                pass
            return
        if self.path == "/endless-redirect":  # a 302 whose body never ends (bounded: 10 s, 64 KiB chunks)
            try:
                self.wfile.write(b"HTTP/1.1 302 Found\r\nLocation: /ok\r\nTransfer-Encoding: chunked\r\n\r\n")
                ends = time.monotonic() + 10
                while time.monotonic() < ends:
                    self.wfile.write(b"10000\r\n" + b"x" * 0x10000 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            return
        if self.path == "/ftp":
            self.send_response(302)
            self.send_header("Location", "ftp://example.com/x.png")
            self.end_headers()
            return
        body = png() if self.path in ("/ok", "/slow") else b""
        try:
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            # /slow's client gave up, as its test means it to. Unhandled, socketserver would print the
            # traceback seconds later, in whatever test runs then, and CPython 3.11 formats it with
            # ast.parse, which breaks a concurrent ast.parse of another thread (tests/source_ast.py).
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def base() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


LOOPBACK = parse_networks("127.0.0.0/8")


def test_urls_are_fetched_within_their_limits(base: str) -> None:
    assert fetch_reference(f"{base}/ok", networks=LOOPBACK) == png()
    with pytest.raises(BadReference, match="answered 404"):
        fetch_reference(f"{base}/missing", networks=LOOPBACK)
    with pytest.raises(BadReference, match="larger than 10 bytes"):
        fetch_reference(f"{base}/ok", max_bytes=10, networks=LOOPBACK)
    with pytest.raises(BadReference, match="failed"):
        fetch_reference(f"{base}/slow", timeout=0.5, networks=LOOPBACK)
    started = time.monotonic()
    with pytest.raises(BadReference, match=r"/trickle took longer than 1s"):
        fetch_reference(f"{base}/trickle", timeout=1.0, networks=LOOPBACK)  # every read gets a byte in time
    assert time.monotonic() - started < 5.0, "the whole fetch is bounded, not each read"
    with pytest.raises(BadReference, match="not an http"):
        fetch_reference(f"{base}/ftp", networks=LOOPBACK)
    with pytest.raises(BadReference, match="not an http"):
        fetch_reference("file:///etc/passwd")


def test_a_server_s_pace_before_the_body_cannot_hold_a_fetch_past_its_time(base: str) -> None:
    """Headers a byte at a time used to hold a fetch for as long as the server liked (each read got its
    byte in time, and only the body's reads looked at the clock); a redirect's endless body was read
    whole into memory before the redirect was followed."""
    started = time.monotonic()
    with pytest.raises(BadReference, match=r"/slow-headers took longer than 1s"):
        fetch_reference(f"{base}/slow-headers", timeout=1.0, networks=LOOPBACK)
    assert time.monotonic() - started < 5.0
    started = time.monotonic()
    assert fetch_reference(f"{base}/endless-redirect", timeout=5.0, networks=LOOPBACK) == png()
    assert time.monotonic() - started < 3.0, "the redirect's body was not read"


def test_urls_reach_public_addresses_and_the_listed_networks_only(base: str) -> None:
    """An edit's URL must not make the image encoder a proxy into the cluster (cloud metadata, the
    pod network, the node): non-public addresses are refused unless --reference-url-networks lists
    them, checked after name resolution and on every redirect. Cloud metadata, a home router and the
    pod networks are judged here as addresses (nothing dialled); the URLs fetched below hold TEST-NET
    addresses, refused by the same rule, so a broken check dials nothing real."""
    for address in ("169.254.169.254", "192.168.0.1", "10.0.0.1", "172.16.0.1", "100.64.0.1", "fd00::1"):
        assert not _permitted(address, []), address
        assert _permitted(address, parse_networks(address)), address  # unless --reference-url-networks lists it
    assert _permitted("8.8.8.8", [])
    port = base.rsplit(":", 1)[1]
    for url in (f"{base}/ok", f"http://localhost:{port}/ok", "http://192.0.2.1/latest/meta-data/",
                "http://[::ffff:127.0.0.1]:9/x.png", "http://198.18.0.1/x.png"):  # fmt: skip
        with pytest.raises(BadReference, match="not a public address") as refused:
            fetch_reference(url, timeout=2)
        assert str(refused.value).startswith("image: ") and "--reference-url-networks" in str(refused.value)
    with pytest.raises(BadReference, match=r"::1, not a public address"):
        fetch_reference(f"{base}/to-ipv6-loopback", networks=LOOPBACK)  # allowed server, refused redirect


@pytest.mark.parametrize(
    "address",
    ["64:ff9b::7f00:1", "64:ff9b:1::7f00:1", "::ffff:0:7f00:1", "::7f00:1", "2002:c000:201::1", "fec0::1"],
    ids=["NAT64", "local NAT64", "SIIT", "IPv4-compatible", "6to4", "site-local"],
)
def test_an_ipv6_address_carrying_a_private_ipv4_one_is_not_public(address: str) -> None:
    """IPv6 addresses that a translating network (NAT64 on an IPv6-only cluster) or a tunnel turns into
    the IPv4 address in their last bits (here 127.0.0.1 and 192.0.2.1) are judged by that address.
    Judged as addresses, not fetched: a broken check would dial them (a NAT64 gateway, a 6to4 relay);
    that a fetch refuses what the check refuses, an IPv6 literal included, the test above shows."""
    assert not _permitted(address, [])
    public = address.replace("7f00:1", "808:808").replace("c000:201", "808:808")
    if public != address:  # the same prefix around a public IPv4 address is public
        assert _permitted(public, [])


def test_network_lists_name_the_bad_entry() -> None:
    assert [str(n) for n in parse_networks("10.1.0.0/16; fd00::/8,")] == ["10.1.0.0/16", "fd00::/8"]
    with pytest.raises(ValueError, match=r"'10\.1\.0\.300/16' is not a network"):
        parse_networks("10.1.0.0/16;10.1.0.300/16")


def _sample_format(tiff: bytes, value: int) -> bytes:
    """A little-endian TIFF with its first directory's SampleFormat (tag 339) set to `value` (Pillow
    writes a 32-bit grey image as signed whatever it is told)."""
    import struct

    data = bytearray(tiff)
    directory = struct.unpack_from("<I", data, 4)[0]
    for i in range(struct.unpack_from("<H", data, directory)[0]):
        entry = directory + 2 + 12 * i
        if struct.unpack_from("<H", data, entry)[0] == 339:
            struct.pack_into("<H", data, entry + 8, value)
            return bytes(data)
    raise AssertionError("no SampleFormat tag")


def test_a_16_bit_grey_image_keeps_its_tones_and_a_float_one_is_refused() -> None:
    """Pillow's convert("RGB") clipped a 16-bit grey image's values at 255: a ramp came out nearly white."""
    import numpy as np
    from PIL import Image

    ramp = (np.arange(256, dtype=np.uint16) * 257)[None, :].repeat(4, axis=0)  # 0..65535, black to white
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, format="PNG")  # uint16: mode I;16
    decoded = np.asarray(open_reference(buf.getvalue()))
    assert decoded.shape == (4, 256, 3)
    assert list(decoded[0, :, 0]) == list(range(256))
    deep = (np.arange(256, dtype=np.int64) << 23)[None, :].repeat(4, axis=0).astype(np.int32)  # 0..2^31-1
    buf = io.BytesIO()
    Image.fromarray(deep).save(buf, format="TIFF")  # 32-bit signed grey: mode I, all but black clipped white before
    decoded = np.asarray(open_reference(buf.getvalue()))
    assert list(decoded[0, :, 0]) == list(range(256))
    unsigned = (np.arange(256, dtype=np.uint64) << 24).astype(np.uint32)[None, :].repeat(4, axis=0)
    buf = io.BytesIO()
    Image.fromarray(unsigned.view(np.int32)).save(buf, format="TIFF")
    decoded = np.asarray(open_reference(_sample_format(buf.getvalue(), 1)))  # unsigned, as a scanner writes
    assert list(decoded[0, :, 0]) == list(range(256))  # the brighter half read black before
    buf = io.BytesIO()
    Image.fromarray(np.full((4, 4), 0.5, dtype=np.float32)).save(buf, format="TIFF")  # mode F
    with pytest.raises(BadReference, match=r"image: a floating-point image"):
        open_reference(buf.getvalue())


def test_a_photo_s_exif_orientation_is_applied() -> None:
    """A phone's portrait photo is stored landscape with Orientation 6: used as stored, it lay on its side."""
    from PIL import Image

    stored = Image.new("RGB", (64, 32), (200, 30, 90))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    stored.save(buf, format="JPEG", exif=exif.tobytes())
    assert open_reference(buf.getvalue()).size == (32, 64)


def test_over_https_too_a_server_s_pace_cannot_hold_a_fetch_past_its_time(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """TLS wraps the connection's socket (detaching it): the watchdog must still end the connection."""
    import socket
    import ssl

    from tests.certs import self_signed

    cert, key = self_signed(tmp_path)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:  # headers a byte every 0.2 s, bounded: 10 s
        conn, _ = listener.accept()
        try:
            with server_tls.wrap_socket(conn, server_side=True) as tls:
                tls.recv(65536)
                tls.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                for _ in range(50):
                    tls.sendall(b"x")
                    time.sleep(0.2)
        except OSError:
            pass  # the client gave up, as the test means it to

    threading.Thread(target=serve, daemon=True).start()
    monkeypatch.setattr(ssl, "_create_default_https_context", lambda *a, **k: ssl.create_default_context(cafile=cert))
    started = time.monotonic()
    with pytest.raises(BadReference, match=r"took longer than 1s"):
        fetch_reference(f"https://127.0.0.1:{listener.getsockname()[1]}/x.png", timeout=1.0, networks=LOOPBACK)
    assert time.monotonic() - started < 5.0
    listener.close()


def test_a_photo_whose_exif_has_a_tag_of_the_wrong_type_still_opens_upright() -> None:
    """XResolution written as UNDEFINED bytes (a writer's bug every viewer tolerates): Pillow's
    exif_transpose, which rewrites the EXIF, refused such a photo as corrupt."""
    import struct

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 4), (10, 200, 30)).save(buf, "JPEG")
    jpeg = buf.getvalue()
    entries = [(0x0112, 3, 1, 6), (0x011A, 7, 4, 0x48000000)]  # Orientation 6; XResolution as UNDEFINED[4]
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) + struct.pack("<I", 0)
    app1 = b"Exif\x00\x00II*\x00" + struct.pack("<I", 8) + ifd
    data = jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(app1) + 2) + app1 + jpeg[2:]
    assert open_reference(data).size == (4, 8)
