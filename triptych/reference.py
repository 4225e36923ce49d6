"""Reference images of image edits: opened safely, in the head (uploads) and the image encoder (URLs).

Every way an image can be bad (not an image, truncated, empty, too large, a decompression bomb,
an unreachable or oversized URL) raises BadReference naming the field, which the head answers
with a 400 and a worker reports as the request's 400: no process ever crashes on one. Pillow is
imported inside the functions (the head and worker extras both install it).
"""

from __future__ import annotations

import functools
import http.client
import io
import ipaddress
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from triptych.urls import shown_url

if TYPE_CHECKING:
    from PIL import Image

MAX_REFERENCE_SIDE = 8192
MAX_REFERENCE_PIXELS = 8192 * 8192 // 2  # 8192x4096; FLUX.1 Kontext resizes references to about a megapixel
MAX_REFERENCE_BYTES = 16 << 20
URL_TIMEOUT_S = 20.0  # a whole fetch, connection to last byte
READ_STALL_S = 5.0  # the longest a connection or a read may wait for the server (within URL_TIMEOUT_S)
READ_CHUNK = 256 << 10
OVERRUN_S = 1.0  # past a fetch's time, its sockets are shut whatever it waits for (a slow read's own timeout first)
FORMATS = ("PNG", "JPEG", "WEBP", "BMP", "GIF", "TIFF")
ECHO = 200  # characters of a URL or of a server's words that an error message repeats


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
URL_NETWORKS: list[Network] = []
"""Non-public networks a reference URL may reach (--reference-url-networks); public addresses always may."""


class BadReference(ValueError):
    """A reference image that cannot be used; the message names the field and why."""


class Refused(OSError):
    """A fetch the head or the image encoder refuses itself (a private address, a redirect to no
    http(s) URL): its message is this process's own words, shown whole; a server's or a library's
    words are escaped and cut (_why)."""


def parse_networks(text: str) -> list[Network]:
    """'10.1.0.0/16;fd00::/8' -> networks; ValueError naming the bad entry."""
    networks = []
    for entry in filter(None, (e.strip() for e in text.replace(",", ";").split(";"))):
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"{entry!r} is not a network (CIDR such as 10.1.0.0/16 or fd00::/8)") from None
    return networks


def allow_url_networks(networks: Iterable[Network]) -> None:
    """Let reference URLs of this process reach `networks` besides the public internet."""
    URL_NETWORKS[:] = list(networks)


# IPv6 prefixes whose addresses carry an IPv4 address in their last 32 bits, which a translating
# network (NAT64, SIIT) or an old tunnel would reach: such an address is judged by the IPv4 inside it.
_EMBEDDING_IPV4 = tuple(
    ipaddress.IPv6Network(n)
    for n in ("64:ff9b::/96", "64:ff9b:1::/48", "::ffff:0:0:0/96", "::/96")  # NAT64, SIIT, IPv4-compatible
)
_SITE_LOCAL = ipaddress.IPv6Network("fec0::/10")  # deprecated, but private where still routed


def _permitted(address: str, allowed: list[Network]) -> bool:
    ip = ipaddress.ip_address(address.partition("%")[0])
    if any(ip in network for network in allowed):
        return True
    return all(candidate.is_global for candidate in _judged_as(ip))


def _judged_as(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses `ip` is judged by: itself, and any IPv4 address it carries (mapped, 6to4, NAT64,
    IPv4-compatible); a site-local IPv6 address is never public."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return [ip]
    if ip in _SITE_LOCAL:
        return [ipaddress.IPv4Address("0.0.0.0")]  # never global
    inside = [ip.ipv4_mapped, ip.sixtofour]
    if any(ip in network for network in _EMBEDDING_IPV4):
        inside.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return [ip, *(v4 for v4 in inside if v4 is not None)]


class _Watchdog:
    """One fetch's sockets, shut down once its time is up (plus OVERRUN_S): whatever the server's pace
    (a status line or headers a byte at a time, a redirect's endless body, which urllib reads whole
    before it follows), the fetch ends then, its blocked read returning or failing at once."""

    def __init__(self, seconds: float):
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds + OVERRUN_S, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> socket.socket:
        """`sock`, its connection watched through a descriptor of the watchdog's own (HTTPS wraps `sock`
        in TLS and detaches it; a shutdown through the duplicate still ends the connection)."""
        own = sock.dup()
        with self._lock:
            self._sockets.append(own)
            expired = self.expired
        if expired:
            own.shutdown(socket.SHUT_RDWR)
        return sock

    def stop(self) -> None:
        self._timer.cancel()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # the peer closed it already
                    pass


def _vetted_connection(
    allowed: list[Network],
    watchdog: _Watchdog,
    address: tuple[str, int],
    timeout: Any = None,
    source_address: Any = None,
) -> socket.socket:
    """socket.create_connection to an address the URL policy permits, checked after resolution (so a
    name cannot point at an internal service) and connected to the very address that was checked."""
    host, port = address
    resolved = [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    refused = [a for a in resolved if not _permitted(a, allowed)]
    if refused:
        raise Refused(
            f"{host} resolves to {refused[0]}, not a public address; "
            "the image encoder's --reference-url-networks lists the private networks it may fetch from"
        )
    return watchdog.watch(socket.create_connection((resolved[0], port), timeout, source_address))


Connect = Callable[..., socket.socket]


def _connection_class(base: type[http.client.HTTPConnection], connect: Connect) -> Any:
    def make(host: str, **kwargs: Any) -> http.client.HTTPConnection:
        conn = base(host, **kwargs)
        conn._create_connection = connect  # type: ignore[attr-defined]
        return conn

    return make


class _VettedHTTP(urllib.request.HTTPHandler):
    def __init__(self, connect: Connect):
        super().__init__()
        self._connect = connect

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_connection_class(http.client.HTTPConnection, self._connect), req)


class _VettedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, connect: Connect):
        super().__init__()
        self._connect = connect

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(
            _connection_class(http.client.HTTPSConnection, self._connect),
            req,
            context=self._context,  # type: ignore[attr-defined]
        )


def open_reference(data: bytes, field: str = "image") -> Image.Image:
    """Decode `data` fully into an RGB image, checking its size before a pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise BadReference(f"{field}: the file is empty")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:  # its message is "cannot identify image file <_io.BytesIO object at 0x...>"
        raise BadReference(f"{field}: not an image this server reads ({', '.join(FORMATS)})") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise BadReference(f"{field}: not an image this server reads ({', '.join(FORMATS)}): {exc}") from None
    except Image.DecompressionBombError:
        raise BadReference(f"{field}: the image declares more pixels than allowed (a decompression bomb?)") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise BadReference(f"{field}: the image is {width}x{height}; it needs at least one pixel")
    if width > MAX_REFERENCE_SIDE or height > MAX_REFERENCE_SIDE or width * height > MAX_REFERENCE_PIXELS:
        raise BadReference(
            f"{field}: the image is {width}x{height}; at most {MAX_REFERENCE_SIDE} pixels a side and "
            f"{MAX_REFERENCE_PIXELS} pixels in all ({MAX_REFERENCE_SIDE}x{MAX_REFERENCE_PIXELS // MAX_REFERENCE_SIDE})"
        )
    try:
        image.load()
        return _eight_bits(_upright(image), _grey_bits(image), field).convert("RGB")  # bits: tags are not turned
    except BadReference:
        raise
    except Image.DecompressionBombError:
        raise BadReference(f"{field}: the image decodes to more pixels than allowed (a decompression bomb?)") from None
    except Exception as exc:  # Pillow's decoders raise what they meet (a TIFF's rational StripOffsets: TypeError)
        raise BadReference(f"{field}: the image is truncated or corrupt ({exc})") from None


def _upright(image: Image.Image) -> Image.Image:
    """`image` as every viewer shows it, its EXIF orientation applied (a phone's portrait photo is stored
    landscape). Only the pixels are turned: ImageOps.exif_transpose also rewrites the EXIF, which fails
    on tags of the wrong type that every viewer opens."""
    from PIL import ExifTags, Image

    try:
        orientation = int(image.getexif().get(ExifTags.Base.Orientation, 1))
    except Exception:  # an EXIF block Pillow cannot read: taken as it is stored
        return image
    method = {
        2: Image.Transpose.FLIP_LEFT_RIGHT,
        3: Image.Transpose.ROTATE_180,
        4: Image.Transpose.FLIP_TOP_BOTTOM,
        5: Image.Transpose.TRANSPOSE,
        6: Image.Transpose.ROTATE_270,
        7: Image.Transpose.TRANSVERSE,
        8: Image.Transpose.ROTATE_90,
    }.get(orientation)
    return image if method is None else image.transpose(method)


def _eight_bits(image: Image.Image, bits: int, field: str) -> Image.Image:
    """16 and 32 bits a pixel of grey (`bits` of value) to 8, their top ones: Pillow's convert("RGB")
    clips every value above 255, turning such an image nearly white. A floating-point image has no
    range to scale from."""
    if image.mode.startswith("I;16") or image.mode == "I":
        import numpy as np
        from PIL import Image

        values = np.asarray(image)
        if bits == 32 and values.dtype == np.int32:  # unsigned 32 bits, which Pillow reads into a signed mode
            values = values.view(np.uint32)
        values = np.clip(values.astype(np.int64), 0, (1 << bits) - 1) >> (bits - 8)
        return Image.fromarray(values.astype(np.uint8), "L")
    if image.mode == "F":
        raise BadReference(f"{field}: a floating-point image (mode F); send one of 8 or 16 bits a channel")
    return image


def _grey_bits(image: Image.Image) -> int:
    """How many bits of value a grey pixel of mode I or I;16 holds: a TIFF says (BitsPerSample, 32 for
    the 32-bit grey a scanner or microscope writes, less the sign's); Pillow opens a 16-bit PNG as I
    or I;16."""
    tags = getattr(image, "tag_v2", None)
    if tags is None:
        return 16
    declared, sample_format = (_first(tags.get(tag)) for tag in (258, 339))  # BitsPerSample, SampleFormat
    if not isinstance(declared, int) or not 8 < declared <= 32:
        return 16
    return declared - 1 if sample_format == 2 else declared  # signed: its top bit is the sign's


def _first(value: object) -> object:
    """A TIFF tag's value: one, or one per sample (the first)."""
    return value[0] if isinstance(value, tuple) and value else value


def check_reference_url(url: str, field: str = "image") -> str:
    """An http(s) URL, or BadReference naming the field (nothing else is fetched: no file://, no ftp://)."""
    from urllib.parse import urlsplit

    if _has_user_part(url):  # checked first: the messages below repeat the URL, and so would its password
        raise BadReference(
            f"{field}: {shown_reference(url)}: a URL with user:password@ is not fetched (credentials do not "
            "belong in a URL); give a presigned URL or upload the image"
        )
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # .port: ValueError for one that is no number in 0..65535
    except ValueError as exc:  # "http://[::1", a host that NFKC normalisation changes
        raise BadReference(f"{field}: {url[:200]!r} is not a valid http(s) URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not host:
        raise BadReference(f"{field}: {url[:200]!r} is not an http(s) URL")
    if any(c <= " " or c == "\x7f" for c in url):  # http.client refuses them (InvalidURL) when it connects
        raise BadReference(f"{field}: {url[:200]!r} holds spaces or control characters; percent-encode them")
    return url


def _has_user_part(url: str) -> bool:
    """Whether `url`'s authority (what follows `//`, up to a `/`, `?` or `#`) holds a user part
    (`user@`, `user:password@`), read without the URL parser, which may refuse the URL first. urllib
    reads such a URL's host wrongly: `alice:pa55word@host` as a host with the port `pa55word@host`
    (InvalidURL), `alice@host:80` as a host of that name."""
    _, slashes, rest = url.partition("//")
    if not slashes:
        return False
    for end in "/?#":
        rest = rest.partition(end)[0]
    return "@" in rest


class _HTTPOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow redirects to http(s) only (urllib's default also follows ftp://)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        try:
            check_reference_url(newurl)
        except BadReference:  # its message would repeat the new URL whole, its query (a signature) included
            fp.close()
            why = "a URL with a user part" if _has_user_part(newurl) else "not an http(s) URL"
            raise urllib.error.URLError(Refused(f"redirected to {shown_reference(newurl)}, {why}")) from None
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        fp.close()  # its body is not read: urllib would read all of it, however long, before following
        return new


def fetch_reference(
    url: str,
    field: str = "image",
    max_bytes: int = MAX_REFERENCE_BYTES,
    timeout: float = URL_TIMEOUT_S,
    networks: list[Network] | None = None,
) -> bytes:
    """GET an http(s) reference, at most `max_bytes` within `timeout` seconds in all, else BadReference.

    Only public addresses, and the non-public `networks` (default: the process's
    --reference-url-networks), are connected to, redirects included; no proxy is used.
    """
    check_reference_url(url, field)
    allowed = URL_NETWORKS if networks is None else networks
    watchdog = _Watchdog(timeout)
    connect = functools.partial(_vetted_connection, allowed, watchdog)
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), _VettedHTTP(connect), _VettedHTTPS(connect), _HTTPOnlyRedirects
    )
    request = urllib.request.Request(url, headers={"User-Agent": "triptych"})
    deadline = time.monotonic() + timeout
    shown = shown_reference(url)  # these messages reach the head's log and the trace: no credentials
    too_slow = BadReference(f"{field}: GET {shown} took longer than {timeout:g}s")
    try:
        # Each socket operation (connect, every read) waits at most READ_STALL_S, the body's reads stop
        # at `timeout`, and the watchdog ends whatever else is still waiting just after it.
        with opener.open(request, timeout=min(timeout, READ_STALL_S)) as response:
            data = _read_until(response, max_bytes, deadline)
    except urllib.error.HTTPError as exc:
        raise too_slow if watchdog.expired else BadReference(f"{field}: GET {shown} answered {exc.code}") from None
    except _TooSlow:
        raise too_slow from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        if watchdog.expired:
            raise too_slow from None
        raise BadReference(f"{field}: GET {shown} failed: {_why(exc)}") from None
    finally:
        watchdog.stop()
    if watchdog.expired:  # a read the shutdown ended reads as the body's end: what came is not all of it
        raise too_slow
    if len(data) > max_bytes:
        raise BadReference(f"{field}: {shown} is larger than {max_bytes} bytes")
    return data


def shown_reference(url: str) -> str:
    """The URL as a fetch's error shows it: no user part and no query (a presigned S3, GCS or Azure URL's
    signature), `?…` where a query was left out; ECHO characters at most."""
    shown = shown_url(url)
    shown = shown if len(shown) <= ECHO else f"{shown[:ECHO]}…"
    return f"{shown}?…" if "?" in url else shown


def _why(exc: BaseException) -> str:
    """Why a fetch failed, in words that cannot forge a log line: this process's own refusal (Refused)
    whole; a fixed phrase for a server that answered no HTTP (BadStatusLine would repeat its status
    line, up to 64 KiB, carriage returns and all) and for a URL http.client will not send; else the
    reason's text with control characters escaped, ECHO characters at most."""
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, Refused):  # its words are ours: the URL in it already shortened, the advice whole
        return str(reason)
    if isinstance(reason, http.client.InvalidURL):  # an HTTPException too, but nothing was asked of any server
        return "http.client refused the URL before connecting (a port that is not a number, a host it cannot read)"
    if isinstance(reason, http.client.RemoteDisconnected):
        return "the server closed the connection without answering"
    if isinstance(reason, http.client.IncompleteRead):
        return "the server's answer broke off before its end"
    if isinstance(reason, http.client.HTTPException):
        return "the server answered something that is not HTTP"
    said = repr(str(reason))[1:-1]  # repr's escapes (\r, \n, \x1b), without its quotes
    return said if len(said) <= ECHO else f"{said[:ECHO]}…"


class _TooSlow(Exception):
    pass


def _read_until(response: Any, max_bytes: int, deadline: float) -> bytes:
    """The body, at most max_bytes + 1 of it (one more says it is too large), read chunk by chunk
    as it arrives until the deadline (_TooSlow after it)."""
    chunks: list[bytes] = []
    size = 0
    while size <= max_bytes:
        if time.monotonic() > deadline:
            raise _TooSlow
        chunk = response.read1(min(READ_CHUNK, max_bytes + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def reference_image(image: bytes | None, image_url: str | None, field: str = "image") -> Image.Image:
    """The request's reference, inlined or fetched, decoded (the image encoder's entry)."""
    if image is not None:
        return open_reference(image, field)
    if image_url is None:
        raise BadReference(f"{field}: the request carries no reference image")
    return open_reference(fetch_reference(image_url, field), field)
