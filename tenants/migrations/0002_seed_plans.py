"""Seed the three plans of DESIGN.md section 6. Operators edit them in the admin afterwards."""

from decimal import Decimal

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

# Literal values, not imports from tenants.models: a migration must keep meaning what it meant
# when it was written, whatever the models later become.
SEEDED_PLANS = [
    {
        "name": "free",
        "display_name": "Free",
        "tokens_per_day": 500_000,
        "tokens_per_minute": -1,
        "requests_per_second": 5,
        "over_quota_policy": "reject",
        "queue_timeout_seconds": 0,
        "queue_priority": 0,
    },
    {
        "name": "standard",
        "display_name": "Standard",
        "tokens_per_day": 5_000_000,
        "tokens_per_minute": -1,
        "requests_per_second": 50,
        "over_quota_policy": "queue",
        "queue_timeout_seconds": 10,
        "queue_priority": 10,
    },
    {
        "name": "enterprise",
        "display_name": "Enterprise",
        "tokens_per_day": 50_000_000,
        "tokens_per_minute": -1,
        "requests_per_second": 500,
        "over_quota_policy": "queue",
        "queue_timeout_seconds": 30,
        "queue_priority": 20,
    },
]


def seed_plans(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    Plan = apps.get_model("tenants", "Plan")
    for values in SEEDED_PLANS:
        # get_or_create: never overwrite a plan an operator already created under that name.
        Plan.objects.get_or_create(
            name=values["name"],
            defaults={**values, "safety_factor": Decimal("1.25"), "allowed_models": []},
        )


def unseed_plans(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    Plan = apps.get_model("tenants", "Plan")
    # Plan is PROTECTed by Tenant.plan, so this refuses to roll back while tenants use a plan.
    Plan.objects.filter(name__in=[values["name"] for values in SEEDED_PLANS]).delete()


class Migration(migrations.Migration):
    dependencies = [("tenants", "0001_initial")]

    operations = [migrations.RunPython(seed_plans, unseed_plans)]
