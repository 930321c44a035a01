"""One Secret type and one redaction: passwords never leave the process in text."""

from __future__ import annotations

import logging

import msgspec
import pytest

from bridge import config as config_mod
from bridge.errors import ConfigError
from bridge.logs import JsonFormatter, TextFormatter
from bridge.secret import MASK, Secret, redact, redact_url, reveal


def test_a_secret_shows_as_a_mask_and_is_revealed_only_on_purpose() -> None:
    s = Secret("hunter2-pw")
    assert repr(s) == "Secret('***')" and str(s) == MASK and f"{s}" == MASK
    assert s.reveal() == "hunter2-pw" and reveal(s) == "hunter2-pw" and reveal(None) is None
    assert s == Secret("hunter2-pw") and s != Secret("other-pw") and bool(Secret("")) is False


def test_every_secret_created_is_redacted_from_any_text() -> None:
    Secret("tok-abc123")
    assert redact("auth failed for tok-abc123 at host") == f"auth failed for {MASK} at host"
    assert redact("nothing here") == "nothing here"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://host:6379/0?password=qs-secret-1", f"redis://host:6379/0?password={MASK}"),
        ("redis://user:pw-in-userinfo@host/0", f"redis://user:{MASK}@host/0"),
        ("redis://host/0?db=1&password=qs-secret-2&x=y", f"redis://host/0?db=1&password={MASK}&x=y"),
        ("nats://host:4222", "nats://host:4222"),
    ],
)
def test_urls_are_shown_without_their_credentials_which_are_then_redacted_everywhere(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    for secret in ("qs-secret-1", "pw-in-userinfo", "qs-secret-2"):
        if secret in url:
            assert secret not in redact(f"connect {url} failed")


def test_a_user_part_alone_is_a_token_where_the_scheme_says_so() -> None:
    """NATS takes ``nats://TOKEN@host``: its connector asks for the user part to be masked too."""
    assert redact_url("nats://tok-in-userinfo@host:4222", token_user=True) == f"nats://{MASK}@host:4222"
    assert "tok-in-userinfo" not in redact("connect nats://tok-in-userinfo@host:4222 failed")
    assert redact_url("nats://u:pw-nats-1@host:4222", token_user=True) == f"nats://u:{MASK}@host:4222"
    assert redact_url("nats://host:4222", token_user=True) == "nats://host:4222"
    assert redact_url("redis://just-a-user@host/0") == "redis://just-a-user@host/0"  # a user name is no secret


def test_config_decodes_a_secret_and_refuses_a_non_string() -> None:
    class Options(config_mod.Struct):
        password: Secret | None = None

    opts = config_mod.convert_options({"password": "from-env-123"}, Options, "sinks[0]")
    assert isinstance(opts.password, Secret) and opts.password.reveal() == "from-env-123"
    assert "from-env-123" not in repr(opts)
    with pytest.raises(ConfigError, match=r"sinks\[0\]"):
        config_mod.convert_options({"password": 5}, Options, "sinks[0]")


@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()])
def test_log_lines_are_redacted(formatter: logging.Formatter) -> None:
    Secret("log-leak-987")
    record = logging.makeLogRecord({"msg": "client said log-leak-987", "levelno": logging.ERROR, "levelname": "ERROR"})
    record.__dict__["error"] = "again log-leak-987"
    line = formatter.format(record)
    assert "log-leak-987" not in line and MASK in line


def test_a_secret_is_not_msgspec_encodable_by_accident() -> None:
    with pytest.raises(TypeError):
        msgspec.json.encode(Secret("enc-secret-1"))


def test_a_config_struct_repr_shows_no_secret_not_even_inside_a_url() -> None:
    class Options(config_mod.Struct):
        url: str
        password: Secret | None = None

    redact_url("redis://h/0?password=repr-leak-42")  # a connector reads its URL through redact_url
    opts = config_mod.convert_options({"url": "redis://h/0?password=repr-leak-42", "password": "pw-leak-43"}, Options, "x")
    shown = repr(opts)
    assert "repr-leak-42" not in shown and "pw-leak-43" not in shown and MASK in shown
