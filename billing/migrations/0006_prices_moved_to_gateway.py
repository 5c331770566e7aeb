"""ModelPrice now belongs to the gateway app (gateway 0003_prices_aliases adds it to the gateway's
state with the same table): remove it from billing's state only; the table and its rows stay."""
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("billing", "0005_usage_corrections"),
        ("gateway", "0003_prices_aliases"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="ModelPrice")],
            database_operations=[],
        ),
    ]
