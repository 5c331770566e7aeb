"""The ledger keeps token classes apart: a usage row's cached input, cache-write and reasoning
tokens (each part of its total; 0 for existing rows), and a reconciliation row's classes on both
sides with the bill's usage at our prices."""

import django.db.models.expressions
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('billing', '0008_pace_trips'),
        ('gateway', '0004_token_class_prices_provider_kind'),
        ('tenants', '0008_seed_plan_pace'),
    ]

    operations = [
        migrations.AddField(
            model_name='reconciliationrow',
            name='ours_cache_write',
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='reconciliationrow',
            name='ours_cached_input',
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='reconciliationrow',
            name='ours_reasoning',
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='reconciliationrow',
            name='theirs_cache_write',
            field=models.BigIntegerField(blank=True, help_text='Empty: the bill does not say.', null=True),
        ),
        migrations.AddField(
            model_name='reconciliationrow',
            name='theirs_cached_input',
            field=models.BigIntegerField(blank=True, help_text='Empty: the bill does not say.', null=True),
        ),
        migrations.AddField(
            model_name='reconciliationrow',
            name='theirs_priced_micros',
            field=models.BigIntegerField(blank=True, help_text="The bill's usage at our prices (each token class at its price, the price of the start of the day); empty: the model has no price.", null=True),
        ),
        migrations.AddField(
            model_name='reconciliationrow',
            name='theirs_reasoning',
            field=models.BigIntegerField(blank=True, help_text='Empty: the bill does not say.', null=True),
        ),
        migrations.AddField(
            model_name='usagerecord',
            name='cache_write_tokens',
            field=models.BigIntegerField(default=0, help_text="Of input_tokens: written to the provider's prompt cache."),
        ),
        migrations.AddField(
            model_name='usagerecord',
            name='cached_input_tokens',
            field=models.BigIntegerField(default=0, help_text="Of input_tokens: read from the provider's prompt cache."),
        ),
        migrations.AddField(
            model_name='usagerecord',
            name='reasoning_tokens',
            field=models.BigIntegerField(default=0, help_text='Of output_tokens: reasoning (thinking).'),
        ),
        migrations.AddConstraint(
            model_name='usagerecord',
            constraint=models.CheckConstraint(condition=models.Q(('cache_write_tokens__gte', 0), ('cached_input_tokens__gte', 0), ('reasoning_tokens__gte', 0), ('reasoning_tokens__lte', models.F('output_tokens')), ('input_tokens__gte', django.db.models.expressions.CombinedExpression(models.F('cached_input_tokens'), '+', models.F('cache_write_tokens')))), name='usage_classes_within_totals'),
        ),
    ]
