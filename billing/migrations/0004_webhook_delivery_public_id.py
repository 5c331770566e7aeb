"""Webhook deliveries get a random public id (dlv_...) for the API and the console; existing
rows get one each before the column becomes unique."""

from django.db import migrations, models

import billing.models


def fill_public_ids(apps, schema_editor):
    delivery = apps.get_model("billing", "WebhookDelivery")
    for row in delivery.objects.filter(public_id__isnull=True).only("pk").iterator():
        delivery.objects.filter(pk=row.pk).update(public_id=billing.models.new_delivery_id())


class Migration(migrations.Migration):

    dependencies = [
        ("billing", "0003_merge"),
    ]

    operations = [
        migrations.AddField(
            model_name="webhookdelivery",
            name="public_id",
            field=models.CharField(editable=False, max_length=32, null=True),
        ),
        migrations.RunPython(fill_public_ids, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="webhookdelivery",
            name="public_id",
            field=models.CharField(default=billing.models.new_delivery_id, editable=False,
                                   max_length=32, unique=True),
        ),
    ]
