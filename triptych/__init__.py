"""Triptych: disaggregated diffusion serving.

This package holds what every deployable shares: roles, the port convention, the wire
protocol and the `triptych` command line. The head, worker and operator packages import it;
nothing here imports them at module import time.
"""

__version__ = "0.1.0"
