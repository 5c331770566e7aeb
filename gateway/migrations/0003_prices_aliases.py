"""Model prices move from billing to the gateway app, model aliases and provider keys' default
prices arrive.

ModelPrice keeps its table (billing_modelprice): this migration only adds it to the gateway's
state, and billing's migration "prices_moved_to_gateway" removes it from billing's state, neither
touching the database. It depends on billing 0001 so that the table exists before any later
gateway migration alters it.
"""
import django.core.validators
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("gateway", "0002_seed_models"),
        ("billing", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="ModelPrice",
                    fields=[
                        ("id", models.BigAutoField(auto_created=True, primary_key=True,
                                                   serialize=False, verbose_name="ID")),
                        ("model", models.CharField(
                            help_text='The catalog name, e.g. "gpt-4o" (not an alias: aliases '
                            "take their model's price).", max_length=200)),
                        ("input_micros_per_mtok", models.BigIntegerField(
                            validators=[django.core.validators.MinValueValidator(0)])),
                        ("output_micros_per_mtok", models.BigIntegerField(
                            validators=[django.core.validators.MinValueValidator(0)])),
                        ("valid_from", models.DateTimeField()),
                        ("valid_to", models.DateTimeField(blank=True,
                                                          help_text="Exclusive; empty: open.",
                                                          null=True)),
                    ],
                    options={
                        "verbose_name": "model price",
                        "db_table": "billing_modelprice",
                        "ordering": ["model", "-valid_from"],
                        "constraints": [
                            models.CheckConstraint(
                                condition=models.Q(("input_micros_per_mtok__gte", 0),
                                                   ("output_micros_per_mtok__gte", 0)),
                                name="price_non_negative"),
                            models.CheckConstraint(
                                condition=models.Q(("valid_to__isnull", True),
                                                   ("valid_to__gt", models.F("valid_from")),
                                                   _connector="OR"),
                                name="price_period_ordered"),
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.CreateModel(
            name="ModelAlias",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False,
                                           verbose_name="ID")),
                ("alias", models.CharField(
                    help_text='The name clients or bills use, e.g. "gpt-4o-2024-08-06".',
                    max_length=200, unique=True)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("model", models.ForeignKey(help_text="The catalog model it stands for.",
                                            on_delete=django.db.models.deletion.CASCADE,
                                            related_name="aliases", to="gateway.modelspec")),
            ],
            options={
                "verbose_name": "model alias",
                "verbose_name_plural": "model aliases",
                "ordering": ["alias"],
            },
        ),
        migrations.AddField(
            model_name="providerkey",
            name="default_input_price_micros_per_mtok",
            field=models.BigIntegerField(
                blank=True, null=True, validators=[django.core.validators.MinValueValidator(0)],
                help_text="Micro-dollars per million input tokens for models that have no price; "
                "empty: such models are refused."),
        ),
        migrations.AddField(
            model_name="providerkey",
            name="default_output_price_micros_per_mtok",
            field=models.BigIntegerField(
                blank=True, null=True, validators=[django.core.validators.MinValueValidator(0)],
                help_text="Micro-dollars per million output tokens for models that have no "
                "price."),
        ),
        migrations.AddConstraint(
            model_name="providerkey",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    models.Q(("default_input_price_micros_per_mtok__isnull", True),
                             ("default_output_price_micros_per_mtok__isnull", True)),
                    models.Q(("default_input_price_micros_per_mtok__gte", 0),
                             ("default_input_price_micros_per_mtok__isnull", False),
                             ("default_output_price_micros_per_mtok__gte", 0),
                             ("default_output_price_micros_per_mtok__isnull", False)),
                    _connector="OR"),
                name="providerkey_default_price_both_or_neither"),
        ),
    ]
