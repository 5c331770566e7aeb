from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from pytest_django import DjangoAssertNumQueries, Settings

from tenants.exceptions import KeyExpired, KeyRevoked
from tenants.models import ApiKey, ApiKeySecret, AuditEvent, Project, Tenant
from tenants.selectors import masked_key, valid_secrets
from tenants.services import (
    IssuedKey,
    issue_key,
    revoke_key,
    rotate_key,
    set_tenant_status,
    touch_last_used,
)
from tests.support.api_keys import authenticated_key

pytestmark = pytest.mark.django_db


def test_a_fresh_key_authenticates_with_everything_loaded(
    issued: IssuedKey, django_assert_num_queries: DjangoAssertNumQueries
) -> None:
    with django_assert_num_queries(1):
        api_key = authenticated_key(issued.plaintext)
        assert api_key is not None
        # Loaded by the same query: the gateway needs them on every request.
        assert api_key.project.tenant.plan.name == "standard"
    assert api_key.pk == issued.api_key.pk


def test_authentication_does_not_write(issued: IssuedKey) -> None:
    before = ApiKey.objects.values().get(pk=issued.api_key.pk)
    events = AuditEvent.objects.count()
    assert authenticated_key(issued.plaintext) is not None
    assert ApiKey.objects.values().get(pk=issued.api_key.pk) == before
    assert AuditEvent.objects.count() == events


def test_wrong_secret_with_a_known_prefix_is_rejected(issued: IssuedKey) -> None:
    tampered = issued.plaintext[:-1] + ("A" if issued.plaintext[-1] != "A" else "B")
    assert authenticated_key(tampered) is None


def test_unknown_and_malformed_keys_are_rejected(issued: IssuedKey) -> None:
    assert authenticated_key("tgk_" + "x" * 12 + "_" + "y" * 40) is None
    assert authenticated_key("") is None
    assert authenticated_key(issued.plaintext + "x") is None
    assert authenticated_key(issued.plaintext.upper()) is None


def test_changing_the_pepper_invalidates_existing_keys(
    issued: IssuedKey, settings: Settings
) -> None:
    assert authenticated_key(issued.plaintext) is not None
    settings.TOLLGATE_KEY_PEPPER = "a-new-pepper"
    assert authenticated_key(issued.plaintext) is None


def test_plaintext_is_not_stored_in_any_key_or_audit_column(issued: IssuedKey) -> None:
    rotated = rotate_key(issued.api_key, actor="test", grace_seconds=60)
    revoke_key(issued.api_key, actor="test")
    for plaintext in (issued.plaintext, rotated.plaintext):
        secret_part = plaintext.rsplit("_", 1)[1]
        for model in (ApiKeySecret, ApiKey, AuditEvent):
            columns = [f.attname for f in model._meta.concrete_fields]
            rows = list(model.objects.values_list(*columns))
            assert rows
            for row in rows:
                for value in row:
                    assert secret_part not in str(value), f"{model.__name__} leaks the secret"


def test_plaintext_is_not_stored_in_any_table(issued: IssuedKey) -> None:
    secret_part = issued.plaintext.rsplit("_", 1)[1]
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            name = connection.ops.quote_name(table)
            cursor.execute(
                f"SELECT count(*) FROM {name} t WHERE t::text LIKE %s", [f"%{secret_part}%"]
            )
            assert cursor.fetchone()[0] == 0, f"{table} contains the secret"
        # The check above can find things: the digest is stored and is found the same way.
        digest = ApiKeySecret.objects.get(api_key=issued.api_key).digest
        cursor.execute(
            "SELECT count(*) FROM tenants_apikeysecret t WHERE t::text LIKE %s", [f"%{digest}%"]
        )
        assert cursor.fetchone()[0] == 1


def test_issued_key_repr_hides_the_plaintext(issued: IssuedKey) -> None:
    assert issued.plaintext not in repr(issued)
    assert issued.masked in masked_key(issued.api_key)


def test_rotation_without_grace_kills_the_old_secret_at_once(issued: IssuedKey) -> None:
    rotated = rotate_key(issued.api_key, actor="test")
    assert rotated.api_key.pk == issued.api_key.pk
    assert rotated.plaintext != issued.plaintext
    assert authenticated_key(issued.plaintext) is None
    assert authenticated_key(rotated.plaintext) == issued.api_key
    old = ApiKeySecret.objects.get(prefix=issued.plaintext[4:16])
    assert old.revoked_at is not None
    assert masked_key(issued.api_key) == rotated.masked


def test_rotation_with_grace_keeps_the_old_secret_until_expiry(issued: IssuedKey) -> None:
    before = timezone.now()
    rotated = rotate_key(issued.api_key, actor="test", grace_seconds=300)
    after = timezone.now()
    old = ApiKeySecret.objects.get(prefix=issued.plaintext[4:16])
    assert old.revoked_at is None
    assert old.expires_at is not None
    assert before + timedelta(seconds=300) <= old.expires_at <= after + timedelta(seconds=300)

    assert authenticated_key(issued.plaintext) == issued.api_key
    assert authenticated_key(issued.plaintext, now=after + timedelta(seconds=299)) == issued.api_key
    assert authenticated_key(issued.plaintext, now=old.expires_at) is None
    assert authenticated_key(issued.plaintext, now=after + timedelta(seconds=301)) is None
    # The new secret is unaffected by the old one's deadline.
    assert authenticated_key(rotated.plaintext, now=after + timedelta(days=30)) == issued.api_key
    assert masked_key(issued.api_key) == rotated.masked


def test_a_second_graceful_rotation_does_not_extend_the_first_deadline(issued: IssuedKey) -> None:
    second = rotate_key(issued.api_key, actor="test", grace_seconds=60)
    third = rotate_key(issued.api_key, actor="test", grace_seconds=3600)
    first_secret = ApiKeySecret.objects.get(prefix=issued.plaintext[4:16])
    second_secret = ApiKeySecret.objects.get(prefix=second.plaintext[4:16])
    assert first_secret.expires_at is not None and second_secret.expires_at is not None
    assert second_secret.expires_at - first_secret.expires_at > timedelta(seconds=3000)
    later = timezone.now() + timedelta(seconds=120)
    assert authenticated_key(issued.plaintext, now=later) is None
    assert authenticated_key(second.plaintext, now=later) == issued.api_key
    assert authenticated_key(third.plaintext, now=later) == issued.api_key
    assert len(valid_secrets(issued.api_key, now=later)) == 2


def test_rotation_refuses_a_revoked_key(issued: IssuedKey) -> None:
    revoke_key(issued.api_key, actor="test")
    with pytest.raises(KeyRevoked, match=issued.api_key.public_id):
        rotate_key(issued.api_key, actor="test")
    assert issued.api_key.secrets.count() == 1


def test_rotation_refuses_an_expired_key(project: Project) -> None:
    issued = issue_key(project, actor="test", expires_at=timezone.now() + timedelta(seconds=1))
    ApiKey.objects.filter(pk=issued.api_key.pk).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    with pytest.raises(KeyExpired):
        rotate_key(issued.api_key, actor="test")


def test_rotation_refuses_a_negative_grace(issued: IssuedKey) -> None:
    with pytest.raises(ValueError, match="grace"):
        rotate_key(issued.api_key, actor="test", grace_seconds=-1)


def test_revocation_kills_every_secret_and_is_idempotent(issued: IssuedKey) -> None:
    graceful = rotate_key(issued.api_key, actor="test", grace_seconds=3600)
    current = rotate_key(issued.api_key, actor="test", grace_seconds=3600)
    assert authenticated_key(graceful.plaintext) is not None

    assert revoke_key(issued.api_key, actor="test") is True
    assert issued.api_key.revoked_at is not None
    for plaintext in (issued.plaintext, graceful.plaintext, current.plaintext):
        assert authenticated_key(plaintext) is None
    assert not ApiKeySecret.objects.filter(api_key=issued.api_key, revoked_at__isnull=True).exists()

    events = AuditEvent.objects.filter(action="key.revoked").count()
    revoked_at = ApiKey.objects.get(pk=issued.api_key.pk).revoked_at
    assert revoke_key(issued.api_key, actor="test") is False
    assert AuditEvent.objects.filter(action="key.revoked").count() == events == 1
    assert ApiKey.objects.get(pk=issued.api_key.pk).revoked_at == revoked_at


def test_expired_key_is_rejected(project: Project) -> None:
    expires_at = timezone.now() + timedelta(hours=1)
    issued = issue_key(project, actor="test", expires_at=expires_at)
    assert authenticated_key(issued.plaintext, now=expires_at - timedelta(seconds=1)) is not None
    assert authenticated_key(issued.plaintext, now=expires_at) is None
    assert authenticated_key(issued.plaintext, now=expires_at + timedelta(days=1)) is None


def test_a_key_cannot_be_issued_already_expired(project: Project) -> None:
    with pytest.raises(ValueError, match="future"):
        issue_key(project, actor="test", expires_at=timezone.now() - timedelta(seconds=1))
    assert not ApiKey.objects.filter(project=project).exists()


def test_suspended_tenant_keys_are_rejected_until_reactivated(
    tenant: Tenant, issued: IssuedKey
) -> None:
    set_tenant_status(tenant, Tenant.Status.SUSPENDED, actor="test")
    assert authenticated_key(issued.plaintext) is None
    set_tenant_status(tenant, Tenant.Status.ACTIVE, actor="test")
    assert authenticated_key(issued.plaintext) == issued.api_key


def test_touch_last_used_updates_in_bulk_and_never_goes_backwards(project: Project) -> None:
    first = issue_key(project, actor="test").api_key
    second = issue_key(project, actor="test").api_key
    untouched = issue_key(project, actor="test").api_key
    now = timezone.now()

    assert touch_last_used([first.pk, second.pk], now) == 2
    assert touch_last_used([first.pk], now - timedelta(minutes=5)) == 0
    assert touch_last_used([], now) == 0

    last_used = dict(ApiKey.objects.values_list("pk", "last_used_at"))
    assert last_used[first.pk] == now
    assert last_used[second.pk] == now
    assert last_used[untouched.pk] is None
