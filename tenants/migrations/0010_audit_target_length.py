from django.db import migrations, models


class Migration(migrations.Migration):
    """An audit event's target may be a catalog model name (up to 128 characters), not only a
    public id (32): saving a model, price or alias with a longer name failed."""

    dependencies = [
        ("tenants", "0009_responses_context_allowance"),
    ]

    operations = [
        migrations.AlterField(
            model_name="auditevent",
            name="target",
            field=models.CharField(max_length=200),
        ),
    ]
