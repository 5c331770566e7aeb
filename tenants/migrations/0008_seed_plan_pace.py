"""The seeded enterprise plan gets a burn-rate breaker (issue 12): at most 25% of a scope's daily
tokens in any 10-minute period, closed for 30 minutes when it goes over. Free and standard stay
without one (free's day is small enough to be its own bound; standard tenants opt in through an
override). A plan an operator has already given a pace rule is left as it is."""

from django.apps.registry import Apps
from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor

# Literal values, as in 0002: a migration keeps meaning what it meant when it was written.
ENTERPRISE_PACE = {"pace_share_percent": 25, "pace_period_seconds": 600,
                   "pace_cooldown_seconds": 1800}


def seed_pace(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    Plan = apps.get_model("tenants", "Plan")
    Plan.objects.filter(name="enterprise", pace_share_percent__isnull=True,
                        pace_spend_micros__isnull=True).update(**ENTERPRISE_PACE)


def unseed_pace(apps: Apps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    Plan = apps.get_model("tenants", "Plan")
    Plan.objects.filter(name="enterprise", **ENTERPRISE_PACE).update(pace_share_percent=None)


class Migration(migrations.Migration):
    dependencies = [("tenants", "0007_pace")]

    operations = [migrations.RunPython(seed_pace, unseed_pace)]
