"""An HTTPS certificate is reloaded when its files change (triptych/tls_reload.py, the head's and the
metrics API server's): a real TLS server on loopback with the reloader on its context. New connections
get the new pair; a pair that does not load (a key of another certificate, a missing file) is logged
once and the pair in use kept. The metrics API server's own, on a kubelet-style Secret mount:
tests/operator/test_metrics_api.py."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import ssl
from pathlib import Path

import pytest

from tests.certs import der, self_signed
from triptych.tls_reload import CertificateReloader


def install(cert: Path, key: Path, folder: Path) -> tuple[Path, Path]:
    """Put the pair at folder/tls.crt and folder/tls.key, each swapped in whole (as the kubelet does)."""
    folder.mkdir(exist_ok=True)
    for src, name in ((cert, "tls.crt"), (key, "tls.key")):
        shutil.copy(src, folder / f".{name}.new")
        os.replace(folder / f".{name}.new", folder / name)
    return folder / "tls.crt", folder / "tls.key"


async def presented(port: int) -> bytes:
    """The certificate a new connection to the server is shown."""
    client = ssl.create_default_context()
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    _reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    cert = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    await writer.wait_closed()
    return cert


async def serving(context: ssl.SSLContext) -> asyncio.Server:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)


def test_a_renewed_pair_is_served_to_new_connections_and_a_bad_one_is_refused_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b, c = (self_signed(tmp_path / n, name=n) for n in ("a", "b", "c"))
    live = tmp_path / "live"
    cert, key = install(*a, live)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)  # what uvicorn does at start
    reloader = CertificateReloader(context, str(cert), str(key))

    async def scenario() -> None:
        server = await serving(context)
        port = server.sockets[0].getsockname()[1]
        assert await presented(port) == der(a[0])
        assert not reloader.check(), "nothing changed"

        install(*b, live)
        assert reloader.check()
        assert await presented(port) == der(b[0]), "a new connection gets the renewed certificate"

        caplog.clear()
        install(c[0], b[1], live)  # c's certificate with b's key: does not load
        with caplog.at_level(logging.ERROR, logger="triptych.tls_reload"):
            assert not reloader.check()
            assert not reloader.check()
        assert len(caplog.records) == 1, "logged once, not on every check"
        assert "does not load" in caplog.records[0].getMessage() and str(cert) in caplog.records[0].getMessage()
        assert await presented(port) == der(b[0]), "the pair in use is kept"

        caplog.clear()
        key.unlink()
        with caplog.at_level(logging.ERROR, logger="triptych.tls_reload"):
            assert not reloader.check()
            assert not reloader.check()
        assert len(caplog.records) == 1 and "cannot be read" in caplog.records[0].getMessage()
        assert await presented(port) == der(b[0])

        install(*c, live)
        assert reloader.check()
        assert await presented(port) == der(c[0]), "a good pair after bad ones is loaded"
        server.close()
        await server.wait_closed()

    asyncio.run(scenario())


def test_the_reloader_runs_until_cancelled(tmp_path: Path) -> None:
    a, b = (self_signed(tmp_path / n, name=n) for n in ("a", "b"))
    cert, key = install(*a, tmp_path / "live")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    reloader = CertificateReloader(context, str(cert), str(key))

    async def scenario() -> None:
        server = await serving(context)
        port = server.sockets[0].getsockname()[1]
        task = asyncio.create_task(reloader.run(every_s=0.05))
        install(*b, tmp_path / "live")
        for _ in range(200):  # up to 10 s
            if await presented(port) == der(b[0]):
                break
            await asyncio.sleep(0.05)
        assert await presented(port) == der(b[0])
        task.cancel()
        server.close()
        await server.wait_closed()

    asyncio.run(scenario())
