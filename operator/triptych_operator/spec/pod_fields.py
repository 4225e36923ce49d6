"""Fields every pod-owning section declares the same way (a role pool, the head): its resources,
placement, extra flags and env; and the drain margin both kinds of pod keep before their kill."""

from __future__ import annotations

from triptych_operator.fields import Field

# The worker's own deadline is this much earlier than its drainSeconds, so it exits before the kubelet's SIGKILL.
DRAIN_MARGIN_S = 15
# A day: far beyond any drain, and far below what a process can wait for (threading.TIMEOUT_MAX).
MAX_DRAIN_SECONDS = 86_400


# What a quantity may be, as the API server and the operator check it (fields.QUANTITY_PATTERN, spec/resources.py).
QUANTITIES = (
    " Each value is a Kubernetes quantity, not negative (`500m`, `2`, `1.5Gi`, `128Mi`, `1e3`; the API server "
    "refuses another), and each request at most its limit. An extended resource (a domain outside `kubernetes.io`, "
    "e.g. `example.com/fpga`) is a whole number and is not overcommitted: a request needs a limit equal to it "
    "(write only the limit: the request defaults to it). Huge pages (`hugepages-2Mi`) are whole pages, likewise "
    "not overcommitted, beside a cpu or memory request or limit. Otherwise the pipeline is Invalid, its status "
    "naming the field."
)


def resources_field(who: str) -> Field:
    return Field(
        "resources",
        "object",
        "Requests/limits (CPU, memory, ...) of each pod. The operator sets `nvidia.com/gpu` (and the RDMA "
        "resource) itself; its counts win. A CPU limit also caps the workers' torch CPU threads (one per CPU "
        "of the limit, rounded up and shared by a replica's rank processes, where torch would start one per host "
        "core), unless `OMP_NUM_THREADS` is set." + QUANTITIES
        if who == "role"
        else "Requests/limits (CPU, memory, ...) of the head pod. Its CPU limit sets how many answers the head "
        "encodes at once (one thread per CPU; a 1024x1024 PNG is about 150 ms of CPU: docs/results.md)." + QUANTITIES,
        fields=(Field("requests", "quantity-map"), Field("limits", "quantity-map")),
        doc_type="`requests`/`limits`: map of quantities",
        doc_row=True,
    )


def pod_fields(who: str) -> tuple[Field, ...]:
    """nodeSelector, tolerations, extraArgs, env: the same for the roles and the head."""
    tolerations = "Pod tolerations" + (
        ", added to the default toleration for `nvidia.com/gpu:NoSchedule` (a CPU role has only these)."
        if who == "role"
        else "."
    )
    owned = "`--num-gpus`, `--device`, `--dtype`" if who == "role" else "`--port`, `--disagg-timeout`"
    args = (
        f"More `triptych serve` flags for the {who}, after the operator's; checked as the process checks them. A "
        f"flag the operator sets (e.g. {owned}) is refused, naming the field that sets it."
    )
    if who == "head":
        args += (
            " They also set the HTTP limits: `--max-request-bytes` (default 16MiB), `--max-queued-requests` (a hard"
            " cap; by default none: a request is refused only when it would miss its deadline); `--access-log` logs"
            " a line per request."
        )
    operator_env = (
        "`NCCL_SOCKET_IFNAME` and `GLOO_SOCKET_IFNAME` with several GPUs"
        if who == "role"
        else "`AWS_ACCESS_KEY_ID_FILE` and `AWS_SECRET_ACCESS_KEY_FILE` with `results.s3.credentialsSecret` "
        "(`AWS_ACCESS_KEY_ID` or `AWS_SECRET_ACCESS_KEY` here replaces its `_FILE` too)"
    )
    env = (
        "More container environment variables, each name once. A name the operator also sets takes the value "
        f"given here instead: `HF_HOME` and `HF_TOKEN_PATH` with a hub model (an `HF_TOKEN` here wins over the "
        f"token file), {operator_env}."
    )
    if who == "role":
        env += " `POD_IP` is the operator's (the address the worker announces to its peers) and is refused."
    env_var = Field(
        "", "free", "A core/v1 EnvVar.", fields=(Field("name", "string", required=True),), doc_type="EnvVar"
    )
    return (
        Field("nodeSelector", "string-map", "Pod node selector."),
        Field(
            "tolerations", "array", tolerations, items=Field("", "free", "A core/v1 Toleration.", doc_type="Toleration")
        ),
        Field("extraArgs", "array", args, items=Field("", "string", doc_type="string")),
        Field("env", "array", env, items=env_var),
    )
