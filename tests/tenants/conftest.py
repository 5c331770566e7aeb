from __future__ import annotations

import pytest

from tenants.models import Project, Tenant
from tenants.services import IssuedKey, create_project, create_tenant, issue_key


@pytest.fixture
def tenant(db: None) -> Tenant:
    return create_tenant("acme", plan_name="standard", actor="test", name="Acme Corp")


@pytest.fixture
def project(tenant: Tenant) -> Project:
    return create_project(tenant, "web", actor="test")


@pytest.fixture
def issued(project: Project) -> IssuedKey:
    return issue_key(project, actor="test", name="ci")
