"""Credentials from files (mounted Secrets) instead of the environment: redis_url_file and
redis_password_file."""

from __future__ import annotations

import pytest
from redis.connection import parse_url

from batchgate.gateway.config import Settings


def test_the_redis_url_and_password_come_from_files(tmp_path):
    (tmp_path / "url").write_text("rediss://cache.internal:6380/2?ssl_ca_certs=/etc/ca.crt\n")
    (tmp_path / "pw").write_text("p@ss:w/rd%\n")
    s = Settings(redis_url_file=tmp_path / "url")
    assert s.redis_url == "rediss://cache.internal:6380/2?ssl_ca_certs=/etc/ca.crt"
    s = Settings(redis_url="redis://bob@redis:6379/0", redis_password_file=tmp_path / "pw")
    got = parse_url(s.redis_url)  # as redis-py reads it, for the cache and the limiter alike
    assert (got["username"], got["password"], got["host"], got["port"], got["db"]) == (
        "bob", "p@ss:w/rd%", "redis", 6379, 0,
    )  # fmt: skip
    s = Settings(redis_url_file=tmp_path / "url", redis_password_file=tmp_path / "pw")
    assert parse_url(s.redis_url)["password"] == "p@ss:w/rd%" and s.redis_url.endswith(
        "ssl_ca_certs=/etc/ca.crt"
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"redis_url_file": "/nonexistent/url"}, "redis_url_file: cannot read /nonexistent/url"),
        ({"redis_password_file": "PW"}, "redis_password_file needs redis_url"),
        ({"redis_url": "redis://h/0", "redis_password_file": "EMPTY"}, "is empty"),
    ],
)
def test_a_bad_credential_file_is_refused_by_name(tmp_path, kwargs, message):
    (tmp_path / "PW").write_text("x")
    (tmp_path / "EMPTY").write_text("\n")
    kwargs = {k: (tmp_path / v if v in ("PW", "EMPTY") else v) for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        Settings(**kwargs)
