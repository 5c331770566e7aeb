from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from tenants.models import ApiKey, ApiKeySecret, AuditEvent, Plan, Tenant
from tenants.services import IssuedKey
from tests.support.api_keys import authenticated_key

pytestmark = pytest.mark.django_db


def test_changelists_render(admin_client: Client, issued: IssuedKey) -> None:
    for model in ("plan", "tenant", "project", "apikey", "auditevent"):
        response = admin_client.get(reverse(f"admin:tenants_{model}_changelist"))
        assert response.status_code == 200, model


def test_api_key_page_shows_the_masked_form_and_never_the_digest(
    admin_client: Client, issued: IssuedKey
) -> None:
    secret = ApiKeySecret.objects.get(api_key=issued.api_key)
    for url in (
        reverse("admin:tenants_apikey_change", args=[issued.api_key.pk]),
        reverse("admin:tenants_apikey_changelist"),
    ):
        page = admin_client.get(url).content.decode()
        assert issued.masked in page
        assert secret.digest not in page
        assert issued.plaintext.rsplit("_", 1)[1] not in page


def test_keys_cannot_be_added_and_audit_events_cannot_be_edited(
    admin_client: Client, issued: IssuedKey
) -> None:
    assert admin_client.get(reverse("admin:tenants_apikey_add")).status_code == 403
    event = AuditEvent.objects.first()
    assert event is not None
    response = admin_client.post(
        reverse("admin:tenants_auditevent_change", args=[event.pk]), {"actor": "forged"}
    )
    assert response.status_code == 403
    assert AuditEvent.objects.get(pk=event.pk).actor == event.actor


def test_revoke_action_goes_through_the_service(
    admin_client: Client, admin_user: User, issued: IssuedKey
) -> None:
    response = admin_client.post(
        reverse("admin:tenants_apikey_changelist"),
        {"action": "revoke_selected", "_selected_action": [issued.api_key.pk]},
    )
    assert response.status_code == 302
    assert authenticated_key(issued.plaintext) is None
    event = AuditEvent.objects.get(action="key.revoked")
    assert event.actor == f"user:{admin_user.username}"


def test_tenant_admin_add_and_plan_change_are_audited(
    admin_client: Client, admin_user: User
) -> None:
    standard = Plan.objects.get(name="standard")
    form = {
        "slug": "umbrella",
        "name": "Umbrella",
        "plan": standard.pk,
        "alert_thresholds": "[10, 5]",
        "forecast_threshold_percent": "80",  # the admin shows the default
        "status": "active",
        "projects-TOTAL_FORMS": "0",
        "projects-INITIAL_FORMS": "0",
        "memberships-TOTAL_FORMS": "0",
        "memberships-INITIAL_FORMS": "0",
    }
    response = admin_client.post(reverse("admin:tenants_tenant_add"), form)
    assert response.status_code == 302, response.content.decode()[:2000]
    tenant = Tenant.objects.get(slug="umbrella")
    created = AuditEvent.objects.get(action="tenant.created")
    assert (created.target, created.actor) == (tenant.public_id, f"user:{admin_user.username}")

    enterprise = Plan.objects.get(name="enterprise")
    response = admin_client.post(
        reverse("admin:tenants_tenant_change", args=[tenant.pk]),
        {**form, "plan": enterprise.pk, "tokens_per_day": "77"},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    tenant.refresh_from_db()
    assert tenant.plan == enterprise
    assert tenant.tokens_per_day == 77
    actions = set(AuditEvent.objects.filter(tenant=tenant).values_list("action", flat=True))
    assert actions == {"tenant.created", "tenant.plan_changed", "tenant.limits_changed"}
    assert ApiKey.objects.count() == 0


def test_invitations_are_listed_without_secrets_and_revoked_through_the_service(
    admin_client: Client, tenant
) -> None:
    from tenants.models import AuditEvent, Invitation
    from tenants.membership import invite_member

    invited = invite_member(tenant, "new@acme.test", role="admin", actor="user:owner",
                            accept_url=lambda secret: f"http://testserver/console/invite/{secret}/")
    invitation = Invitation.objects.get()
    page = admin_client.get(f"/admin/tenants/invitation/{invitation.pk}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "new@acme.test" in html and invitation.digest not in html
    assert invited.accept_url not in html and "/console/invite/" not in html
    response = admin_client.post("/admin/tenants/invitation/", {
        "action": "revoke_selected", "_selected_action": [invitation.pk]})
    assert response.status_code == 302
    invitation.refresh_from_db()
    assert invitation.revoked_at is not None
    assert AuditEvent.objects.filter(action="invitation.revoke", target=invitation.public_id
                                     ).exists()
