"""Secrets a process takes from its environment: the value itself, or a file the environment names.

A value in the environment reaches every child process (a worker re-executes itself, a multi-GPU role
starts one process per GPU) and shows in /proc/<pid>/environ, so the operator mounts these secrets as
files (0440) and names the file instead: `<NAME>_FILE` for the results store's S3 credentials (the
common `_FILE` convention; triptych_head.objects reads them), `HF_TOKEN_PATH` for the hub token
(huggingface_hub's own variable: it reads the token from that file at each download). By hand,
`AWS_ACCESS_KEY_ID=...` and `HF_TOKEN=...` work as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

FILE_SUFFIX = "_FILE"
HUB_TOKEN_PATH_ENV = "HF_TOKEN_PATH"
S3_ACCESS_KEY_ENV = "AWS_ACCESS_KEY_ID"
S3_SECRET_KEY_ENV = "AWS_SECRET_ACCESS_KEY"
S3_SESSION_TOKEN_ENV = "AWS_SESSION_TOKEN"
S3_CREDENTIAL_ENV = (S3_ACCESS_KEY_ENV, S3_SECRET_KEY_ENV, S3_SESSION_TOKEN_ENV)


class EnvSecretError(ValueError):
    """A secret's variables contradict each other, or its file cannot be used; the message names both."""


@dataclass(frozen=True)
class EnvSecret:
    value: str
    source: str  # where it came from, for messages: "AWS_SECRET_ACCESS_KEY_FILE (/etc/triptych/s3/...)"


def file_variable(name: str) -> str:
    """The variable naming the file that holds `name`'s value: AWS_ACCESS_KEY_ID_FILE."""
    return name + FILE_SUFFIX


def secret_file_variables() -> tuple[str, ...]:
    """Every variable that names a file holding a secret (checked for being open to every user at start-up)."""
    return (HUB_TOKEN_PATH_ENV, *(file_variable(name) for name in S3_CREDENTIAL_ENV))


def read_env_secret(env: Mapping[str, str], name: str) -> EnvSecret | None:
    """`name`'s value: the variable itself, else the content of the file `<name>_FILE` names (one trailing
    newline dropped); None when neither is set (an empty variable counts as unset). EnvSecretError when
    both are set, or the file cannot be read or is empty."""
    value, path = env.get(name), env.get(file_variable(name))
    if value and path:
        raise EnvSecretError(
            f"{name} and {file_variable(name)} are both set; unset one (the file is the safer: "
            "a variable's value reaches every child process)"
        )
    if value:
        return EnvSecret(value, name)
    if not path:
        return None
    return EnvSecret(_read_secret_file(file_variable(name), path), f"{file_variable(name)} ({path})")


def _read_secret_file(variable: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise EnvSecretError(f"{variable} {path}: cannot read it ({reason}); name a file this process reads") from None
    value = text.removesuffix("\n")
    if not value:
        raise EnvSecretError(f"{variable} {path} is empty; write the secret into it, or name another file")
    return value
