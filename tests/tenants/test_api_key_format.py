from __future__ import annotations

import hashlib
import hmac
import re

import pytest
from django.core.exceptions import ImproperlyConfigured
from pytest_django import Settings

from tenants.api_key_format import digest_key, digests_match, generate_key, mask_plaintext, masked, parse_key

KEY_RE = re.compile(r"tgk_[0-9A-Za-z]{12}_[0-9A-Za-z]{40}")


def test_generated_key_has_the_documented_format() -> None:
    plaintext, prefix, digest, last4 = generate_key()
    assert KEY_RE.fullmatch(plaintext)
    assert plaintext.startswith(f"tgk_{prefix}_")
    assert last4 == plaintext[-4:]
    assert re.fullmatch(r"[0-9a-f]{64}", digest)


def test_generated_keys_are_unique() -> None:
    keys = {generate_key()[0] for _ in range(200)}
    prefixes = {key[4:16] for key in keys}
    assert len(keys) == 200
    assert len(prefixes) == 200


def test_digest_is_hmac_sha256_with_the_pepper(settings: Settings) -> None:
    settings.TOLLGATE_KEY_PEPPER = "pepper-one"
    plaintext, _, digest, _ = generate_key()
    expected = hmac.new(b"pepper-one", plaintext.encode(), hashlib.sha256).hexdigest()
    assert digest == expected
    assert digest != hashlib.sha256(plaintext.encode()).hexdigest()
    assert digests_match(plaintext, digest)

    settings.TOLLGATE_KEY_PEPPER = "pepper-two"
    assert digest_key(plaintext) != digest
    assert not digests_match(plaintext, digest)


def test_digest_does_not_use_secret_key(settings: Settings) -> None:
    plaintext = generate_key()[0]
    before = digest_key(plaintext)
    settings.SECRET_KEY = "a-completely-different-secret-key-for-this-test"
    assert digest_key(plaintext) == before


def test_an_empty_pepper_is_refused(settings: Settings) -> None:
    settings.TOLLGATE_KEY_PEPPER = ""
    with pytest.raises(ImproperlyConfigured, match="TOLLGATE_KEY_PEPPER"):
        generate_key()


def test_parse_key_returns_the_prefix() -> None:
    plaintext, prefix, _, _ = generate_key()
    assert parse_key(plaintext) == prefix


@pytest.mark.parametrize(
    "candidate",
    [
        "",
        "tgk_",
        "sk-abc123",
        "tgk_" + "a" * 12 + "_" + "b" * 39,  # secret too short
        "tgk_" + "a" * 12 + "_" + "b" * 41,  # secret too long
        "tgk_" + "a" * 11 + "_" + "b" * 40,  # prefix too short
        "tgk_" + "a" * 13 + "_" + "b" * 40,  # prefix too long
        "tgx_" + "a" * 12 + "_" + "b" * 40,  # wrong scheme
        "TGK_" + "a" * 12 + "_" + "b" * 40,
        "tgk-" + "a" * 12 + "_" + "b" * 40,
        "tgk_" + "a" * 12 + "-" + "b" * 40,
        "tgk_" + "a" * 11 + "!" + "_" + "b" * 40,  # non-base62
        "tgk_" + "a" * 12 + "_" + "b" * 39 + "é",
        "tgk_" + "a" * 12 + "_" + "b" * 39 + "٣",  # a non-ASCII digit
        " tgk_" + "a" * 12 + "_" + "b" * 40,
        "tgk_" + "a" * 12 + "_" + "b" * 40 + "\n",
        "Bearer tgk_" + "a" * 12 + "_" + "b" * 40,
        None,
        42,
        b"tgk_" + b"a" * 12 + b"_" + b"b" * 40,
    ],
)
def test_parse_key_rejects_malformed_keys(candidate: object) -> None:
    assert parse_key(candidate) is None


def test_masked_form_shows_prefix_and_last4_only() -> None:
    plaintext, prefix, _, last4 = generate_key()
    assert masked(prefix, last4) == f"tgk_{prefix}_…{last4}"
    assert mask_plaintext(plaintext) == masked(prefix, last4)
    assert plaintext[16:-4] not in mask_plaintext(plaintext)


def test_mask_plaintext_refuses_garbage() -> None:
    with pytest.raises(ValueError):
        mask_plaintext("not-a-key")
