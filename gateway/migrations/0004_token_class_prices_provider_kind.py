"""Prices per token class (cached input, cache writes, reasoning) on catalog models and price
periods, nullable (null: the class costs its total's price, so existing rows price calls as
before), and the kind of a provider key (the API it speaks; every existing key is OpenAI-
compatible, the default)."""

import django.core.validators
import gateway.models
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('gateway', '0003_prices_aliases'),
    ]

    operations = [
        migrations.AddField(
            model_name='modelprice',
            name='cache_write_micros_per_mtok',
            field=models.BigIntegerField(blank=True, help_text='Micro-dollars per million input tokens written to the prompt cache; empty: the input price.', null=True, validators=[django.core.validators.MinValueValidator(0)]),
        ),
        migrations.AddField(
            model_name='modelprice',
            name='cached_input_micros_per_mtok',
            field=models.BigIntegerField(blank=True, help_text='Micro-dollars per million cached input tokens (prompt-cache reads); empty: the input price.', null=True, validators=[django.core.validators.MinValueValidator(0)]),
        ),
        migrations.AddField(
            model_name='modelprice',
            name='reasoning_micros_per_mtok',
            field=models.BigIntegerField(blank=True, help_text='Micro-dollars per million reasoning (thinking) output tokens; empty: the output price.', null=True, validators=[django.core.validators.MinValueValidator(0)]),
        ),
        migrations.AddField(
            model_name='modelspec',
            name='cache_write_micros_per_mtok',
            field=models.BigIntegerField(blank=True, help_text='Micro-dollars per million input tokens written to the prompt cache; empty: the input price.', null=True, validators=[django.core.validators.MinValueValidator(0)]),
        ),
        migrations.AddField(
            model_name='modelspec',
            name='cached_input_micros_per_mtok',
            field=models.BigIntegerField(blank=True, help_text='Micro-dollars per million cached input tokens (prompt-cache reads); empty: the input price.', null=True, validators=[django.core.validators.MinValueValidator(0)]),
        ),
        migrations.AddField(
            model_name='modelspec',
            name='reasoning_micros_per_mtok',
            field=models.BigIntegerField(blank=True, help_text='Micro-dollars per million reasoning (thinking) output tokens; empty: the output price.', null=True, validators=[django.core.validators.MinValueValidator(0)]),
        ),
        migrations.AddField(
            model_name='providerkey',
            name='kind',
            field=models.CharField(choices=[('openai', 'OpenAI-compatible (chat, completions, embeddings, responses, moderations)'), ('anthropic', 'Anthropic (the Messages API)')], default='openai', help_text="The API the key speaks: it serves only calls of that API's endpoints.", max_length=16),
        ),
        migrations.AlterField(
            model_name='providerkey',
            name='base_url',
            field=models.CharField(help_text='API root with its version path: https://api.openai.com/v1 (OpenAI-compatible) or https://api.anthropic.com/v1 (Anthropic).', max_length=500, validators=[gateway.models.validate_base_url]),
        ),
        migrations.AddConstraint(
            model_name='modelprice',
            constraint=models.CheckConstraint(condition=models.Q(models.Q(('cached_input_micros_per_mtok__isnull', True), ('cached_input_micros_per_mtok__gte', 0), _connector='OR'), models.Q(('cache_write_micros_per_mtok__isnull', True), ('cache_write_micros_per_mtok__gte', 0), _connector='OR'), models.Q(('reasoning_micros_per_mtok__isnull', True), ('reasoning_micros_per_mtok__gte', 0), _connector='OR')), name='price_class_prices_non_negative'),
        ),
        migrations.AddConstraint(
            model_name='modelspec',
            constraint=models.CheckConstraint(condition=models.Q(models.Q(('cached_input_micros_per_mtok__isnull', True), ('cached_input_micros_per_mtok__gte', 0), _connector='OR'), models.Q(('cache_write_micros_per_mtok__isnull', True), ('cache_write_micros_per_mtok__gte', 0), _connector='OR'), models.Q(('reasoning_micros_per_mtok__isnull', True), ('reasoning_micros_per_mtok__gte', 0), _connector='OR')), name='modelspec_class_prices_non_negative'),
        ),
    ]
