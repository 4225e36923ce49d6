"""triptych/urls.py: a URL as logs and error messages show it, without what may be a credential."""

from __future__ import annotations

import pytest

from triptych.urls import shown_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://bot:s3cret@hooks.example.com:8443/in?token=s3cret", "https://hooks.example.com:8443/in"),
        ("http://[::1]/x?k=s3cret", "http://[::1]/x"),
        ("https://bucket.s3.amazonaws.com/a.png?X-Amz-Signature=s3cret#frag", "https://bucket.s3.amazonaws.com/a.png"),
        ("http://user@collector:4318", "http://collector:4318"),
    ],
)
def test_a_url_is_shown_without_its_user_part_query_or_fragment(url: str, shown: str) -> None:
    assert shown_url(url) == shown


@pytest.mark.parametrize("url", ["http://user:s3cret@host:abc/x?t=s3cret", "http://user:s3cret@[::1/x"])
def test_a_url_that_does_not_parse_shows_none_of_its_text(url: str) -> None:
    """urlsplit's ValueError (a port that is not a number, an unclosed `[`) must not hide the URL's
    error behind another, nor show the text the URL could not be read from."""
    shown = shown_url(url)
    assert shown == "http://(a URL that does not parse)" and "s3cret" not in shown
