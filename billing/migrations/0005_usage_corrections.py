"""Ledger rows learn how a sweep charged (sweep_basis), keep what it charged when a late settle
or release corrects them (swept_* and corrected_at), carry the tokens used above the hold
(over_hold_tokens, for /metrics), and may be "unmetered" (a fail-open call without a hold).

Existing rows get their over_hold_tokens computed once here; the drain fills it from now on."""

from django.db import migrations, models
from django.db.models import F


def fill_over_hold(apps, schema_editor):
    usage = apps.get_model("billing", "UsageRecord")
    # One UPDATE: only rows with a hold (held > 0) whose usage went above it.
    usage.objects.filter(held_tokens__gt=0).annotate(
        total=F("input_tokens") + F("output_tokens")).filter(
        total__gt=F("held_tokens")).update(
        over_hold_tokens=F("input_tokens") + F("output_tokens") - F("held_tokens"))


class Migration(migrations.Migration):

    dependencies = [
        ("billing", "0004_webhook_delivery_public_id"),
    ]

    operations = [
        migrations.AlterField(
            model_name="usagerecord",
            name="status",
            field=models.CharField(
                choices=[
                    ("settled", "Settled with the upstream's usage"),
                    ("partial", "Settled with what was produced (stream cut, client left, no usage)"),
                    ("released", "Released: the upstream produced nothing"),
                    ("swept", "Swept: the gateway process never ended its hold"),
                    ("unmetered", "Unmetered: admitted without a hold while the quota store was down"),
                ],
                max_length=16,
            ),
        ),
        migrations.AddField(
            model_name="usagerecord",
            name="sweep_basis",
            field=models.CharField(
                blank=True,
                choices=[
                    ("reserved", "Never forwarded: nothing charged"),
                    ("forwarded", "Reached the upstream (not streamed): the full hold charged"),
                    ("streaming", "Streaming: the input and the last output checkpoint charged"),
                ],
                max_length=16,
            ),
        ),
        migrations.AddField(
            model_name="usagerecord",
            name="swept_input_tokens",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="usagerecord",
            name="swept_output_tokens",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="usagerecord",
            name="swept_cost_micros",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="usagerecord",
            name="corrected_at",
            field=models.DateTimeField(
                blank=True, help_text="When the late settle or release ended (Redis clock).",
                null=True),
        ),
        migrations.AddField(
            model_name="usagerecord",
            name="over_hold_tokens",
            field=models.BigIntegerField(default=0),
        ),
        migrations.RunPython(fill_over_hold, migrations.RunPython.noop),
        migrations.AddIndex(
            model_name="usagerecord",
            index=models.Index(condition=models.Q(("corrected_at__isnull", False)),
                               fields=["corrected_at"], name="usage_corrected"),
        ),
        migrations.AddIndex(
            model_name="usagerecord",
            index=models.Index(condition=models.Q(("over_hold_tokens__gt", 0)),
                               fields=["over_hold_tokens"], name="usage_over_hold"),
        ),
        migrations.AddConstraint(
            model_name="usagerecord",
            constraint=models.CheckConstraint(condition=models.Q(("over_hold_tokens__gte", 0)),
                                              name="usage_over_hold_non_negative"),
        ),
    ]
