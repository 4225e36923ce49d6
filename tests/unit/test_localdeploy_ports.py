"""Ports for local deployments: free, and outside the ranges other sockets take ports from."""

from __future__ import annotations

import socket

import pytest

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


@pytest.mark.parametrize("heads", [1, 3])
def test_a_deployment_gets_distinct_ports_for_every_head_its_http_api_and_every_worker(heads):
    counts = {Role.ENCODER: 2, Role.DENOISER: 3, Role.DECODER: 1}
    for _ in range(50):
        head_ports, workers = deployment_ports(counts, heads)
        assert len(head_ports) == heads
        taken = [p for sched, http in head_ports for p in (*range(sched, sched + 6), http)]
        taken += [p for ports in workers.values() for p in ports]
        assert len(set(taken)) == len(taken) == 7 * heads + 6, taken
        assert {role: len(ports) for role, ports in workers.items()} == counts


def test_blocks_handed_out_before_anything_binds_them_never_overlap():
    taken: list[int] = []
    for _ in range(100):  # a worker's --master-port picked after its deployment's block, say
        base = free_port_block(8)
        taken += range(base, base + 8)
    assert len(set(taken)) == len(taken)
