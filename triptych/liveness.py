"""How often a worker tells its heads it is alive, and the shortest silence that may count as lost.

A worker sends a Heartbeat every HEARTBEAT_INTERVAL_S (worker/triptych_worker/runtime.py); a head
counts it lost after --disagg-heartbeat-timeout seconds without one. A timeout under two intervals
would lose a healthy worker whenever one heartbeat is a little late (a loaded host, a long
message ahead of it), so ServeArgs refuses it.
"""

from __future__ import annotations

HEARTBEAT_INTERVAL_S = 1.0
MIN_HEARTBEAT_TIMEOUT_INTERVALS = 2
MIN_HEARTBEAT_TIMEOUT_S = MIN_HEARTBEAT_TIMEOUT_INTERVALS * HEARTBEAT_INTERVAL_S
