"""What `triptych serve`'s flag values may be, checked together: each check raises ConfigError naming
the flag, its value and the fix. ServeArgs.validate runs CHECKS in order (the values: config.py);
ServeArgs.check_files runs the file checks as the process starts. The checks live by what they
decide: addresses.py (ports, binds, who talks to whom, keys), limits.py (numbers, time limits,
capacities), head.py (the head's name, results, traces, HTTP and webhooks), roles.py (what one role
does), files.py (the files the flags name)."""

from __future__ import annotations

from collections.abc import Callable

from triptych.config import ServeArgs
from triptych.config_checks.addresses import (
    check_bind_addresses,
    check_control_security,
    check_ports,
    check_server_addr,
    check_worker_lists,
    http_endpoint,
)
from triptych.config_checks.files import (
    check_listed_files,
    check_pool_fits_memory,
    check_tls_files,
    secret_file_warnings,
)
from triptych.config_checks.head import (
    check_http_limits,
    check_otlp_endpoint,
    check_output_path,
    check_results_store,
    check_served_model_name,
)
from triptych.config_checks.limits import check_capacity, check_numbers, check_time_limits, check_transfer
from triptych.config_checks.roles import (
    check_batching,
    check_flags_taken,
    check_full_pipeline,
    check_lora,
    check_model_layout,
    check_reference_urls,
    check_simulation,
)

# In this order: a message names the first problem the flags have, numbers (NaN) before anything compares them.
CHECKS: tuple[Callable[[ServeArgs], None], ...] = (
    check_numbers,
    check_served_model_name,
    check_server_addr,
    check_worker_lists,
    check_ports,
    check_bind_addresses,
    check_transfer,
    check_time_limits,
    check_output_path,
    check_results_store,
    check_otlp_endpoint,
    check_capacity,
    check_full_pipeline,
    check_http_limits,
    check_batching,
    check_reference_urls,
    check_simulation,
    check_control_security,
    check_flags_taken,
    check_lora,
    check_model_layout,
)

__all__ = [
    "CHECKS",
    "check_listed_files",
    "check_otlp_endpoint",
    "check_pool_fits_memory",
    "check_results_store",
    "check_tls_files",
    "http_endpoint",
    "secret_file_warnings",
]
