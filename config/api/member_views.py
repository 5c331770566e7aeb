"""Management API: a tenant's members and invitations.

Members are addressed by username (unique, not sequential, and what people recognise); the
lookup always goes through the tenant's memberships, so a user of another tenant is a 404.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import PermissionDenied, ValidationError
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from config.api.strict_types import StrictJSONTypes
from config.api.tenant_scope import TenantScopedAPIView, get_in_tenant, secret_response
from tenants.invitation_links import invitation_link
from tenants.membership import (
    INVITABLE_ROLES,
    InvitationClosed,
    LastOwner,
    RoleNotAllowed,
    change_member_role,
    invitation_status,
    invite_member,
    members_of,
    remove_member,
    revoke_invitation,
    tenant_invitations,
)
from tenants.models import Invitation, Membership


class MemberSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="user.username", read_only=True)
    username = serializers.CharField(source="user.username", read_only=True)
    # A CharField, not an EmailField: a user made without an email has "", which `format: email`
    # would wrongly promise never happens.
    email = serializers.CharField(source="user.email", read_only=True,
                                  help_text="The user's email address; empty when they have none.")

    class Meta:
        model = Membership
        fields = ["id", "username", "email", "role"]
        read_only_fields = ["id", "username", "email"]


class RoleSerializer(StrictJSONTypes):
    role = serializers.ChoiceField(choices=Membership.Role.choices)


class InvitationSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    status = serializers.SerializerMethodField()

    class Meta:
        model = Invitation
        fields = ["id", "email", "role", "status", "invited_by", "created_at", "expires_at",
                  "accepted_at", "revoked_at"]
        read_only_fields = fields

    def get_status(self, invitation: Invitation) -> str:
        return invitation_status(invitation)


class InviteSerializer(StrictJSONTypes):
    email = serializers.EmailField()
    role = serializers.ChoiceField(choices=INVITABLE_ROLES, default=Membership.Role.ADMIN)


class IssuedInvitationSerializer(InvitationSerializer):
    accept_url = serializers.CharField(read_only=True, help_text="Shown once; share it privately.")
    email_sent = serializers.BooleanField(read_only=True)

    class Meta(InvitationSerializer.Meta):
        fields = [*InvitationSerializer.Meta.fields, "accept_url", "email_sent"]
        read_only_fields = fields


def _as_drf(exc: DjangoValidationError) -> ValidationError:
    return ValidationError(exc.message_dict if hasattr(exc, "error_dict") else exc.messages)


class MemberListView(TenantScopedAPIView, ListAPIView):
    """GET /api/tenants/<tenant_id>/members/."""

    serializer_class = MemberSerializer

    def get_queryset(self) -> Any:
        return members_of(self.tenant())


class MemberDetailView(TenantScopedAPIView):
    """GET, PATCH (role) and DELETE /api/tenants/<tenant_id>/members/<username>/."""

    def member(self, *, manage: bool = False) -> Membership:
        tenant = self.tenant(manage=manage)
        return get_in_tenant(members_of(tenant), "member", user__username=self.kwargs["member_id"])

    @extend_schema(responses=MemberSerializer)
    def get(self, request: Request, tenant_id: str, member_id: str) -> Response:
        return Response(MemberSerializer(self.member()).data)

    @extend_schema(request=RoleSerializer, responses=MemberSerializer)
    def patch(self, request: Request, tenant_id: str, member_id: str) -> Response:
        membership = self.member(manage=True)
        body = RoleSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            change_member_role(membership, body.validated_data["role"], actor=self.actor,
                               by_role=self.principal.role_in(membership.tenant))
        except RoleNotAllowed as exc:
            raise PermissionDenied(str(exc)) from None
        except LastOwner as exc:
            raise ValidationError({"role": [str(exc)]}) from None
        except DjangoValidationError as exc:
            raise _as_drf(exc) from None
        return Response(MemberSerializer(membership).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, tenant_id: str, member_id: str) -> Response:
        membership = self.member(manage=True)
        try:
            remove_member(membership, actor=self.actor,
                          by_role=self.principal.role_in(membership.tenant))
        except RoleNotAllowed as exc:
            raise PermissionDenied(str(exc)) from None
        except LastOwner as exc:
            raise ValidationError({"detail": str(exc)}) from None
        return Response(status=status.HTTP_204_NO_CONTENT)


def accept_url_for(request: Any, secret: str) -> str:
    return invitation_link(request.build_absolute_uri("/"), secret)


class InvitationListView(TenantScopedAPIView, ListAPIView):
    """GET (every invitation, newest first, with its status) and POST (invite) on
    /api/tenants/<tenant_id>/invitations/. The POST answer holds the accept link, once."""

    serializer_class = InvitationSerializer

    def get_queryset(self) -> Any:
        return tenant_invitations(self.tenant())

    @extend_schema(request=InviteSerializer, responses={201: IssuedInvitationSerializer})
    def post(self, request: Request, tenant_id: str) -> Response:
        tenant = self.tenant(manage=True)
        body = InviteSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            issued = invite_member(
                tenant, body.validated_data["email"], role=body.validated_data["role"],
                actor=self.actor, accept_url=lambda secret: accept_url_for(request, secret),
            )
        except DjangoValidationError as exc:
            raise _as_drf(exc) from None
        data = dict(InvitationSerializer(issued.invitation).data)
        data.update(accept_url=issued.accept_url, email_sent=issued.email_sent)
        return secret_response(data, status=status.HTTP_201_CREATED)


class InvitationRevokeView(TenantScopedAPIView):
    """POST /api/tenants/<tenant_id>/invitations/<invitation_id>/revoke."""

    @extend_schema(request=None, responses=InvitationSerializer)
    def post(self, request: Request, tenant_id: str, invitation_id: str) -> Response:
        tenant = self.tenant(manage=True)
        invitation = get_in_tenant(tenant_invitations(tenant), "invitation",
                                   public_id=invitation_id)
        try:
            revoke_invitation(invitation, actor=self.actor)
        except InvitationClosed as exc:
            raise ValidationError({"detail": str(exc)}) from None
        return Response(InvitationSerializer(invitation).data)
