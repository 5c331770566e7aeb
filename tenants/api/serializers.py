"""Management API representations of tenants. Public ids only: database ids never leave."""

from __future__ import annotations

from rest_framework import serializers

from tenants.models import Tenant


class TenantSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    plan = serializers.CharField(source="plan.name", read_only=True)
    role = serializers.SerializerMethodField()

    class Meta:
        model = Tenant
        fields = ["id", "slug", "name", "plan", "status", "role", "created_at"]
        read_only_fields = fields

    def get_role(self, tenant: Tenant) -> str | None:
        principal = self.context.get("principal")
        return principal.role_in(tenant) if principal is not None else None
