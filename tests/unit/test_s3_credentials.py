"""The results bucket's credentials (triptych_head.objects.s3_credentials): each from its variable, or
from the file its `<NAME>_FILE` variable names (what the operator mounts), never both."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from triptych_head.objects import StoreError, s3_credentials

WHERE = "--results-store s3://bucket/p/"


def secret_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o440)
    return str(path)


def values(env: dict[str, str]) -> dict[str, str]:
    return {name: found.value for name, found in s3_credentials(WHERE, env).items()}


def test_the_credentials_come_from_the_environment_as_by_hand() -> None:
    env = {"AWS_ACCESS_KEY_ID": "minio", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "AWS_SESSION_TOKEN": "tok"}
    assert values(env) == env


def test_each_credential_comes_from_the_file_its_file_variable_names_less_one_trailing_newline(tmp_path) -> None:
    env = {
        "AWS_ACCESS_KEY_ID_FILE": secret_file(tmp_path, "id", "minio\n"),
        "AWS_SECRET_ACCESS_KEY_FILE": secret_file(tmp_path, "secret", "s3cr3t \n\n"),
        "AWS_SESSION_TOKEN_FILE": secret_file(tmp_path, "session", "tok"),
    }
    assert values(env) == {
        "AWS_ACCESS_KEY_ID": "minio",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t \n",
        "AWS_SESSION_TOKEN": "tok",
    }
    found = s3_credentials(WHERE, env)["AWS_SECRET_ACCESS_KEY"]
    assert found.source == f"AWS_SECRET_ACCESS_KEY_FILE ({tmp_path / 'secret'})"  # what a refused login names


def test_a_variable_and_its_file_both_set_are_refused_naming_both(tmp_path) -> None:
    env = {
        "AWS_ACCESS_KEY_ID": "minio",
        "AWS_ACCESS_KEY_ID_FILE": secret_file(tmp_path, "id", "minio"),
        "AWS_SECRET_ACCESS_KEY": "s3cr3t",
    }
    with pytest.raises(
        StoreError, match=rf"^{WHERE}: AWS_ACCESS_KEY_ID and AWS_ACCESS_KEY_ID_FILE are both set; unset"
    ):
        s3_credentials(WHERE, env)


def test_a_file_that_cannot_be_read_is_refused_naming_the_variable_and_the_path(tmp_path) -> None:
    missing = tmp_path / "nothing-here"
    env = {"AWS_ACCESS_KEY_ID": "minio", "AWS_SECRET_ACCESS_KEY_FILE": str(missing)}
    with pytest.raises(StoreError) as refused:
        s3_credentials(WHERE, env)
    assert str(refused.value) == (
        f"{WHERE}: AWS_SECRET_ACCESS_KEY_FILE {missing}: cannot read it (No such file or directory); "
        "name a file this process reads"
    )


@pytest.mark.parametrize("text", ["", "\n"])
def test_an_empty_file_is_refused_naming_the_variable_and_the_path(tmp_path, text) -> None:
    path = secret_file(tmp_path, "secret", text)
    env = {"AWS_ACCESS_KEY_ID": "minio", "AWS_SECRET_ACCESS_KEY_FILE": path}
    with pytest.raises(StoreError, match=rf"^{WHERE}: AWS_SECRET_ACCESS_KEY_FILE {re.escape(path)} is empty; "):
        s3_credentials(WHERE, env)


def test_a_missing_credential_names_its_variable_and_its_file_variable() -> None:
    with pytest.raises(StoreError) as refused:
        s3_credentials(WHERE, {"AWS_ACCESS_KEY_ID": "minio"})
    assert str(refused.value).startswith(
        f"{WHERE}: AWS_SECRET_ACCESS_KEY not set; give the bucket's credentials in the environment, or each in a "
        "file that AWS_SECRET_ACCESS_KEY_FILE names"
    )
