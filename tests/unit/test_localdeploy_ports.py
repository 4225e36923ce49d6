"""Ports for local deployments: free, and outside the ranges other sockets take ports from."""

from __future__ import annotations

import socket

from triptych.roles import Role
from triptych_dev.localdeploy import _ephemeral_port_start, deployment_ports, free_port_block

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


def test_a_deployment_gets_distinct_ports_for_the_head_its_http_api_and_every_worker():
    counts = {Role.ENCODER: 2, Role.DENOISER: 3, Role.DECODER: 1}
    for _ in range(50):
        sched, http, workers = deployment_ports(counts)
        taken = [*range(sched, sched + 6), http, *(p for ports in workers.values() for p in ports)]
        assert len(set(taken)) == len(taken) == 6 + 1 + 6, taken
        assert {role: len(ports) for role, ports in workers.items()} == counts
