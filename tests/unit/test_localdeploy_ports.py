"""Ports for local deployments: free, and outside the ranges other sockets take ports from."""

from __future__ import annotations

import socket

from triptych.localdeploy import _ephemeral_port_start, free_port_block

MOONCAKE_HANDSHAKE_PORTS = range(15000, 17001)  # Mooncake's P2P handshake listeners pick from here


def test_port_blocks_are_free_and_clear_of_the_ephemeral_and_mooncake_ranges():
    ephemeral = _ephemeral_port_start()
    for _ in range(50):
        base = free_port_block(6)
        block = range(base, base + 6)
        assert block[-1] < ephemeral, f"{block} reaches the kernel's ephemeral range from {ephemeral}"
        assert not set(block) & set(MOONCAKE_HANDSHAKE_PORTS), block
        for port in block:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))  # raises if the block was not free
