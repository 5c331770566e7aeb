from django.db import migrations


class Migration(migrations.Migration):
    """Joins the reconciliation and webhook models, written in parallel."""

    dependencies = [
        ("billing", "0002_reconciliation"),
        ("billing", "0002_webhooks"),
    ]
    operations: list = []
