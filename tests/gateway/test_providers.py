"""Provider secrets encrypted at rest, the in-process provider pool, provider_add, the admin."""

from __future__ import annotations

import json
import logging
from io import StringIO
from typing import Any

import pytest
from cryptography.fernet import Fernet
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.urls import reverse

from gateway.crypto import (
    SecretDecryptionError,
    decrypt_secret,
    derive_fallback_key,
    encrypt_secret,
)
from gateway.models import ProviderKey
from gateway.providers import (
    KEY_BREAKER,
    ProviderPool,
    Upstream,
    create_provider_key,
    load_pool,
    reencrypt_provider_secrets,
    set_provider_secret,
    update_provider_key,
)
from tenants.models import AuditEvent, Tenant
from tenants.services import create_tenant

SECRET = "sk-proj-TESTsecretValue0123456789abcdefXYZ9"
KEY_OLD = Fernet.generate_key().decode()
KEY_NEW = Fernet.generate_key().decode()


def upstream(id: int, *, priority: int = 0, models: tuple[str, ...] = (),
             tenant_id: int | None = None, kind: str = "openai") -> Upstream:
    return Upstream(
        id=id,
        public_id=f"pk_{id}",
        base_url=f"https://u{id}.test/v1",
        secret=f"secret-{id}",
        rpm_capacity=None,
        tpm_capacity=None,
        priority=priority,
        models=frozenset(models),
        tenant_id=tenant_id,
        kind=kind,
    )


def ids(upstreams: list[Upstream]) -> list[int]:
    return [u.id for u in upstreams]


@pytest.fixture
def acme(db: None) -> Tenant:
    return create_tenant("acme", plan_name="standard", actor="test")


@pytest.fixture
def globex(db: None) -> Tenant:
    return create_tenant("globex", plan_name="standard", actor="test")


# --- encryption --------------------------------------------------------------------------------


def test_round_trip_and_ciphertext_hides_the_plaintext(settings: Any):
    settings.TOLLGATE_ENCRYPTION_KEYS = KEY_OLD
    token = encrypt_secret(SECRET)
    assert SECRET not in token and SECRET[-8:] not in token
    assert decrypt_secret(token) == SECRET
    assert encrypt_secret(SECRET) != token  # random IV: equal secrets do not look equal


def test_rotation_old_ciphertexts_still_decrypt_after_a_new_first_key(settings: Any):
    settings.TOLLGATE_ENCRYPTION_KEYS = KEY_OLD
    old_token = encrypt_secret(SECRET)

    settings.TOLLGATE_ENCRYPTION_KEYS = f"{KEY_NEW}, {KEY_OLD}"
    assert decrypt_secret(old_token) == SECRET
    new_token = encrypt_secret("another")

    settings.TOLLGATE_ENCRYPTION_KEYS = KEY_NEW  # the new first key encrypted it
    assert decrypt_secret(new_token) == "another"
    with pytest.raises(SecretDecryptionError):
        decrypt_secret(old_token)


def test_keys_may_be_given_as_a_list(settings: Any):
    settings.TOLLGATE_ENCRYPTION_KEYS = [KEY_NEW, KEY_OLD]
    assert decrypt_secret(encrypt_secret(SECRET)) == SECRET


def test_outside_production_the_key_is_derived_from_secret_key(settings: Any):
    settings.TOLLGATE_ENCRYPTION_KEYS = ""
    settings.SECRET_KEY = "one-secret-key"
    token = encrypt_secret(SECRET)
    assert Fernet(derive_fallback_key("one-secret-key")).decrypt(token.encode()) == SECRET.encode()

    settings.SECRET_KEY = "another-secret-key"
    with pytest.raises(SecretDecryptionError):
        decrypt_secret(token)


def test_production_requires_encryption_keys(settings: Any):
    settings.TOLLGATE_ENV = "production"
    settings.TOLLGATE_ENCRYPTION_KEYS = ""
    with pytest.raises(ImproperlyConfigured, match="TOLLGATE_ENCRYPTION_KEYS"):
        encrypt_secret(SECRET)


def test_an_invalid_key_is_a_configuration_error(settings: Any):
    settings.TOLLGATE_ENCRYPTION_KEYS = "not-a-fernet-key"
    with pytest.raises(ImproperlyConfigured):
        encrypt_secret(SECRET)


def test_tampered_ciphertext_is_refused(settings: Any):
    settings.TOLLGATE_ENCRYPTION_KEYS = KEY_OLD
    token = encrypt_secret(SECRET)
    with pytest.raises(SecretDecryptionError):
        decrypt_secret(token[:-4] + ("AAAA" if token[-4:] != "AAAA" else "BBBB"))


# --- services ----------------------------------------------------------------------------------


def _all_stored_text() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM gateway_providerkey")
        rows = cursor.fetchall()
        cursor.execute("SELECT data::text, target FROM tenants_auditevent")
        rows += cursor.fetchall()
    return repr(rows)


@pytest.mark.django_db
def test_the_plaintext_is_never_stored(acme: Tenant):
    key = create_provider_key(
        "openai-main", base_url="https://api.openai.com/v1/", secret=SECRET, tenant=acme
    )
    set_provider_secret(key, SECRET.replace("TEST", "NEXT"), actor="test")

    stored = _all_stored_text()
    assert key.public_id in stored
    for plaintext in (SECRET, SECRET.replace("TEST", "NEXT")):
        assert plaintext not in stored
        assert plaintext[:-4] not in stored
    key.refresh_from_db()
    assert key.secret_last4 == "XYZ9"
    assert key.base_url == "https://api.openai.com/v1"
    assert decrypt_secret(key.secret_encrypted) == SECRET.replace("TEST", "NEXT")
    assert list(AuditEvent.objects.filter(target=key.public_id).values_list("action", flat=True)) \
        == ["provider_key.secret_set", "provider_key.create"]


@pytest.mark.django_db
def test_public_id_shape_and_short_secrets_show_no_last4():
    key = create_provider_key("local", base_url="http://upstream:8000/v1", secret="  short1\n")
    assert key.public_id.startswith("pk_") and len(key.public_id) == 3 + 16
    assert key.public_id[3:].isalnum()
    assert key.secret_last4 == ""
    assert decrypt_secret(key.secret_encrypted) == "short1"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "url",
    [
        "ftp://api.openai.com/v1",
        "api.openai.com/v1",
        "https://",
        "https://user:pass@api.openai.com/v1",
        "https://api.openai.com/v1?key=abc",
        "http://host:notaport/v1",
    ],
)
def test_bad_base_urls_are_refused(url: str):
    with pytest.raises(ValidationError) as excinfo:
        create_provider_key("bad", base_url=url, secret=SECRET)
    assert "base_url" in excinfo.value.message_dict
    assert not ProviderKey.objects.exists()


@pytest.mark.django_db
def test_empty_secrets_and_bad_model_lists_are_refused():
    with pytest.raises(ValueError, match="empty"):
        create_provider_key("k", base_url="https://a.test/v1", secret="   ")
    with pytest.raises(ValidationError):
        create_provider_key("k", base_url="https://a.test/v1", secret=SECRET, models=["a", "a"])


@pytest.mark.django_db
def test_reencrypt_moves_every_secret_to_the_new_key(settings: Any):
    settings.TOLLGATE_ENCRYPTION_KEYS = KEY_OLD
    create_provider_key("a", base_url="https://a.test/v1", secret=SECRET)
    create_provider_key("b", base_url="https://b.test/v1", secret="sk-second-secret-abcdef")

    settings.TOLLGATE_ENCRYPTION_KEYS = f"{KEY_NEW},{KEY_OLD}"
    assert reencrypt_provider_secrets() == 2

    settings.TOLLGATE_ENCRYPTION_KEYS = KEY_NEW  # the old key can now be dropped
    pool = load_pool()
    assert sorted(u.secret for u in pool.candidates("gpt-4o", None, 0.0)) == sorted(
        [SECRET, "sk-second-secret-abcdef"]
    )


# --- the pool ----------------------------------------------------------------------------------


def test_higher_priority_first_and_round_robin_among_equals():
    pool = ProviderPool([upstream(1, priority=0), upstream(2, priority=5), upstream(3, priority=5),
                         upstream(4, priority=5)])
    fronts = []
    for _ in range(6):
        order = ids(pool.candidates("gpt-4o", None, 0.0))
        assert order[-1] == 1
        assert sorted(order[:3]) == [2, 3, 4]
        fronts.append(order[0])
    assert fronts == [2, 3, 4, 2, 3, 4]


def test_keys_in_cooldown_are_skipped_until_it_ends():
    pool = ProviderPool([upstream(1, priority=1), upstream(2)])
    pool.cool_down(1, until=100.0)

    assert pool.in_cooldown(1, now=99.9)
    assert ids(pool.candidates("gpt-4o", None, now=50.0)) == [2]
    assert not pool.in_cooldown(1, now=100.0)
    assert ids(pool.candidates("gpt-4o", None, now=100.0)) == [1, 2]


def test_an_earlier_cooldown_arriving_late_does_not_shorten_a_later_one():
    pool = ProviderPool([upstream(1)])
    pool.cool_down(1, until=200.0)
    pool.cool_down(1, until=150.0)
    assert pool.in_cooldown(1, now=180.0)


def test_serves_checks_existence_without_taking_a_round_robin_turn():
    pool = ProviderPool([
        upstream(1, models=("gpt-4o",)),
        upstream(2, models=("gpt-4o",)),
        upstream(3, models=("gpt-4.1",), tenant_id=7),
    ])
    pool.cool_down(1, until=100.0)
    pool.cool_down(2, until=100.0)

    assert pool.serves("gpt-4o", None)  # cooling down is not "not served"
    assert pool.serves("gpt-4.1", 7)
    assert not pool.serves("gpt-4.1", 8)
    fronts = []
    for _ in range(4):
        assert pool.serves("gpt-4o", None)
        fronts.append(ids(pool.candidates("gpt-4o", None, now=200.0))[0])
    assert fronts == [1, 2, 1, 2]


def test_cooldowns_snapshot_carries_into_a_reloaded_pool():
    old = ProviderPool([upstream(1), upstream(2)])
    old.cool_down(2, until=300.0)
    snapshot = old.cooldowns()
    snapshot[1] = 999.0  # a copy: changing it does not cool key 1 down
    assert not old.in_cooldown(1, now=0.0)

    fresh = ProviderPool([upstream(1), upstream(2)])
    for provider_key_id, until in old.cooldowns().items():
        fresh.cool_down(provider_key_id, until)
    assert ids(fresh.candidates("gpt-4o", None, now=0.0)) == [1]


def test_only_keys_serving_the_model():
    pool = ProviderPool([upstream(1, models=("gpt-4o",)), upstream(2, models=("gpt-4.1",)),
                         upstream(3)])
    assert sorted(ids(pool.candidates("gpt-4o", None, 0.0))) == [1, 3]
    assert ids(pool.candidates("llama-3", None, 0.0)) == [3]


def test_dedicated_keys_first_for_their_tenant_and_never_for_another():
    pool = ProviderPool([
        upstream(1, priority=10),
        upstream(2, tenant_id=7),
        upstream(3, tenant_id=8, priority=99),
    ])
    assert ids(pool.candidates("gpt-4o", 7, 0.0)) == [2, 1]
    assert ids(pool.candidates("gpt-4o", 8, 0.0)) == [3, 1]
    assert ids(pool.candidates("gpt-4o", 9, 0.0)) == [1]
    assert ids(pool.candidates("gpt-4o", None, 0.0)) == [1]


def test_a_call_gets_only_keys_of_its_kind():
    pool = ProviderPool([
        upstream(1, priority=5),
        upstream(2, kind="anthropic", models=("claude-sonnet-4-5",)),
        upstream(3, kind="anthropic", tenant_id=7),
        upstream(4, kind="anthropic", tenant_id=8),
    ])
    # The default is "openai": every caller written before kinds existed is unchanged.
    assert ids(pool.candidates("claude-sonnet-4-5", None, 0.0)) == [1]
    assert ids(pool.candidates("claude-sonnet-4-5", None, 0.0, kind="openai")) == [1]
    assert ids(pool.candidates("claude-sonnet-4-5", 7, 0.0, kind="anthropic")) == [3, 2]
    assert ids(pool.candidates("claude-haiku-4-5", 7, 0.0, kind="anthropic")) == [3]
    assert ids(pool.candidates("claude-haiku-4-5", None, 0.0, kind="anthropic")) == []
    assert pool.serves("claude-sonnet-4-5", None, kind="anthropic")
    assert not pool.serves("claude-haiku-4-5", None, kind="anthropic")
    assert pool.serves("claude-haiku-4-5", None)  # the openai key serves every model
    assert not pool.serves("gpt-4o", None, kind="responses-of-nobody")

    # A breaker on an anthropic key makes anthropic calls wait, never openai ones.
    pool.open_breaker(2, KEY_BREAKER, 30.0)
    assert ids(pool.candidates("claude-sonnet-4-5", None, 0.0, kind="anthropic")) == []
    assert pool.breaker_wait("claude-sonnet-4-5", None, 10.0, kind="anthropic") == 20.0
    assert pool.breaker_wait("claude-sonnet-4-5", None, 10.0) is None
    pool.open_breaker(1, "claude-sonnet-4-5", 40.0)
    assert pool.breaker_wait("claude-sonnet-4-5", None, 10.0) == 30.0
    assert pool.breaker_wait("claude-sonnet-4-5", None, 10.0, kind="anthropic") == 20.0


@pytest.mark.django_db
def test_provider_keys_have_a_kind_that_reaches_the_pool():
    openai = create_provider_key("openai", base_url="https://api.openai.com/v1", secret=SECRET)
    anthropic = create_provider_key("anthropic", base_url="https://api.anthropic.com/v1/",
                                    secret="sk-ant-TESTsecretValue0123456789", kind="anthropic")
    assert (openai.kind, anthropic.kind) == ("openai", "anthropic")
    assert anthropic.base_url == "https://api.anthropic.com/v1"
    created = AuditEvent.objects.get(target=anthropic.public_id, action="provider_key.create")
    assert created.data["kind"] == "anthropic"
    pool = load_pool()
    assert ids(pool.candidates("claude-sonnet-4-5", None, 0.0, kind="anthropic")) == [
        anthropic.pk]
    assert ids(pool.candidates("gpt-4o", None, 0.0)) == [openai.pk]
    assert pool.get(anthropic.pk).kind == "anthropic"

    with pytest.raises(ValidationError) as excinfo:
        create_provider_key("bad", base_url="https://a.test/v1", secret=SECRET, kind="gemini")
    assert "kind" in excinfo.value.message_dict
    anthropic.kind = "openai"
    update_provider_key(anthropic, ["kind"])
    anthropic.refresh_from_db()
    assert anthropic.kind == "openai"
    assert AuditEvent.objects.get(target=anthropic.public_id,
                                  action="provider_key.update").data == {"fields": ["kind"]}


def test_secrets_stay_out_of_reprs():
    assert "secret-1" not in repr(upstream(1))
    assert "secret-1" not in repr(ProviderPool([upstream(1)]).candidates("m", None, 0.0))


@pytest.mark.django_db
def test_load_pool_is_one_query_of_enabled_keys(
    acme: Tenant, globex: Tenant, django_assert_num_queries: Any
):
    shared = create_provider_key("shared", base_url="https://a.test/v1/", secret=SECRET,
                                 priority=1, rpm_capacity=500, tpm_capacity=90_000)
    mine = create_provider_key("acme-own", base_url="https://b.test/v1",
                               secret="sk-acme-0000000000",
                               tenant=acme, models=["gpt-4o"])
    create_provider_key("off", base_url="https://c.test/v1", secret=SECRET, enabled=False)

    with django_assert_num_queries(1):
        pool = load_pool()

    assert len(pool) == 2
    for_acme = pool.candidates("gpt-4o", acme.pk, 0.0)
    assert [u.public_id for u in for_acme] == [mine.public_id, shared.public_id]
    assert for_acme[0].secret == "sk-acme-0000000000"
    assert for_acme[1] == Upstream(
        id=shared.pk, public_id=shared.public_id, base_url="https://a.test/v1", secret=SECRET,
        rpm_capacity=500, tpm_capacity=90_000, priority=1,
    )
    assert [u.public_id for u in pool.candidates("gpt-4o", globex.pk, 0.0)] == [shared.public_id]


@pytest.mark.django_db
def test_a_key_that_cannot_be_decrypted_is_left_out_and_logged(
    settings: Any, caplog: pytest.LogCaptureFixture
):
    settings.TOLLGATE_ENCRYPTION_KEYS = KEY_OLD
    lost = create_provider_key("lost", base_url="https://a.test/v1", secret=SECRET)
    settings.TOLLGATE_ENCRYPTION_KEYS = KEY_NEW
    kept = create_provider_key("kept", base_url="https://b.test/v1", secret=SECRET)

    with caplog.at_level(logging.ERROR, logger="gateway.providers"):
        pool = load_pool()

    assert [u.public_id for u in pool.candidates("gpt-4o", None, 0.0)] == [kept.public_id]
    assert lost.public_id in caplog.text
    assert SECRET not in caplog.text


# --- provider_add ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_provider_add_json(monkeypatch: pytest.MonkeyPatch, acme: Tenant):
    monkeypatch.setenv("OPENAI_KEY_FOR_TEST", SECRET)
    out = StringIO()
    call_command(
        "provider_add", "openai-acme", "--base-url", "https://api.openai.com/v1",
        "--secret-env", "OPENAI_KEY_FOR_TEST", "--models", "gpt-4o, gpt-4o-mini",
        "--rpm", "500", "--tpm", "30000", "--tenant", "acme", "--json", stdout=out,
    )

    data = json.loads(out.getvalue())
    key = ProviderKey.objects.get()
    assert data == {
        "public_id": key.public_id,
        "name": "openai-acme",
        "kind": "openai",
        "base_url": "https://api.openai.com/v1",
        "secret_last4": "XYZ9",
        "models": ["gpt-4o", "gpt-4o-mini"],
        "rpm_capacity": 500,
        "tpm_capacity": 30000,
        "priority": 0,
        "enabled": True,
        "tenant": "acme",
        "default_price": None,
    }
    assert SECRET not in out.getvalue()
    assert key.tenant == acme
    assert decrypt_secret(key.secret_encrypted) == SECRET


@pytest.mark.django_db
def test_provider_add_text_output(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("UPSTREAM_SECRET", "sk-local-mock-000000")
    out = StringIO()
    call_command("provider_add", "mock", "--base-url", "http://127.0.0.1:8001/v1",
                 "--secret-env", "UPSTREAM_SECRET", stdout=out)
    key = ProviderKey.objects.get()
    assert f"Added openai provider key {key.public_id} (mock)" in out.getvalue()
    assert "every model" in out.getvalue()


@pytest.mark.django_db
def test_provider_add_kind(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ANTHROPIC_SECRET", "sk-ant-local-000000000000")
    out = StringIO()
    call_command("provider_add", "claude", "--base-url", "https://api.anthropic.com/v1",
                 "--secret-env", "ANTHROPIC_SECRET", "--kind", "anthropic",
                 "--models", "claude-sonnet-4-5", "--json", stdout=out)
    data = json.loads(out.getvalue())
    key = ProviderKey.objects.get()
    assert (data["kind"], key.kind, key.models) == ("anthropic", "anthropic",
                                                    ["claude-sonnet-4-5"])
    assert ids(load_pool().candidates("claude-sonnet-4-5", None, 0.0, kind="anthropic")) == [
        key.pk]
    # argparse refuses an unknown kind before anything is made.
    with pytest.raises(CommandError, match="invalid choice"):
        call_command("provider_add", "x", "--base-url", "https://a.test/v1",
                     "--secret-env", "ANTHROPIC_SECRET", "--kind", "gemini", stdout=StringIO())
    assert ProviderKey.objects.count() == 1


@pytest.mark.django_db
def test_provider_add_names_a_default_price_for_unpriced_models(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("UPSTREAM_SECRET", "sk-local-mock-000000")
    out = StringIO()
    call_command("provider_add", "mock", "--base-url", "http://127.0.0.1:8001/v1",
                 "--secret-env", "UPSTREAM_SECRET", "--default-price", "2500000,10000000",
                 "--json", stdout=out)
    assert json.loads(out.getvalue())["default_price"] == [2_500_000, 10_000_000]
    key = ProviderKey.objects.get()
    assert (key.default_input_price_micros_per_mtok,
            key.default_output_price_micros_per_mtok) == (2_500_000, 10_000_000)
    with pytest.raises(CommandError, match="IN,OUT"):
        call_command("provider_add", "other", "--base-url", "http://127.0.0.1:8001/v1",
                     "--secret-env", "UPSTREAM_SECRET", "--default-price", "2.5", stdout=out)
    assert ProviderKey.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--base-url", "ftp://api.openai.com/v1", "--secret-env", "PK_SECRET"], "base_url"),
        (["--base-url", "https://a.test/v1", "--secret-env", "PK_UNSET"], "PK_UNSET"),
        (["--base-url", "https://a.test/v1", "--secret-env", "PK_SECRET", "--tenant", "nope"],
         "nope"),
    ],
)
def test_provider_add_errors(monkeypatch: pytest.MonkeyPatch, args: list[str], message: str):
    monkeypatch.setenv("PK_SECRET", SECRET)
    monkeypatch.delenv("PK_UNSET", raising=False)
    with pytest.raises(CommandError, match=message):
        call_command("provider_add", "k", *args, "--json", stdout=StringIO())
    assert not ProviderKey.objects.exists()


# --- admin -------------------------------------------------------------------------------------


def _form(**overrides: Any) -> dict[str, Any]:
    data = {"name": "openai", "kind": "openai", "base_url": "https://api.openai.com/v1",
            "models": "[]",
            "rpm_capacity": "", "tpm_capacity": "", "priority": "0", "enabled": "on",
            "tenant": "", "secret": ""}
    data.update(overrides)
    return data


@pytest.mark.django_db
def test_admin_sets_the_secret_write_only(admin_client: Client):
    add = reverse("admin:gateway_providerkey_add")
    assert "needs a secret" in admin_client.post(add, _form()).content.decode()

    assert admin_client.post(add, _form(secret=SECRET)).status_code == 302
    key = ProviderKey.objects.get()
    assert decrypt_secret(key.secret_encrypted) == SECRET

    change = reverse("admin:gateway_providerkey_change", args=[key.pk])
    for url in (change, reverse("admin:gateway_providerkey_changelist")):
        page = admin_client.get(url).content.decode()
        assert "****XYZ9" in page
        assert SECRET not in page and key.secret_encrypted not in page

    # Editing other fields keeps the secret; a new value replaces it.
    assert admin_client.post(change, _form(priority="3")).status_code == 302
    key.refresh_from_db()
    assert (key.priority, decrypt_secret(key.secret_encrypted)) == (3, SECRET)
    assert admin_client.post(change, _form(secret="sk-rotated-secret-9876")).status_code == 302
    key.refresh_from_db()
    assert (key.secret_last4, decrypt_secret(key.secret_encrypted)) == (
        "9876", "sk-rotated-secret-9876"
    )
    actions = set(AuditEvent.objects.filter(target=key.public_id).values_list("action", flat=True))
    assert actions == {"provider_key.create", "provider_key.update", "provider_key.secret_set"}


@pytest.mark.django_db
def test_admin_shows_and_edits_the_kind(admin_client: Client):
    add = reverse("admin:gateway_providerkey_add")
    assert admin_client.post(add, _form(name="claude", kind="anthropic",
                                        base_url="https://api.anthropic.com/v1",
                                        secret=SECRET)).status_code == 302
    key = ProviderKey.objects.get()
    assert key.kind == "anthropic"
    listing = admin_client.get(reverse("admin:gateway_providerkey_changelist")).content.decode()
    assert "Anthropic (the Messages API)" in listing
    change = reverse("admin:gateway_providerkey_change", args=[key.pk])
    assert 'value="anthropic" selected' in admin_client.get(change).content.decode()
    assert "Select a valid choice" in admin_client.post(
        change, _form(kind="gemini")).content.decode()
    assert admin_client.post(change, _form(kind="openai")).status_code == 302
    key.refresh_from_db()
    assert key.kind == "openai"


@pytest.mark.django_db
def test_admin_form_errors_do_not_echo_the_secret(admin_client: Client):
    page = admin_client.post(
        reverse("admin:gateway_providerkey_add"), _form(base_url="ftp://x", secret=SECRET)
    ).content.decode()
    assert "http:// or https://" in page
    assert SECRET not in page
    assert not ProviderKey.objects.exists()


@pytest.mark.django_db
def test_model_catalog_admin_renders(admin_client: Client):
    page = admin_client.get(reverse("admin:gateway_modelspec_changelist")).content.decode()
    assert "gpt-4o-mini" in page and "text-embedding-3-large" in page
